"""A rank's own hang: a rank that completes no step for its hang limit names itself in a
`stall` event (log word unchanged), and posts it for rank 0 (health/peers.py reads the posts).

What
    The limit is max(monitor.hang_factor x its median step, monitor.hang_min_s). The
    monitor thread (which needs neither the training thread nor any peer) checks it every
    poll_s = hang_min_s / 8 and, once past it, writes one event: the last step, how long
    since, and where the main thread is: its kernel state and wait channel from /proc
    (`futex_do_wait` / S: a lock or a collective's future; R: spinning in Python or a kernel;
    D: uninterruptible I/O) and its Python stack, dumped by faulthandler (which reads other
    threads' frames without their cooperation, as a watchdog must). One event when the hang is
    seen, one when steps resume. A rank of many stopped outside any collective holds its own
    event until pause_s (it is the hung rank, or every rank paused together: rank 0 tells
    which) and posts at once.

    Who holds whom: every event and post says whether the rank stopped inside a collective
    call (`in_collective`, from the comm clock: calls entered and not done). When one rank
    hangs, the others wait for it inside the next collective; the hung rank is the one outside
    any. Collective calls block until done on gloo and in the DDP hook's futures; NCCL calls
    return at enqueue, so there the flight recorder answers (comm/nccl.py
    NcclFlightRecorderComm.in_collective: an entry enqueued and not completed); null where
    neither can tell (NCCL timed another way, comm timing off, a world of one).

Why a median step and a floor
    The first steps of a job (compilation, NCCL set-up, data loading) and checkpoint steps are
    slow; the floor keeps them from being called hangs, the factor scales the watch to the job
    (a 5 s step is not hung after 6 s).

Cost
    A comparison per poll on the monitor thread; at a hang, one /proc read and one faulthandler
    dump (STACK_MAX bytes kept), and one post of under 1 KB (POSTED_FRAMES frames).
"""
from __future__ import annotations

import collections
import faulthandler
import json
import logging
import math
import os
import socket
import statistics
import tempfile
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from placement import _procfs
from placement.records.words import collective_words
from placement.events import EventKind
from placement.roles import main_thread

log = logging.getLogger("placement")

STEP_TIMES_KEPT = 200  # step times the median is taken over (the most recent)
STACK_MAX = 64 * 1024  # bytes of faulthandler output kept
POSTS_MAX = 100  # hang posts one rank makes to the store (a flapping rank must not fill it)
POSTED_FRAMES = 6  # innermost Python frames a post carries (the whole stack is in the rank's own log)


@dataclass(frozen=True)
class Hung:
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


