"""Re-home processes forked from a bound rank at birth: DataLoader workers to the `dataloader`
set (and its background nice), every other child to the rank's whole share.

A child inherits the mask of the thread that forked it, usually main's narrow core. A DataLoader
worker would compete with main for it until the next rescan, so an after-fork hook moves it
before it runs any user code. Any other child (a user's multiprocessing pool, a helper process)
is not ours to shrink or nice: it gets the rank's share back, as if forked before stage 2.

Which child is a DataLoader worker is read from the fork itself: torch's DataLoader starts each
worker as `multiprocessing_context.Process(target=torch.utils.data._utils.worker._worker_loop)`
(torch/utils/data/dataloader.py, _MultiProcessingDataLoaderIter.__init__), and the fork start
method forks inside multiprocessing.popen_fork.Popen._launch(process_obj), so the hook finds
`process_obj._target` a few frames up. Workers started by spawn or forkserver are not forked from
main: the binder's rescan finds them by name (`pt_data_worker`).

A fork of the rank is also kept from a CPython < 3.12 deadlock (python/cpython#112275). The child
takes the interpreter's thread-list lock (HEAD_LOCK) in PyOS_AfterFork_Child ->
_PyEval_ReInitThreads -> _PyThreadState_DeleteExcept before it re-creates that lock, so a child
forked while another thread held it waits forever, before any Python runs. Threads take it
without the GIL when they make a Python thread state: torch's gloo threads do so each time they
drop the last reference to a tensor Python had let go of, or run a future's Python callback
(pybind11's gil_scoped_acquire in torch/csrc/PyInterpreter.cpp ConcretePyInterpreterVTable::decref
and torch/csrc/jit/python/pybind_utils.h PythonFutureWrapper::then, on ProcessGroupGloo::runLoop;
seen in gdb on torch 2.13; the monitor's own callbacks now keep their thread's state,
monitor/comm/base.py ThreadStates, so on those threads it is taken once). Once a rank's threads
share main's core, such a thread can be preempted inside the lock by main, which then forks:
2 hangs in ~100 Lightning runs under placerun on the dev VM, each child stuck in
_PyThreadState_DeleteExcept. guard_forks() makes each fork wait, GIL held, for the lock to be
free (its holder needs no GIL to let it go). What is left is a thread that takes the lock in the
microseconds between that wait and fork() itself: on main's core that needs main preempted right
there; on another core it is the race torchrun's ranks run too.
"""
from __future__ import annotations

import os
import sys
import weakref
from typing import Callable, Optional

from placement.roles import ThreadRole

_binder: Optional[weakref.ref] = None
_forget_rank: Optional[Callable[[], None]] = None
_registered = False
_WORKER_LOOP = ("torch.utils.data._utils.worker", "_worker_loop")
_FRAMES_UP = 16  # os.fork is called from Popen._launch, a couple of frames above the hook
_guarded = False


def guard_forks() -> None:
    """From now on every os.fork() of this process first waits for the interpreter's thread-list
    lock (see the module doc). Once per process; nothing where the interpreter needs no guard or
    has no C API to reach (3.12 re-creates the lock before the child takes it; where a 3.11 or
    older patch release carries the backport, python/cpython#112336, the guard costs one free
    lock per fork)."""
    global _guarded
    if _guarded or sys.version_info >= (3, 12):
        return
    try:
        import ctypes

        set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    except (ImportError, AttributeError):  # no ctypes, or not CPython
        return
    set_async_exc.argtypes = (ctypes.c_ulong, ctypes.c_void_p)
    set_async_exc.restype = ctypes.c_int

    def wait_for_thread_list_lock() -> None:
        # Takes HEAD_LOCK, finds no thread with id 0 (a pthread_t is never 0), lets it go; PyDLL
        # keeps the GIL. Python/pystate.c PyThreadState_SetAsyncExc (3.10, 3.11).
        set_async_exc(0, None)

    # Before-fork hooks run last-registered first: registered early, this one runs late, next to fork().
    os.register_at_fork(before=wait_for_thread_list_lock)
    _guarded = True


def rehome_forked_children(binder, forget_rank: Optional[Callable[[], None]] = None) -> None:
    """From now on every child forked from this process starts on `binder`'s dataloader set
    (DataLoader workers) or on the rank's share (any other child). `forget_rank` runs first in
    each such child (the Session module's set_current(None): placement code in the child must
    not act for the rank); given by the caller so that this module needs no Session."""
    global _binder, _forget_rank, _registered
    _binder = weakref.ref(binder)
    _forget_rank = forget_rank
    if not _registered:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _registered = True


def stop_rehoming() -> None:
    global _binder, _forget_rank
    _binder = _forget_rank = None


def forking_dataloader_worker(frame=None) -> bool:
    """Whether the fork under way starts a torch DataLoader worker (see the module doc)."""
    f = sys._getframe(1) if frame is None else frame
    for _ in range(_FRAMES_UP):
        if f is None:
            return False
        target = getattr(f.f_locals.get("process_obj"), "_target", None)
        if target is not None:
            return (getattr(target, "__module__", None), getattr(target, "__name__", None)) == _WORKER_LOOP
        f = f.f_back
    return False


def _after_fork_in_child() -> None:
    global _binder, _forget_rank
    binder = _binder() if _binder is not None else None
    forget = _forget_rank
    _binder = _forget_rank = None  # the child is not the rank: its own forks inherit its mask already
    if binder is None:
        return
    if forget is not None:
        forget()
    worker = forking_dataloader_worker(sys._getframe(1))
    cpus = binder.role_cpus(ThreadRole.DATALOADER) if worker else binder.rank_plan.share()
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        nice = binder.dataloader_nice() if worker else 0
        if nice > 0 and os.getpriority(os.PRIO_PROCESS, 0) < nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        pass  # the next rescan in the parent binds a worker and logs any failure
