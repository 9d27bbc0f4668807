"""torch's DataLoader worker-count check, answered for the rank's share instead of main's core.

What
    Before it starts workers, `DataLoader.check_worker_number_rationality` (torch/utils/data/
    dataloader.py, called from `__init__` and `_get_iterator`) warns when `num_workers` exceeds
    the CPUs it counts: `len(os.sched_getaffinity(0))` (torch 2.11; `torch._utils.cpu_count()` in
    2.13, the same call). `sched_getaffinity(0)` is the *calling thread's* mask, and placement
    narrows main to its own core, so every DataLoader with two or more workers warned "Our
    suggested max number of worker in current system is 1" under placerun (seen on an H200,
    docs/benchmarks.md) where torchrun's process mask gives no warning. The check is run with the
    calling thread's mask widened to the rank's share (the stage-1 process mask) for its length.

Why this way
    The check stays torch's own (its count, its message, its `num_workers` rule); only the mask it
    reads is the one a process launched without placement's per-thread narrowing would have.
    Widening for a few microseconds lets no thread be born meanwhile (the check starts none).
    The warning's stacklevel=2 points one frame into this wrapper where torch's would name its own
    caller: the text is unchanged.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Iterable

MODULE = "torch.utils.data.dataloader"
_PATCHED = "_placement_share_check"
# The CPUs the check counts: the latest session's (a later attach() in the process replaces it).
_share: list[Callable[[], Iterable[int]]] = [lambda: ()]


def count_workers_against(module, share: Callable[[], Iterable[int]]) -> None:
    """Wrap module.DataLoader.check_worker_number_rationality (once per class) so that it counts
    `share()`'s CPUs when the calling thread's mask is narrower; `share` replaces the one given
    before and is asked at each call (empty: torch's own reading)."""
    _share[0] = share
    cls = module.DataLoader
    original = cls.check_worker_number_rationality
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def check_worker_number_rationality(loader):
        cpus = set(_share[0]())
        try:
            mine = os.sched_getaffinity(0)
        except OSError:
            return original(loader)
        if not cpus or cpus <= mine:
            return original(loader)
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:  # a share the thread may not widen to (a cpuset changed): torch's own count
            return original(loader)
        try:
            return original(loader)
        finally:
            try:
                os.sched_setaffinity(0, mine)
            except OSError:
                pass

    setattr(check_worker_number_rationality, _PATCHED, True)
    cls.check_worker_number_rationality = check_worker_number_rationality
