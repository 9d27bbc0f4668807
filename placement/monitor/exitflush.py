"""Flush every live monitor when the process ends: normal exit (atexit), SIGTERM (the
previous handler is chained afterwards, so the process still ends the way it would
have), and an uncaught exception in training code (sys.excepthook chained).

A SIGTERM that lands while a monitor is in the middle of a step, or while the thread it
interrupted holds the monitor's or the event log's lock (a user's `handle.events.event(...)`,
a rescan writing `bind` events), is deferred to the end of that step or the release of that
lock: the handler never waits on a lock the interrupted thread may hold (it would wait
forever). The deferral lasts microseconds; the signal is then delivered as it would have been.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import weakref
from typing import Callable, Optional

from placement import events

_monitors: "weakref.WeakSet" = weakref.WeakSet()
_installed = False
_previous_sigterm = None
_previous_excepthook = None
_deferred: Optional[tuple[int, object]] = None
_owner_pid = 0  # a process forked from the rank (a DataLoader worker) inherits the handlers


class FlushGate:
    """The monitor's lock, and whether an exit path (SIGTERM, atexit, the excepthook) may write
    a monitor's records now or must leave it to the end of the step or the lock hold it
    interrupted: the handler runs on the interrupted thread, which must never wait on itself.
    `flush`: the monitor's, runs a deferred flush (then resume_deferred())."""

    __slots__ = ("in_step", "holder", "deferred", "_lock", "_flush")

    def __init__(self, flush: Callable[[], None]) -> None:
        self.in_step = False  # the training thread is inside the step hook
        self.holder: Optional[int] = None  # the thread holding the monitor's lock
        self.deferred = False  # a flush waits for the step's end or the lock's release
        self._lock = threading.Lock()  # the monitor's: its hand-overs, pending steps, writes
        self._flush = flush

    @contextlib.contextmanager
    def holding(self, timeout: float = -1):
        """Hold the monitor's lock (yields False when it was not had within `timeout`). A
        SIGTERM that lands while the main thread holds it is deferred to the release, as one
        mid-step is."""
        if not self._lock.acquire(timeout=timeout):
            yield False
            return
        self.holder = threading.get_ident()
        try:
            yield True
        finally:
            self.holder = None
            self._lock.release()
            self.flush_if_due()

    def defer(self, log_held: bool) -> bool:
        """True (and the flush deferred) when the calling thread is inside a step, holds the
        monitor's lock, or (`log_held`) holds the event log's."""
        if self.in_step or self.holder == threading.get_ident() or log_held:
            self.deferred = True
            return True
        return False

    def flush_if_due(self) -> None:
        """Run a deferred flush if it may run now, on this thread (the main thread, out of the
        step and the lock)."""
        if self.deferred and not self.in_step and self.holder is None \
                and threading.current_thread() is threading.main_thread():
            self.deferred = False
            self._flush()


def register(monitor) -> bool:
    """Flush `monitor` at exit. Returns whether SIGTERM is covered (only the main thread can
    install a signal handler)."""
    global _installed, _previous_excepthook, _previous_sigterm, _owner_pid
    _monitors.add(monitor)
    if _installed:
        return _previous_sigterm is not None
    _installed = True
    _owner_pid = os.getpid()
    events.on_release(resume_deferred)
    atexit.register(_flush_all, "exit")
    _previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook
    if threading.current_thread() is threading.main_thread():
        _previous_sigterm = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
        return True
    return False


def unregister(monitor) -> None:
    _monitors.discard(monitor)


def _flush_all(reason: str) -> bool:
    """Flush every monitor not mid-step; False when one was busy (its flush is deferred).
    Nothing in a forked child: its copy of the log buffer holds the rank's lines, which the
    rank writes itself; writing them from the child too would duplicate them."""
    if os.getpid() != _owner_pid:
        return True
    all_done = True
    for m in list(_monitors):
        try:
            all_done &= m.emergency_flush(reason)
        except Exception:  # flushing must not turn an exit into a traceback
            pass
    if all_done and reason != "exit":  # at exit the events module says it after the last flush
        events.report_all_losses()
    return all_done


def _excepthook(exc_type, exc, tb) -> None:
    _flush_all("exception")
    (_previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)


def _on_sigterm(signum, frame) -> None:
    global _deferred
    if not _flush_all("SIGTERM"):
        _deferred = (signum, frame)
        return
    _chain(signum, frame)


def resume_deferred() -> None:
    """Called at the end of a step and when a monitor's or event log's lock is released:
    deliver a SIGTERM that waited for it (deferred again if something else is still held)."""
    global _deferred
    if _deferred is None or threading.current_thread() is not threading.main_thread():
        return
    signum, frame = _deferred
    _deferred = None
    _on_sigterm(signum, frame)


def _chain(signum, frame) -> None:
    prev = _previous_sigterm
    if prev is signal.SIG_IGN:
        return
    if callable(prev):
        prev(signum, frame)
        return
    # SIG_DFL (or a handler set from C): die of the signal, as the process would have.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
