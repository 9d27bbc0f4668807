"""Hang and stall detection: a rank that completes no step for max(monitor.stall_factor x
its median step, monitor.stall_min_s) is named by itself, on its monitor thread (which
does not need the training thread, nor any peer), in a `stall` event: its last step, how
long since, and where its main thread is: its kernel wait channel and state from /proc
(`futex_do_wait` / S: waiting on a lock or a collective's future; `R`: spinning in
Python or in a kernel; `D`: in uninterruptible I/O) and its Python stack, dumped by
faulthandler (which reads other threads' frames without their cooperation, as a
watchdog must). One event when the stall is seen, one when steps resume.

Why a median step and a floor: the first steps of a job (compilation, NCCL set-up, data
loading) and checkpoint steps are slow; the floor keeps them from being called hangs, the
factor scales the watch to the job (a 5 s step is not stalled after 6 s).
"""
from __future__ import annotations

import collections
import faulthandler
import logging
import os
import statistics
import tempfile
import threading
from dataclasses import dataclass
from typing import Iterable, Optional

from placement import _procfs

log = logging.getLogger("placement")

STEP_TIMES_KEPT = 200  # step times the median is taken over (the most recent)
STACK_MAX = 64 * 1024  # bytes of faulthandler output kept


@dataclass(frozen=True)
class Stalled:
    last_step: int  # the last step the rank completed
    stalled_s: float  # seconds since it completed
    threshold_s: float
    median_step_ms: Optional[float]


@dataclass(frozen=True)
class MainWhere:
    """Where the main thread is: kernel state and wait channel, Python stack."""

    tid: int
    state: Optional[str]
    wchan: Optional[str]
    stack: tuple[str, ...]  # faulthandler's lines for the main thread, innermost first

    def to_dict(self) -> dict:
        return {"tid": self.tid, "state": self.state, "wchan": self.wchan, "stack": list(self.stack)}


class StallWatch:
    """Fed by the monitor thread: progress (the step counter it sees move) and step times."""

    def __init__(self, factor: float, min_s: float):
        self.factor = factor
        self.min_s = min_s
        self.poll_s = max(0.05, min_s / 4)  # the watch looks this often: named within min_s + 2 polls
        self._times: collections.deque[float] = collections.deque(maxlen=STEP_TIMES_KEPT)
        self._step = 0
        self._since_ns: Optional[int] = None
        self.stalled: Optional[Stalled] = None  # the stall reported and not yet over
        self.resumed: Optional[int] = None  # the step it resumed at, not yet reported

    def step_times(self, step_ms: Iterable[float]) -> None:
        self._times.extend(step_ms)

    def progress(self, step: int, now_ns: int) -> None:
        self._step, self._since_ns = step, now_ns

    def threshold_s(self) -> float:
        median = statistics.median(self._times) if self._times else None
        return self.min_s if median is None else max(self.factor * median / 1e3, self.min_s)

    def check(self, step: int, now_ns: int) -> Optional[Stalled]:
        """A new stall (once per stall), else None."""
        if self._since_ns is None or step != self._step:
            if self.stalled is not None and self._since_ns is not None:
                self.resumed = step
            self.progress(step, now_ns)
            return None
        if self.stalled is not None:
            return None
        waited = (now_ns - self._since_ns) / 1e9
        threshold = self.threshold_s()
        if waited <= threshold:
            return None
        median = statistics.median(self._times) if self._times else None
        self.stalled = Stalled(step, waited, threshold, median)
        return self.stalled

    def report(self, s: Stalled, events, rank: int) -> None:
        where = main_thread_where()
        median = "no step measured yet" if s.median_step_ms is None else f"median step {s.median_step_ms:.1f} ms"
        msg = (f"rank {rank} stalled: no step completed for {s.stalled_s:.1f} s after step {s.last_step} "
               f"(limit {s.threshold_s:.1f} s: {median}); main thread {where.tid} state {where.state or '?'} "
               f"waiting in {where.wchan or '?'}")
        innermost = next((line for line in where.stack if line.startswith("File")), None)
        if innermost:
            msg += f", Python at {innermost}"
        log.warning("placement: %s", msg)
        if where.stack:
            log.warning("placement: rank %d main thread's Python stack (most recent call first):\n  %s",
                        rank, "\n  ".join(where.stack))
        events.event("stall", phase="stalled", rank=rank, last_step=s.last_step, stalled_s=round(s.stalled_s, 3),
                     threshold_s=round(s.threshold_s, 3),
                     median_step_ms=None if s.median_step_ms is None else round(s.median_step_ms, 3),
                     main=where.to_dict(), message=msg)
        events.flush()  # a hung job may be killed next: the event must be on disk now

    def report_resumed(self, events, rank: int) -> None:
        s, step = self.stalled, self.resumed
        self.stalled = self.resumed = None
        msg = f"rank {rank} resumed: step {step} completed after the stall at step {s.last_step}"
        log.warning("placement: %s", msg)
        events.event("stall", phase="resumed", rank=rank, last_step=s.last_step, resumed_step=step, message=msg)
        events.flush()


def main_thread_where() -> MainWhere:
    """The main thread's kernel state and wait channel (/proc), and its Python stack."""
    pid = os.getpid()
    state = wchan = None
    try:
        state = _procfs.stat(pid, pid).state
        wchan = _procfs.wchan(pid, pid)
    except (_procfs.ThreadGone, OSError, ValueError):
        pass
    return MainWhere(pid, state, wchan, tuple(_main_stack()))


def _main_stack() -> list[str]:
    """faulthandler's dump of every thread, cut to the main thread's frames."""
    main = threading.main_thread().ident
    with tempfile.TemporaryFile() as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        text = f.read(STACK_MAX).decode(errors="replace")
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            inside = int(line.split("0x", 1)[1].split()[0], 16) == main
            continue
        if inside and line.strip():
            out.append(line.strip())
    return out
