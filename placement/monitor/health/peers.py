"""Rank 0's watch over its peers' liveness: which ranks hang, which are frozen or gone, and a
job-wide pause told apart from both. Its events are rank 0's `stall` events with `rank` the
peer and `reported_by` 0 (log words unchanged).

What
    Three kinds of evidence, all through the job's c10d store (crossrank/exchange.py carries
    them; this module judges them):
    - `how: "posted"`: a rank whose own hang watch fires (health/hang.py) posts the event's
      fields (last step, hang time, limit, main thread state, wait channel and innermost
      frames; under 1 KB). PeerWatch, a thread on rank 0, reads the posts' count every
      poll_s / 2 and the posts only when it moved. A post from inside a collective names its
      rank at once; one from outside any collective is held until it is told apart: some rank
      waits inside a collective -> it holds them (the hung rank); every rank stopped, none
      inside one -> a job-wide pause (a checkpoint), one event for the job; neither within
      HOLD_POLLS polls -> named as it posted.
    - `how: "rows stopped"`: a rank whose row of the exchange rank 0 sent at T is not in the
      store at T + rank 0's own hang limit is named with the last step of its last row (one
      peek at that exchange, once), and named resumed when its rows come again.
    - `how: "silent"`: while some rank waits in a collective (a peer's post, or rank 0's own
      hang inside one), a rank that has neither posted nor sent a row for the limit is named:
      a frozen or dead host's ranks. Its silence counts from its last row, its last sign of
      life, not from when the others noticed their own wait (which named a frozen host at
      twice the limit); the ranks that wait too get one watch poll to post first.
    PeerLiveness holds what rank 0 knows of each peer (the exchange hands it the rows it takes,
    PeerWatch the posts it reads); PeerWatch runs the looks and writes the events. At close it
    takes one last look after rank 0's last exchange, and a rank whose hang ended since its
    monitor thread's last watch posts its resume before its last rows: a job whose steps after a
    hang take less than a poll does not end with that rank named and never resumed.

Why this way
    The store is one every rank already holds a client of: no process group, port or
    connection added. The hung rank itself may post nothing (a frozen process, a cut link);
    its peers' posts and rows are the evidence that the job waits for it.

Cost
    When nothing hangs: rank 0, one `add` per poll_s / 2 (per poll_s while the monitor's budget
    stretches its hand-overs: a hang is then named up to poll_s / 2 later) on its `placement_peers` thread; the
    other ranks, nothing. When one rank hangs, every rank waits for it in the next collective
    and posts: W posts (10 MB at 16,384 ranks, one `get` per look), of which NAMED_PEERS are
    named one event each (the likely cause first: holds_first) and the rest grouped by (last
    step, in a collective or not, state, wait channel, innermost frame), one event per group.

Threads
    PeerLiveness is written by rank 0's monitor thread (the exchange's judgement) and by the
    watch thread (posts, peeks), under its one lock.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from placement.cpuset import format_cpulist
from placement.events import EventKind
from placement.records.words import cause_first, collective_words
from placement.roles import OWN_THREADS

log = logging.getLogger("placement")

NAMED_PEERS = 8  # peers rank 0 names in one event each; more at once share one event
HOLD_POLLS = 3  # watch polls rank 0 holds a hang outside any collective before naming it as posted


class PeerLiveness:
    """Rank 0: when each peer last showed it was alive (a row, a post), and which are named."""

    def __init__(self, world_size: int, clock: Callable[[], float] = time.monotonic):
        self.world_size = world_size
        self.threshold_s: Optional[float] = None  # rank 0's own hang limit (PeerWatch sets it)
        self._clock = clock
        self._lock = threading.Lock()
        self._heard: dict[int, float] = {}  # rank -> when its last row seen was sent (rank 0's send time)
        self._last_step: dict[int, int] = {}  # rank -> last step of its last row judged
        self._missing_since: dict[int, float] = {}  # rank -> send time of the first exchange it missed
        self._silent: set[int] = set()  # ranks named because their rows stopped or they said nothing
        self._posted: set[int] = set()  # ranks whose last post says hung (alive, and said so)
        self._waiting_since: dict[str, float] = {}  # "peer"/"own" -> first sign some rank waits in a collective
        self._events: deque = deque()  # `stall` event fields for the watch to write
        self._started = clock()  # a rank not heard from yet is silent from here

    @property
    def named(self) -> int:
        """How many ranks are named hung for their silence (the exchange does not wait for them)."""
        return len(self._silent)

    def rows_seen(self, seq: int, ranks: list[int], last_steps: Optional[list[int]], missing: list[int],
                  sent: Optional[float]) -> None:
        """Exchange `seq` (sent by rank 0 at `sent`) holds rows of `ranks`, none of `missing`:
        those were alive then. `last_steps`: their rows' last steps, when these are the exchange's
        final rows (None for a peek at an exchange in flight). Ranks missing since more than
        threshold_s are named, named ones that came back resumed."""
        gone = set(missing)
        with self._lock:
            heard = self._clock() if sent is None else sent
            for r in ranks:
                self._heard[r] = max(self._heard.get(r, heard), heard)
            if last_steps is not None:
                self._last_step.update(zip(ranks, last_steps))
            back = sorted(r for r in self._missing_since if r not in gone)
            for r in back:
                del self._missing_since[r]
            if sent is not None:
                for r in missing:
                    self._missing_since[r] = min(self._missing_since.get(r, sent), sent)
            threshold, now = self.threshold_s, self._clock()
            named = [] if threshold is None else sorted(
                r for r in missing if r not in self._silent and now - self._missing_since.get(r, now) > threshold)
            resumed = [r for r in back if r in self._silent]
            self._silent.difference_update(resumed)
            self._silent.update(named)
            if named:
                waited = now - min(self._missing_since[r] for r in named)
                self._events.extend(_peer_fields("stalled", named, self._last_step, waited, threshold, seq))
            if resumed:
                self._events.extend(_peer_fields("resumed", resumed, self._last_step, None, None, seq))

    def posts_read(self, posts: list[dict]) -> None:
        """Peers' posts just read: who said it hangs, and since when some rank waits in a collective."""
        now = self._clock()
        with self._lock:
            for p in posts:
                if p.get("phase", "stalled") == "resumed":
                    self._posted.discard(p["rank"])
                    self._waiting_since.pop("peer", None)
                    continue
                self._posted.add(p["rank"])
                if p.get("in_collective"):
                    self._waiting_since.setdefault("peer", now)

    def own_wait(self, in_collective: bool) -> None:
        """Whether rank 0 itself hangs inside a collective now: evidence, as a peer's post is,
        that the job waits for someone."""
        with self._lock:
            if not in_collective:
                self._waiting_since.pop("own", None)
            else:
                self._waiting_since.setdefault("own", self._clock())

    def name_silent(self, threshold_s: float, grace_s: float, seq: Optional[int]) -> None:
        """While some rank waits in a collective, name the ranks that have neither posted nor
        sent a row for `threshold_s`, `grace_s` after the first sign (the ranks that wait too
        post within one watch poll). `seq`: the exchange in flight, if any."""
        now = self._clock()
        with self._lock:
            if not self._waiting_since or now - min(self._waiting_since.values()) <= grace_s:
                return
            last = {r: self._heard.get(r, self._started) for r in range(1, self.world_size)
                    if r not in self._silent and r not in self._posted}
            silent = sorted(r for r, t in last.items() if now - t > threshold_s)
            if not silent:
                return
            for r in silent:
                self._missing_since.setdefault(r, last[r])
            self._silent.update(silent)
            seq = seq if seq is not None else max(self._last_step.values(), default=0)
            quiet = now - max(last[r] for r in silent)  # the shortest silence among them
            self._events.extend(_peer_fields("stalled", silent, self._last_step, quiet, threshold_s, seq,
                                             how="silent"))

    def take_events(self) -> list[dict]:
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out


