"""Re-home processes forked from a bound rank (DataLoader workers) at birth.

A worker forked from `main` inherits main's narrow mask and would compete with it for its
core until the next rescan; an after-fork hook moves it to the `dataloader` set (and its
background nice) before it runs any user code. Workers started by spawn or forkserver are
not forked from main: the binder's rescan finds them by name (`pt_data_worker`).
"""
from __future__ import annotations

import os
import weakref
from typing import Optional

from placement.roles import ThreadRole

_binder: Optional[weakref.ref] = None
_registered = False


def rehome_forked_children(binder) -> None:
    """From now on every child forked from this process starts on `binder`'s dataloader set."""
    global _binder, _registered
    _binder = weakref.ref(binder)
    if not _registered:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _registered = True


def stop_rehoming() -> None:
    global _binder
    _binder = None


def _after_fork_in_child() -> None:
    global _binder
    binder = _binder() if _binder is not None else None
    _binder = None  # the child is not the rank: its own forks inherit its mask already
    if binder is None:
        return
    from placement.bind import session

    session.set_current(None)  # placement code in the child must not act for the rank
    cpus = binder.role_cpus(ThreadRole.DATALOADER)
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        nice = binder.dataloader_nice()
        if nice > 0 and os.getpriority(os.PRIO_PROCESS, 0) < nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        pass  # the next rescan in the parent binds it and logs any failure