class HangWatch:
    """Fed by the monitor thread: progress (the step counter it sees move) and step times."""

    def __init__(self, factor: float, min_s: float, pause_s: float = math.inf):
        self.factor = factor
        self.min_s = min_s
        self.pause_s = pause_s  # a hang outside any collective in a job of many ranks is written after this
        self.poll_s = max(0.05, min_s / 8)  # the watch looks this often: named within min_s + 1 poll
        self.unwritten: Optional[tuple[str, dict]] = None  # a hang posted, its own event held (held_until)
        self.held_until_s = math.inf
        self.post: Optional[dict[str, Any]] = None  # what the current hang posted (rank 0's peer watch reads it)
        self._times: collections.deque[float] = collections.deque(maxlen=STEP_TIMES_KEPT)
        self._step = 0
        self._since_ns: Optional[int] = None
        self.hung: Optional[Hung] = None  # the hang reported and not yet over
        self.resumed: Optional[int] = None  # the step it resumed at, not yet reported

    def step_times(self, step_ms: Iterable[float]) -> None:
        self._times.extend(step_ms)

    def progress(self, step: int, now_ns: int) -> None:
        self._step, self._since_ns = step, now_ns

    def threshold_s(self) -> float:
        times = list(self._times)  # one copy under the GIL: rank 0's peer watch thread reads it too
        median = statistics.median(times) if times else None
        return self.min_s if median is None else max(self.factor * median / 1e3, self.min_s)

    def check(self, step: int, now_ns: int) -> Optional[Hung]:
        """A new hang (once per hang), else None."""
        if self._since_ns is None or step != self._step:
            if self.hung is not None and self._since_ns is not None:
                self.resumed = step
                self.post = None
            self.progress(step, now_ns)
            return None
        if self.hung is not None:
            return None
        waited = (now_ns - self._since_ns) / 1e9
        threshold = self.threshold_s()
        if waited <= threshold:
            return None
        median = statistics.median(self._times) if self._times else None
        self.hung = Hung(step, waited, threshold, median)
        return self.hung

    def report(self, s: Hung, events, rank: int, in_collective: Optional[bool] = None,
               in_collective_null: Optional[str] = None, *, hold: bool = False) -> dict[str, Any]:
        """Write the `stall` event (and flush it); returns what a peer post carries.
        `in_collective` (comm.CollectiveClock.in_collective): whether the rank waits inside a
        collective call, i.e. for a peer, or stopped outside any (None: cannot tell, and
        `in_collective_null` says why when the comm source gave a reason).
        `hold`: a rank of many stopped outside any collective: it is the hung rank (its peers wait
        for it inside one: rank 0 names it from the posts) or every rank paused together (a
        checkpoint: a job-wide pause, not a fault); so the post goes now and its own event is
        written only once the hang outlasts pause_s (write_held)."""
        where = main_thread_where()
        median = "no step measured yet" if s.median_step_ms is None else f"median step {s.median_step_ms:.1f} ms"
        msg = (f"rank {rank} hung: no step completed for {s.stalled_s:.1f} s after step {s.last_step} "
               f"(limit {s.threshold_s:.1f} s: {median}); main thread {where.tid} state {where.state or '?'} "
               f"waiting in {where.wchan or '?'}")
        innermost = next((line for line in where.stack if line.startswith("File")), None)
        if innermost:
            msg += f", Python at {innermost}"
        msg += collective_words(in_collective)
        fields = dict(phase="stalled", rank=rank, last_step=s.last_step, stalled_s=round(s.stalled_s, 3),
                      threshold_s=round(s.threshold_s, 3),
                      median_step_ms=None if s.median_step_ms is None else round(s.median_step_ms, 3),
                      in_collective=in_collective, main=where.to_dict(), message=msg,
                      **({"in_collective_null": in_collective_null} if in_collective_null else {}))
        if hold:
            self.unwritten = (msg, fields)
            self.held_until_s = max(self.pause_s, s.threshold_s)
        else:
            self._write(events, rank, msg, fields)
        main = where.to_dict()
        main["stack"] = main["stack"][:POSTED_FRAMES]
        self.post = {"phase": "stalled", "rank": rank, "host": socket.gethostname(), "last_step": s.last_step,
                     "stalled_s": round(s.stalled_s, 3), "threshold_s": round(s.threshold_s, 3),
                     "in_collective": in_collective, "main": main, "python": innermost}
        return self.post

    def _write(self, events, rank: int, msg: str, fields: dict) -> None:
        self.unwritten = None
        log.warning("placement: %s", msg)
        stack = fields["main"]["stack"]
        if stack:
            log.warning("placement: rank %d main thread's Python stack (most recent call first):\n  %s",
                        rank, "\n  ".join(stack))
        events.event(EventKind.STALL, **fields)
        events.flush()  # a hung job may be killed next: the event must be on disk now

    def write_held(self, events, rank: int, now_ns: int) -> bool:
        """Write a held `stall` event once the hang has lasted held_until_s (True when written)."""
        if self.unwritten is None or self.hung is None or self._since_ns is None \
                or (now_ns - self._since_ns) / 1e9 <= self.held_until_s:
            return False
        msg, fields = self.unwritten
        waited = (now_ns - self._since_ns) / 1e9
        fields["stalled_s"] = round(waited, 3)
        msg = msg.replace(f"for {self.hung.stalled_s:.1f} s", f"for {waited:.1f} s", 1)
        fields["message"] = msg
        self._write(events, rank, msg, fields)
        return True

    def report_resumed(self, events, rank: int) -> dict[str, Any]:
        """The `resumed` event (only when the hang's own event was written) and its post."""
        s, step = self.hung, self.resumed
        self.hung = self.resumed = self.post = None
        written, self.unwritten = self.unwritten is None, None
        if written:
            msg = f"rank {rank} resumed: step {step} completed after the stall at step {s.last_step}"
            log.warning("placement: %s", msg)
            events.event(EventKind.STALL, phase="resumed", rank=rank, last_step=s.last_step, resumed_step=step, message=msg)
            events.flush()
        return {"phase": "resumed", "rank": rank, "last_step": s.last_step, "resumed_step": step}


def post_line(fields: dict[str, Any]) -> bytes:
    """One hang post as it goes to the store: a JSON line."""
    return (json.dumps(fields, separators=(",", ":"), default=str) + "\n").encode()


def read_posts(raw: bytes, offset: int) -> tuple[list[dict], int]:
    """The complete posts in `raw` after byte `offset`, and the offset after them (a line that
    does not parse is skipped: a post is one append, never torn, but the store is shared)."""
    end = raw.rfind(b"\n") + 1
    out = []
    if end > offset:
        for line in raw[offset:end].splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict) and isinstance(d.get("rank"), int):
                out.append(d)
    return out, max(end, offset)


def main_thread_where() -> MainWhere:
    """The main thread's kernel state and wait channel (/proc), and its Python stack."""
    pid, main = os.getpid(), main_thread()
    state = wchan = None
    try:
        state = _procfs.stat(pid, main.tid).state
        wchan = _procfs.wchan(pid, main.tid)
    except (_procfs.ThreadGone, OSError, ValueError):
        pass
    return MainWhere(pid, state, wchan, tuple(_main_stack()))


def _main_stack() -> list[str]:
    """faulthandler's dump of every thread, cut to the main thread's frames."""
    main = main_thread().ident
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
