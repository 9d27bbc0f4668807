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

Rank 0 names stalled PEERS too, in its own log (`stall` events with `rank` the peer and
`reported_by` 0), through the job's c10d store the exchange already uses (crossrank/exchange.py), two ways:
- `how: "posted"`: a rank whose watch fires (or that resumes) also posts the event's fields
  (last step, stalled_s, threshold, main thread {tid, state, wchan, its POSTED_FRAMES innermost
  Python frames}; under 1 KB) to the store: `append("stalls", line)` + `add("stalls/n", 1)`, from a
  short-lived thread (a store op can wait on the client's lock, held by a training thread
  blocked in a store call of its own: the monitor thread must not wait with it). Rank 0's
  peer watch thread (`PeerWatch`, rank 0 only) reads `add("stalls/n", 0)` every
  poll_s / 2 (= stall_min_s / 8): one round trip, ~50 bytes; only when the count moved it `get`s
  "stalls" (it exists: the count follows the append on the poster's one connection) and
  writes the new posts. A peer's stall is in rank 0's log within stall_min_s + 2.5 polls of
  its last step (~1.6 x stall_min_s), whether rank 0 still steps or hangs in the collective
  that waits for that peer.
- `how: "rows stopped"`: a rank whose process froze or whose store connection broke posts
  nothing. Rank 0 sent its row of exchange n at time T; a rank whose row of n is not in the
  store at T + rank 0's own stall threshold is named with the last step of its last row
  (one `add` and, only then, one `get` of that exchange's rows, once per exchange), and
  named resumed when its rows come again. This needs rank 0 to reach exchange n, i.e. to
  keep stepping (a job without a collective per step, or a rank that stopped after rank 0's
  exchange); in a synchronous job the posted path names the peer.
Cost when nothing stalls: rank 0, one `add` per stall_min_s / 8 on its peer watch thread; the other
ranks, nothing. When one rank hangs, every rank waits for it in the next collective and posts:
W posts (< 1 KB each: 10 MB at 16,384 ranks, read in one `get` per look), of which rank 0 names
NAMED_PEERS one event each (the likely cause first: `holds_first`) and groups the rest by (last
step, in a collective or not, state, wait channel, innermost frame), one event per group with its
ranks in list form (`peer_events`). Likewise for ranks whose rows stopped.

Who holds whom: every stall event and post says whether the rank stopped inside a collective
call (`in_collective`, from the comm clock: calls entered and not done). When one rank hangs,
the others wait for it inside the next collective; the hung rank is the one outside any (in
the hang test, all share the last step, and only this tells them apart). It is known where
collective calls block until done (gloo, the DDP hook's futures); NCCL calls return at
enqueue, so there the flight recorder answers (comm/nccl.py NcclFlightRecorderComm.in_collective:
an entry enqueued and not completed, one dump at the stall); null where neither can tell (NCCL
timed another way, comm timing off, a world of one).
"""
from __future__ import annotations

import collections
import faulthandler
import json
import logging
import math
import os
import time
import socket
import statistics
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from placement import _procfs
from placement.records.words import cause_first, collective_words
from placement.cpuset import format_cpulist
from placement.events import EventKind
from placement.roles import name_this_thread

log = logging.getLogger("placement")

STEP_TIMES_KEPT = 200  # step times the median is taken over (the most recent)
STACK_MAX = 64 * 1024  # bytes of faulthandler output kept
POSTS_MAX = 100  # stall posts one rank makes to the store (a flapping rank must not fill it)
POSTED_FRAMES = 6  # innermost Python frames a post carries (the whole stack is in the rank's own log)
NAMED_PEERS = 8  # peers rank 0 names in one event each; more at once share one event


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
        self.pause_s = pause_s  # a stall outside any collective in a job of many ranks is written after this
        self.poll_s = max(0.05, min_s / 8)  # the watch looks this often: named within min_s + 1 poll
        self.unwritten: Optional[tuple[str, dict]] = None  # a stall posted, its own event held (held_until)
        self.held_until_s = math.inf
        self.post: Optional[dict[str, Any]] = None  # what the current stall posted (rank 0's peer watch reads it)
        self._times: collections.deque[float] = collections.deque(maxlen=STEP_TIMES_KEPT)
        self._step = 0
        self._since_ns: Optional[int] = None
        self.stalled: Optional[Hung] = None  # the stall reported and not yet over
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
        """A new stall (once per stall), else None."""
        if self._since_ns is None or step != self._step:
            if self.stalled is not None and self._since_ns is not None:
                self.resumed = step
                self.post = None
            self.progress(step, now_ns)
            return None
        if self.stalled is not None:
            return None
        waited = (now_ns - self._since_ns) / 1e9
        threshold = self.threshold_s()
        if waited <= threshold:
            return None
        median = statistics.median(self._times) if self._times else None
        self.stalled = Hung(step, waited, threshold, median)
        return self.stalled

    def report(self, s: Hung, events, rank: int, in_collective: Optional[bool] = None,
               in_collective_null: Optional[str] = None, *, hold: bool = False) -> dict[str, Any]:
        """Write the `stall` event (and flush it); returns what a peer post carries.
        `in_collective` (comm.CollectiveClock.in_collective): whether the rank waits inside a
        collective call, i.e. for a peer, or stopped outside any (None: cannot tell, and
        `in_collective_null` says why when the comm source gave a reason).
        `hold`: a rank of many stopped outside any collective: it is the hung rank (its peers wait
        for it inside one: rank 0 names it from the posts) or every rank paused together (a
        checkpoint: a job-wide pause, not a fault); so the post goes now and its own event is
        written only once the stall outlasts pause_s (write_held)."""
        where = main_thread_where()
        median = "no step measured yet" if s.median_step_ms is None else f"median step {s.median_step_ms:.1f} ms"
        msg = (f"rank {rank} stalled: no step completed for {s.stalled_s:.1f} s after step {s.last_step} "
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
        """Write a held stall event once the stall has lasted held_until_s (True when written)."""
        if self.unwritten is None or self.stalled is None or self._since_ns is None \
                or (now_ns - self._since_ns) / 1e9 <= self.held_until_s:
            return False
        msg, fields = self.unwritten
        waited = (now_ns - self._since_ns) / 1e9
        fields["stalled_s"] = round(waited, 3)
        msg = msg.replace(f"for {self.stalled.stalled_s:.1f} s", f"for {waited:.1f} s", 1)
        fields["message"] = msg
        self._write(events, rank, msg, fields)
        return True

    def report_resumed(self, events, rank: int) -> dict[str, Any]:
        """The `resumed` event (only when the stall's own event was written) and its post."""
        s, step = self.stalled, self.resumed
        self.stalled = self.resumed = self.post = None
        written, self.unwritten = self.unwritten is None, None
        if written:
            msg = f"rank {rank} resumed: step {step} completed after the stall at step {s.last_step}"
            log.warning("placement: %s", msg)
            events.event(EventKind.STALL, phase="resumed", rank=rank, last_step=s.last_step, resumed_step=step, message=msg)
            events.flush()
        return {"phase": "resumed", "rank": rank, "last_step": s.last_step, "resumed_step": step}


def holds_first(post: dict[str, Any]) -> tuple:
    """cause_first of a post."""
    rank = post.get("rank")
    return cause_first(post.get("in_collective"), post.get("last_step"), rank if isinstance(rank, int) else 0)


def post_line(fields: dict[str, Any]) -> bytes:
    """One stall post as it goes to the store: a JSON line."""
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


def peer_event(post: dict[str, Any], threshold_s: Optional[float] = None) -> dict[str, Any]:
    """Rank 0's `stall` event fields for a peer's post (reported_by 0, how "posted")."""
    rank = post["rank"]
    fields = {k: post[k] for k in ("phase", "rank", "host", "last_step", "stalled_s", "threshold_s",
                                   "in_collective", "main", "python", "resumed_step") if k in post}
    fields.update(reported_by=0, how="posted")
    if post.get("phase") == "resumed":
        fields["message"] = (f"rank {rank} resumed (its post, read by rank 0): step {post.get('resumed_step')} "
                             f"completed after the stall at step {post.get('last_step')}")
        return fields
    main = post.get("main") if isinstance(post.get("main"), dict) else {}
    fields["message"] = (f"rank {rank} stalled (its post, read by rank 0): no step completed for "
                         f"{post.get('stalled_s')} s after step {post.get('last_step')}; main thread "
                         f"{main.get('state') or '?'} waiting in {main.get('wchan') or '?'}"
                         + (f", Python at {post['python']}" if post.get("python") else "")
                         + collective_words(post.get("in_collective")))
    return fields


def peer_events(posts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's events for the posts read in one look. A rank that hangs holds every other rank
    up in the next collective, so at 16,384 ranks one hang is 16,384 posts: up to NAMED_PEERS
    stalls (`holds_first`: outside any collective, then the lowest last step) are named one
    event each, the rest in one event per (last step, in a collective, state, wait channel,
    innermost frame) with their ranks in list form; resumes likewise."""
    out = []
    for phase in ("stalled", "resumed"):
        these = sorted((p for p in posts if p.get("phase", "stalled") == phase), key=holds_first)
        out.extend(peer_event(p) for p in these[:NAMED_PEERS])
        groups: dict[tuple, list[dict]] = {}
        for p in these[NAMED_PEERS:]:
            main = p.get("main") if isinstance(p.get("main"), dict) else {}
            stack = main.get("stack") or []
            key = (p.get("last_step"), p.get("in_collective"), main.get("state"), main.get("wchan"),
                   stack[0] if stack else None)
            groups.setdefault(key, []).append(p)
        for (last_step, inside, state, wchan, frame), group in groups.items():
            ranks = format_cpulist([p["rank"] for p in group])
            fields = {"phase": phase, "ranks": ranks, "count": len(group), "last_step": last_step,
                      "reported_by": 0, "how": "posted"}
            if phase == "stalled":
                fields["in_collective"] = inside
                fields["main"] = {"state": state, "wchan": wchan, "stack": [frame] if frame else []}
                fields["message"] = (f"{len(group)} more ranks stalled after step {last_step} (their posts, read "
                                     f"by rank 0), main thread {state or '?'} waiting in {wchan or '?'}"
                                     + (f", Python at {frame}" if frame else "") + collective_words(inside)
                                     + f": ranks {ranks}")
            else:
                fields["message"] = f"{len(group)} more ranks resumed (their posts, read by rank 0): ranks {ranks}"
            out.append(fields)
    return out


def write_peer_hang(events, fields: dict[str, Any]) -> None:
    """Rank 0 writes (and flushes) one `stall` event about a peer, and says it in the log."""
    log.warning("placement: %s", fields.get("message", fields))
    events.event(EventKind.STALL, **fields)
    events.flush()


class PeerWatch:
    """Rank 0's watch over its peers (see the module docstring): a daemon thread
    `placement_peers` that every poll_s / 2 reads the peers' stall posts and the exchange's overdue
    rows, and hands rank 0's `stall` events (as fields) to `write`."""

    def __init__(self, exchange, threshold_s: Callable[[], float], write: Callable[[dict], None],
                 poll_s: float, own: Callable[[], Optional[dict]] = lambda: None,
                 clock: Callable[[], float] = time.monotonic):
        self.exchange = exchange
        self.threshold_s = threshold_s
        self.write = write
        self.poll_s = poll_s
        self.own = own  # rank 0's own current stall post (it posts nothing to the store)
        self.clock = clock
        self._stalled: dict[int, dict] = {}  # peers' stall posts not followed by a resume
        self._held: dict[int, tuple[dict, float]] = {}  # stalled outside any collective, not judged yet
        self._job_paused: Optional[dict] = None  # the job-wide pause reported and not over
        self._own_seen: Optional[dict] = None
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="placement_peers", daemon=True)

    def start(self) -> "PeerWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        name_this_thread(b"placement_peers")
        while not self._stop.wait(self.poll_s / 2):  # one round trip: twice the watch's pace
            if not self.poll():
                return

    def poll(self) -> bool:
        """One look (False: the exchange is off, the watch ends)."""
        ex = self.exchange
        if not ex.enabled:
            return False
        try:
            threshold = self.threshold_s()
            for fields in self.judge(ex.hang_posts(), ex.world_size):
                self.write(fields)
            own = self.own()
            ex.note_own_wait(own is not None and own.get("phase", "stalled") == "stalled"
                             and own.get("in_collective") is True)
            for fields in ex.overdue(threshold, grace_s=self.poll_s):
                self.write(fields)
        except Exception as e:
            if not self._failed:  # said once; the watch goes on (a store hiccup may pass)
                self._failed = True
                log.warning("placement: rank 0's watch over its peers' stalls failed (%s: %s); it goes on",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return True


    def judge(self, posts: list[dict], world_size: int) -> list[dict]:
        """Rank 0's events for the posts read in one look, and for those held before.

        A rank stalled inside a collective waits for a peer: named at once (peer_events). One
        stalled outside any collective is held until it is told apart: some rank waits inside a
        collective -> it holds them: named (the hung rank); every rank of the job stopped,
        none inside a collective -> a job-wide pause (a checkpoint, an evaluation), one event
        for the job and none per rank; neither within HOLD_POLLS watch polls -> named as it
        posted (a job without a collective per step)."""
        now = self.clock()
        out_now: list[dict] = []
        resumed: list[dict] = []
        for p in posts:
            rank = p["rank"]
            if p.get("phase", "stalled") == "stalled":
                self._stalled[rank] = p
                if p.get("in_collective") is True:
                    out_now.append(p)
                else:
                    self._held[rank] = (p, now)
            else:
                self._stalled.pop(rank, None)
                if self._held.pop(rank, None) is None and self._job_paused is None:
                    resumed.append(p)  # a held stall that resumes was never named: nor is its resume
        own = self.own()
        if own is not None and own is not self._own_seen and own.get("in_collective") is not True:
            self._held[own["rank"]] = (own, now)  # rank 0 itself stopped outside any collective
        self._own_seen = own
        stalled = dict(self._stalled)
        if own is not None:
            stalled[own["rank"]] = own
        out: list[dict] = []
        if self._job_paused is not None and len(stalled) < world_size:
            out.append(self._job_event("resumed", self._job_paused, world_size))
            self._job_paused = None
        if self._held:
            waiting = any(p.get("in_collective") is True for p in stalled.values())
            if waiting or min(t for _, t in self._held.values()) < now - HOLD_POLLS * self.poll_s:
                out_now.extend(p for p, _ in self._held.values())
                self._held.clear()
            elif len(stalled) >= world_size and self._job_paused is None:
                self._job_paused = min(stalled.values(), key=lambda p: p.get("last_step") or 0)
                out.append(self._job_event("stalled", self._job_paused, world_size))
                self._held.clear()
        return out + peer_events(out_now + resumed)

    @staticmethod
    def _job_event(phase: str, first: dict, world_size: int) -> dict:
        if phase == "stalled":
            msg = (f"every rank ({world_size}) stopped stepping together after step {first.get('last_step')}, "
                   "none inside a collective: a job-wide pause (a checkpoint, an evaluation), not a hung rank")
        else:
            msg = f"the job-wide pause after step {first.get('last_step')} is over: ranks step again"
        return {"phase": phase, "scope": "job", "ranks": f"0-{world_size - 1}", "count": world_size,
                "last_step": first.get("last_step"), "reported_by": 0, "how": "posted", "message": msg}


HOLD_POLLS = 3  # watch polls rank 0 holds a stall outside any collective before naming it as posted


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