def holds_first(post: dict[str, Any]) -> tuple:
    """cause_first of a post."""
    rank = post.get("rank")
    return cause_first(post.get("in_collective"), post.get("last_step"), rank if isinstance(rank, int) else 0)


def peer_event(post: dict[str, Any], threshold_s: Optional[float] = None) -> dict[str, Any]:
    """Rank 0's `stall` event fields for a peer's post (reported_by 0, how "posted")."""
    rank = post["rank"]
    fields = {k: post[k] for k in ("phase", "rank", "host", "last_step", "stalled_s", "threshold_s",
                                   "in_collective", "main", "python", "resumed_step") if k in post}
    fields.update(reported_by=0, how="posted")
    if post.get("phase") == "resumed":
        fields["message"] = (f"rank {rank} resumed (its post, read by rank 0): step {post.get('resumed_step')} "
                             f"completed after the hang at step {post.get('last_step')}")
        return fields
    main = post.get("main") if isinstance(post.get("main"), dict) else {}
    fields["message"] = (f"rank {rank} hung (its post, read by rank 0): no step completed for "
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
                fields["message"] = (f"{len(group)} more ranks hung after step {last_step} (their posts, read "
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
    `placement_peers` that every poll_s / 2 reads the peers' posts and the exchange in flight,
    keeps the exchange's PeerLiveness up to date, and hands rank 0's `stall` events (as fields)
    to `write`."""

    def __init__(self, exchange, threshold_s: Callable[[], float], write: Callable[[dict], None],
                 poll_s: float, own: Callable[[], Optional[dict]] = lambda: None,
                 clock: Callable[[], float] = time.monotonic, stretched: Callable[[], bool] = lambda: False):
        self.exchange = exchange
        self.threshold_s = threshold_s
        self.write = write
        self.poll_s = poll_s
        # the monitor's budget stretched its paced floor (probes/budget.py PacedFloor): look every
        # poll_s, not twice as often (a look is a wake-up and a round trip, ~150 us on a VM)
        self.stretched = stretched
        self.own = own  # rank 0's own current stall post (it posts nothing to the store)
        self.clock = clock
        self._stalled: dict[int, dict] = {}  # peers' stall posts not followed by a resume
        self._held: dict[int, tuple[dict, float]] = {}  # stalled outside any collective, not judged yet
        self._job_paused: Optional[dict] = None  # the job-wide pause reported and not over
        self._own_seen: Optional[dict] = None
        self._stop = threading.Event()
        self._failed = False
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "PeerWatch":
        self._thread = OWN_THREADS.start(self._run, "placement_peers")
        return self

    def close(self, wait_s: float) -> None:
        """At the monitor's close, after its last exchange: stop the thread (waiting at most
        `wait_s` for a look in progress) and take one last look, so that what came since the
        thread's last look is written: a peer's resume posted in the job's last steps, the
        rows of the last exchange that show a named rank back. A job whose last steps run in
        less than a poll otherwise ends with that rank named stalled and never resumed."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(timeout=wait_s)
            if thread.is_alive():
                return  # a look still in progress (a slow store): it writes what it finds
        self.poll()

    def _run(self) -> None:
        # one round trip: twice the watch's pace, or its pace while the budget is stretched
        while not self._stop.wait(self.poll_s if self.stretched() else self.poll_s / 2):
            if not self.poll():
                return

    def poll(self) -> bool:
        """One look (False: the exchange is off, the watch ends)."""
        ex = self.exchange
        if not ex.enabled:
            return False
        live = ex.liveness
        try:
            threshold = self.threshold_s()
            live.threshold_s = threshold
            posts = ex.read_posts()
            live.posts_read(posts)
            for fields in self.hang_events(posts, ex.world_size):
                self.write(fields)
            own = self.own()
            live.own_wait(own is not None and own.get("phase", "stalled") == "stalled"
                          and own.get("in_collective") is True)
            for fields in self._silence(threshold):
                self.write(fields)
        except Exception as e:
            if not self._failed:  # said once; the watch goes on (a store hiccup may pass)
                self._failed = True
                log.warning("placement: rank 0's watch over its peers' hangs failed (%s: %s); it goes on",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return True

    def _silence(self, threshold_s: float) -> list[dict]:
        """`stall` event fields for the ranks whose rows stopped (the exchange in flight is
        peeked at once it is older than `threshold_s`, once), for the silent ones, and for
        those so named whose rows came again; with their hosts."""
        ex, live = self.exchange, self.exchange.liveness
        peek = ex.peek_overdue(threshold_s)
        if peek is not None:
            seq, sent, ranks, missing = peek
            live.rows_seen(seq, ranks, None, missing, sent)
        live.name_silent(threshold_s, self.poll_s, ex.pending_seq)
        out = live.take_events()
        where = ex.where([f["rank"] for f in out if "rank" in f]) if out else {}
        for f in out:
            if f.get("rank") in where:
                f["node_rank"], f["host"] = where[f["rank"]]
        return out

    def hang_events(self, posts: list[dict], world_size: int) -> list[dict]:
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


def _peer_fields(phase: str, ranks: list[int], last_step: dict[int, int], waited: Optional[float],
                 threshold_s: Optional[float], seq: int, how: str = "rows stopped") -> list[dict]:
    """Rank 0's `stall` event fields for peers whose exchange rows stopped (or came again):
    one event per rank up to NAMED_PEERS, else one naming them all in list form."""

    def one(rank_fields: dict, last: Optional[int]) -> dict:
        f = {"phase": phase, **rank_fields, "reported_by": 0, "how": how, "exchange": seq,
             "last_step": last}
        who = f"rank {rank_fields['rank']}" if "rank" in rank_fields else f"{len(ranks)} ranks ({rank_fields['ranks']})"
        if phase == "stalled" and how == "silent":
            f.update(stalled_s=round(waited, 3), threshold_s=round(threshold_s, 3))
            f["message"] = (f"{who}: no hang post and no exchange row for {waited:.1f} s while its peers wait in "
                            f"a collective (limit {threshold_s:.1f} s): frozen, dead or cut from the store; last "
                            f"step exchanged {'?' if last is None else last}")
        elif phase == "stalled":
            f.update(stalled_s=round(waited, 3), threshold_s=round(threshold_s, 3))
            f["message"] = (f"{who}: no exchange row for {waited:.1f} s after rank 0 sent exchange {seq} "
                            f"(limit {threshold_s:.1f} s): stalled, frozen or cut from the store; last step "
                            f"exchanged {'?' if last is None else last}")
        else:
            f["message"] = f"{who}: exchange rows arrive again (exchange {seq}), after the stall"
        return f

    if len(ranks) <= NAMED_PEERS:
        return [one({"rank": r}, last_step.get(r)) for r in ranks]
    lasts = [last_step[r] for r in ranks if r in last_step]
    return [one({"ranks": format_cpulist(ranks), "count": len(ranks)}, max(lasts) if lasts else None)]
