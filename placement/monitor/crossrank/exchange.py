"""Every monitor.exchange_every steps each rank's window figures reach rank 0, which judges them
(monitor/stragglers/) and writes a `straggler` event; and what rank 0 learns there of its peers'
liveness, which its peer watch (monitor/health/hang.py PeerWatch) reads.

What
    Exchange n (n: the last step of the window it carries, the same on every rank:
    exchange_steps) lives under two keys of a PrefixStore "placement/exchange" in the job's own
    c10d store:
    - every rank, on its monitor thread: `append("<n>/rows", row)` then `add("<n>/n", 1)`;
    - rank 0, on its monitor thread, at later hand-overs: `add("<n>/n", 0)` until it reads W (at
      its next exchange it polls for up to WAIT_S, then judges whoever came), then one
      `get("<n>/rows")` and two `delete_key`s, so the store holds only the exchanges in flight.
    A row is (2 + 11 + exchange_every) float64: n, node rank, stragglers.figures.FIELDS and the
    per-step collective times (264 bytes at exchange_every = 20). Host names: each rank appends
    "<rank> <node rank> <hostname>" to "hosts" once; rank 0 reads it only when it names a rank
    whose host it does not know yet. Hung peers: a rank whose hang watch fires posts under
    "stalls" (append + add, from a short-lived thread); rank 0's peer watch reads
    `add("stalls/n", 0)` every stall_min_s / 8, `get`s "stalls" only when the count moved, and
    peeks at the exchange in flight once it is older than rank 0's stall threshold (`overdue`).
    A rank that says nothing while some rank waits in a collective (a peer's post, or rank 0's
    own stall, inside one) is named stalled, how "silent", once it has neither posted nor sent a
    row for the threshold, counted from its last row (its last sign of life), after one
    hang-watch poll for the ranks waiting too to post: a frozen or dead host's ranks.

Why this way
    The store is one every rank already holds a client of (torch elastic's agent store under
    torchrun/placerun, or init_process_group's TCPStore): no process group, no port, no
    connection added, O(W) for a result only rank 0 uses. TCPStore answers no SET or APPEND
    (the client sends and goes on). A `get` only follows a count that says the key exists: a
    store op never waits on a missing key, which would hold the client's lock (torch's TCPStore
    activeOpLock_) against the training thread's own store calls; the watch's peek and rank 0's
    `take` of the same rows are serialised by a lock for the same reason. Lateness compares
    per-step comm durations within the window (stragglers/cost.py): no wall clocks, skew-free.

Cost (per exchange, W ranks; benchmarks/exchange_scale.py measures it)
    - every rank: 2 messages, ~300 bytes out, one round trip, whatever W;
    - rank 0: 1 message per poll, one get of W x 272 bytes and the judgement, linear in W, on its
      monitor thread. Beyond TRIAGE_ABOVE ranks a vectorised pass finds the candidates and
      classify judges them against an even sample of PEER_SAMPLE punctual ranks; the event names
      the NAMED worst in full and counts the rest by kind ("3,17,200-207");
    - the store server: 2W small requests, W x 272 bytes held until rank 0 takes them; a row that
      comes after its exchange was judged makes its keys anew, swept for LATE_SWEEPS exchanges.
"""
from __future__ import annotations

import dataclasses
import math
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from placement.cpuset import format_cpulist
from placement.monitor.stragglers.naming import Naming
from placement.monitor.stragglers.cost import MIN_COMMON_STEPS
from placement.records.words import cost_words
from placement.monitor.probes.budget import MAX_EVERY
from placement.monitor.stragglers.figures import FIELDS, RankFigures, StragglerReport, Thresholds
from placement.monitor.stragglers.classify import classify, comm_baseline, next_transfer_history
from placement.monitor.health.hang import NAMED_PEERS, POSTS_MAX, post_line, read_posts
from placement.monitor.warn import WarnOnce, first_line

PREFIX = "placement/exchange"
HEADER = ("seq", "node_rank")
TRIAGE_ABOVE = 512  # ranks beyond which classify sees candidates and a sample of peers
PEER_SAMPLE = 256  # punctual ranks classify compares candidates with, at scale
NAMED = 8  # stragglers an event names in full; the rest are counted by kind
LISTED = 64  # ranks beyond which an event's rank lists are written in range form
COSTS_KEPT = 1000
LATE_SWEEPS = 8  # exchanges during which rank 0 sweeps the keys late rows re-create (Exchange._sweep_late)


def exchange_steps(step: int, every: int) -> tuple[int, int]:
    """The absolute steps (first, last) every rank sends at the exchange of step `step`: the
    `every` steps ending MAX_EVERY - 1 before it. Each rank builds its records up to its own
    last probe step (a probe every MAX_EVERY steps at most, whatever its budget chose), so these
    are built on every rank, whatever its cadence; an exchange waits for its steps to be built
    (their comm figures settled: StepMonitor._send_due_exchanges)."""
    last = step - MAX_EVERY + 1
    return max(1, last - every + 1), last


def default_store():
    """The store of the default process group (every rank holds a client), or None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


@dataclass
class Received:
    """What rank 0 took for one exchange: the rows as an array (W' x row length)."""

    seq: int
    rows: Any  # numpy float64, one row per rank that sent in time
    world_size: int
    take_ms: float  # store time on rank 0: polls, get, deletes
    missing: list[int] = field(default_factory=list)


class StoreTransport:
    """Rows to rank 0 through the c10d store (see the module docstring for the cost)."""

    def __init__(self, store, rank: int, world_size: int):
        import torch.distributed as dist

        self.store = dist.PrefixStore(PREFIX, store)
        self.rank = rank
        self.world_size = world_size

    def send(self, seq: int, row: bytes) -> None:
        self.store.append(f"{seq}/rows", row)
        self.store.add(f"{seq}/n", 1)

    def arrived(self, seq: int) -> int:
        return int(self.store.add(f"{seq}/n", 0))

    def take(self, seq: int) -> bytes:
        """All rows sent so far for `seq` (call after arrived() > 0), and the keys removed."""
        raw = self.peek(seq)
        self.forget(seq)
        return raw

    def forget(self, seq: int) -> None:
        """Remove the keys of `seq` (delete_key of a missing key answers False, it never waits)."""
        self.store.delete_key(f"{seq}/rows")
        self.store.delete_key(f"{seq}/n")

    def peek(self, seq: int) -> bytes:
        """The rows sent so far for `seq`, left in place (call after arrived() > 0)."""
        return bytes(self.store.get(f"{seq}/rows"))

    def post_host(self, rank: int, node_rank: Optional[int], host: str) -> None:
        self.store.append("hosts", f"{rank} {node_rank} {host}\n".encode())

    def read_hosts(self) -> dict[int, tuple[Optional[int], str]]:
        """rank -> (node rank, hostname) of every rank that posted (the last line of a rank wins:
        a restart may place it elsewhere). Call after this rank posted its own line."""
        out = {}
        for line in bytes(self.store.get("hosts")).decode(errors="replace").splitlines():
            rank, node, host = (line.split(" ", 2) + ["", ""])[:3]
            if rank.isdigit():
                out[int(rank)] = (int(node) if node.isdigit() else None, host)
        return out

    def post_hang(self, line: bytes) -> None:
        self.store.append("stalls", line)
        self.store.add("stalls/n", 1)

    def hang_posts(self) -> int:
        return int(self.store.add("stalls/n", 0))

    def read_hangs(self) -> bytes:
        """Every stall post so far (call after hang_posts() > 0)."""
        return bytes(self.store.get("stalls"))


def encode_row(seq: int, node_rank: Optional[int], figs: RankFigures, slots: int) -> bytes:
    values = [float(seq), math.nan if node_rank is None else float(node_rank)] + figs.to_row(slots)
    return struct.pack(f"<{len(values)}d", *values)


def decode_rows(raw: bytes, slots: int, seq: int):
    """The rows of exchange `seq` as a float64 array (a row whose length or sequence does not
    fit is dropped: a peer's stale write)."""
    import numpy as np

    width = len(HEADER) + len(FIELDS) + slots
    n = len(raw) // (8 * width)
    rows = np.frombuffer(raw[:n * 8 * width], dtype="<f8").reshape(n, width)
    return rows[rows[:, 0] == seq]


@dataclass(frozen=True)
class WindowJudgement:
    """Rank 0's judgement of one exchange: what Exchange.collect (and submit, close) return."""

    report: StragglerReport
    figures: list  # RankFigures of every rank judged
    nodes: dict  # rank -> node rank (None where a row did not say)
    ranks_judged: int
    missing: list  # ranks that sent nothing in time
    hosts: dict = field(default_factory=dict)  # rank -> hostname, of the ranks in `nodes`


class Exchange:
    # How long rank 0 waits at its next exchange for ranks that have not sent the previous one
    # (a peer more than a whole exchange window behind). The monitor thread waits, not training.
    WAIT_S = 10.0
    POLL_S = 0.01

    def __init__(self, rank: int, world_size: int, store, warn: WarnOnce, slots: int,
                 thresholds: Thresholds = Thresholds(), node_rank: Optional[int] = None):
        self.rank = rank
        self.world_size = world_size
        self._warn = warn
        self._th = thresholds
        self.slots = slots  # per-step entry times sent (monitor.exchange_every, the same on every rank)
        self.node_rank = node_rank
        self.transfer_history: list[float] = []  # collective time of straggler-free windows
        self.naming = Naming(thresholds)  # rank 0: which candidates are named (precision)
        self._pending: Optional[tuple[int, float]] = None  # rank 0: (seq, monotonic time sent)
        self.transport: Optional[StoreTransport] = StoreTransport(store, rank, world_size)
        self._hosts: dict[int, tuple[Optional[int], str]] = {}  # rank 0: rank -> (node rank, hostname)
        try:
            self.transport.post_host(rank, node_rank, socket.gethostname())
        except Exception as e:
            warn("exchange", f"cross-rank exchange through the c10d store failed ({first_line(e)}); "
                             "straggler naming is off")
            self.transport = None
        # Rank 0's peer watch (health/hang.py PeerWatch, its own thread) against the monitor thread:
        self._take_lock = threading.Lock()  # take() vs the watch's peek() of the same rows
        self._peer_lock = threading.Lock()  # the state below: judge() vs the watch's overdue()
        self._last_step: dict[int, int] = {}  # rank -> last step of its last row judged
        self._missing_since: dict[int, float] = {}  # rank -> send time of the first exchange it missed
        self._silent: set[int] = set()  # ranks named stalled because their rows stopped
        self._peer_events: deque = deque()  # `stall` event fields for the watch to write
        self.peer_threshold_s: Optional[float] = None  # set by rank 0's peer watch (its stall limit)
        self._overdue_seq = 0  # the last exchange checked for overdue rows
        self._late: dict[int, int] = {}  # exchange judged without every rank -> sweeps left
        self._posts_offset: Optional[int] = None  # bytes of "stalls" read (None: not yet looked)
        self._posts_seen = 0  # the posts count at the last read
        self._posts_sent = 0
        # rank -> when its last row seen was sent (rank 0's send time of that exchange: every rank
        # sends a window's row at the same step, within the lateness it is judged for)
        self._heard: dict[int, float] = {}
        self._started = time.monotonic()  # a rank not heard from yet is silent from here
        self._own_waiting_since: Optional[float] = None  # rank 0 itself stalled in a collective
        self._posted: set[int] = set()  # ranks whose last post says stalled (they are alive and said so)
        self._waiting_since: Optional[float] = None  # first post of a peer stalled in a collective
        # Costs per exchange, the last COSTS_KEPT (benchmarks/exchange_scale.py reads them):
        self.send_us: deque = deque(maxlen=COSTS_KEPT)  # wall time of a submit on the monitor thread
        self.send_cpu_us: deque = deque(maxlen=COSTS_KEPT)  # its CPU time (a round trip's wait is not)
        self.judge_ms: deque = deque(maxlen=COSTS_KEPT)  # rank 0: last poll + take + judge
        self.take_ms: deque = deque(maxlen=COSTS_KEPT)  # rank 0: last poll + take alone

    def submit(self, figs: RankFigures, wait_s: Optional[float] = None, at_exit: bool = False) -> Optional[WindowJudgement]:
        """Send this rank's figures under the key of their last step (the same window on every
        rank: exchange_steps), rank 0 first finishing the previous exchange (waiting
        at most WAIT_S since it sent it, or `wait_s`): its verdict is returned."""
        if self.transport is None:
            return None
        verdict = self.collect(block=True, wait_s=wait_s)
        key = figs.last_step
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self.transport.send(key, encode_row(key, self.node_rank, figs, self.slots))
        except Exception as e:
            self._warn("exchange", f"the last window's figures were not sent to rank 0 ({first_line(e)})" if at_exit
                       else f"cross-rank exchange through the c10d store failed ({first_line(e)}); "
                            "straggler naming is off")
            self.transport = None
            return verdict
        self.send_us.append((time.perf_counter() - t0) * 1e6)
        self.send_cpu_us.append((time.thread_time() - c0) * 1e6)
        if self.rank == 0:
            self._pending = (key, time.monotonic())
        return verdict

    def collect(self, block: bool = False, wait_s: Optional[float] = None) -> Optional[WindowJudgement]:
        """Rank 0: judge the pending exchange once every rank has sent (with `block`, after at
        most WAIT_S, or `wait_s` from now, whoever has); its verdict, None when none was judged."""
        if self._pending is None or self.transport is None:
            return None
        seq, sent = self._pending
        until = sent + self.WAIT_S if wait_s is None else time.monotonic() + wait_s
        # Ranks already named stalled because their rows stopped are not waited for: a frozen
        # peer would otherwise cost WAIT_S at every exchange, and once hand-overs queue up
        # (step_monitor.MAX_BACKLOG) the training thread would wait behind it. A row of theirs
        # that comes anyway is judged, and judge() names them resumed.
        expected = self.world_size - len(self._silent)
        t0 = time.perf_counter()
        try:
            n = self.transport.arrived(seq)
            while n < expected and block and time.monotonic() < until:
                time.sleep(self.POLL_S)
                t0 = time.perf_counter()  # rank 0's cost: from its last poll, not its wait for peers
                n = self.transport.arrived(seq)
            if n < expected and not block:
                return None
            with self._take_lock:
                self._pending = None
                raw = self.transport.take(seq) if n > 0 else b""
                if n < self.world_size:
                    self._late[seq] = LATE_SWEEPS
                    if n == 0:
                        self.transport.forget(seq)  # the count key arrived() made
        except Exception as e:
            self._pending = None
            self._warn("exchange", f"cross-rank exchange failed ({first_line(e)})")
            return None
        take_ms = (time.perf_counter() - t0) * 1e3
        self.take_ms.append(take_ms)
        rows = decode_rows(raw, self.slots, seq)
        got = Received(seq, rows, self.world_size, take_ms)
        verdict = self.judge(got, sent)
        self.judge_ms.append((time.perf_counter() - t0) * 1e3)
        self._sweep_late(seq)
        return verdict

    def _sweep_late(self, judged: int) -> None:
        """Rank 0, after judging exchange `judged`: remove the keys that rows arriving after
        their exchange was judged re-created (a late rank's append and add make them anew), for
        LATE_SWEEPS exchanges after each exchange judged without every rank. Without it each late
        row (a rank back from a stall, an NCCL rank whose exchange waited for a poll past
        WAIT_S) would stay in the job's store until the job ends. Cost: one round trip per
        exchange swept, two more when rows came."""
        for seq in list(self._late):
            if seq == judged:
                continue
            try:
                with self._take_lock:
                    if self.transport.arrived(seq) > 0:
                        self.transport.take(seq)
                    else:
                        self.transport.forget(seq)  # the count key arrived() made
            except Exception:
                del self._late[seq]  # the store is failing: the next exchange will say so
                continue
            self._late[seq] -= 1
            if self._late[seq] <= 0:
                del self._late[seq]

    def judge(self, got: Received, sent: Optional[float] = None) -> WindowJudgement:
        candidates: list[StragglerReport] = []

        def name(report: StragglerReport) -> StragglerReport:
            candidates.append(report)
            steps = got.rows[:, len(HEADER) + FIELDS.index("first_step")]
            return self.naming.decide(report, int(steps.min()) if len(steps) else got.seq)

        figures, report, nodes = judge_rows(got.rows, self.slots, self.world_size,
                                            comm_baseline(self.transfer_history, self._th), self._th, name)
        missing = self._rows_seen(got.rows, got.seq, sent)
        if missing:
            self._warn(f"exchange-missing:{format_cpulist(missing)}",  # once per set of ranks missing
                       f"exchange of steps to {got.seq}: {len(missing)} rank(s) sent nothing in time "
                       f"({format_cpulist(missing)}); judged without them")
        if candidates:
            self.transfer_history = next_transfer_history(self.transfer_history, candidates[0])
        return WindowJudgement(report, figures, nodes, int(len(got.rows)), missing,
                       {r: w[1] for r, w in self.where(list(nodes)).items()})

    def where(self, ranks: list[int]) -> dict[int, tuple[Optional[int], str]]:
        """Rank 0: rank -> (node rank, hostname) of those of `ranks` that said (the store is read
        only when one of them is not known yet)."""
        transport = self.transport
        if transport is not None and any(r not in self._hosts for r in ranks):
            try:
                self._hosts.update(transport.read_hosts())
            except Exception as e:
                self._warn("exchange-hosts", f"ranks' host names could not be read from the c10d store ({first_line(e)})")
        return {r: self._hosts[r] for r in ranks if r in self._hosts}

    # ---- stalled peers (rank 0's peer watch thread; health/hang.py) ----------------------------
    def post_hang(self, fields: dict) -> None:
        """A rank (not 0) posts its stall or resume for rank 0, from a short-lived thread: a
        store op may wait on the client's lock, held by a training thread blocked in a store
        call, and the monitor thread must not wait with it."""
        transport = self.transport
        if self.rank == 0 or transport is None or self._posts_sent >= POSTS_MAX:
            return
        self._posts_sent += 1
        line = post_line(fields)

        def post():
            try:
                transport.post_hang(line)
            except Exception as e:
                self._warn("stall-post", f"stall post to rank 0 through the c10d store failed ({first_line(e)})")

        threading.Thread(target=post, name="placement_post", daemon=True).start()

    def hang_posts(self) -> list[dict]:
        """Rank 0: peers' stall posts not read yet (one round trip when there are none). Posts
        from before this exchange's first look (an earlier attach in this job) are skipped."""

        if self.transport is None:
            return []
        n = self.transport.hang_posts()
        if self._posts_offset is not None and n <= self._posts_seen:
            return []
        raw = self.transport.read_hangs() if n > 0 else b""  # n > 0: the key exists
        posts, offset = read_posts(raw, self._posts_offset or 0)
        first_look = self._posts_offset is None
        self._posts_offset, self._posts_seen = offset, n
        if first_look:
            return []
        now = time.monotonic()
        with self._peer_lock:
            for p in posts:
                if p.get("phase", "stalled") == "resumed":
                    self._posted.discard(p["rank"])
                    self._waiting_since = None
                    continue
                self._posted.add(p["rank"])
                if p.get("in_collective") and self._waiting_since is None:
                    self._waiting_since = now
        return posts

    def note_own_wait(self, in_collective: bool) -> None:
        """Rank 0's peer watch: whether rank 0 itself is stalled inside a collective now (its own
        hang watch's post), which is evidence, as a peer's post is, that the job waits for someone."""
        with self._peer_lock:
            if not in_collective:
                self._own_waiting_since = None
            elif self._own_waiting_since is None:
                self._own_waiting_since = time.monotonic()

    def overdue(self, threshold_s: float, grace_s: float = 0.0) -> list[dict]:
        """Rank 0's peer watch: `stall` event fields for the ranks that sent no row for longer
        than `threshold_s` (the exchange in flight is looked at once it is that old, once), and
        for ranks so named whose rows came again (found by judge()). `grace_s`: how long after
        the first sign that ranks wait in a collective the ranks that said nothing are named
        (the other waiting ranks post within one of their watch's polls)."""
        self.peer_threshold_s = threshold_s
        pending = self._pending
        if self.rank == 0 and pending is not None and self.transport is not None:
            seq, sent = pending
            if seq > self._overdue_seq and time.monotonic() - sent > threshold_s:
                self._overdue_seq = seq
                rows = None
                with self._take_lock:
                    if self._pending is not None and self._pending[0] == seq \
                            and self.transport.arrived(seq) < self.world_size:
                        rows = decode_rows(self.transport.peek(seq), self.slots, seq)
                if rows is not None:  # else all came, or judge() took them meanwhile
                    self._rows_seen(rows, seq, sent, update=False)
        self._name_silent(threshold_s, grace_s)
        out = []
        while self._peer_events:
            out.append(self._peer_events.popleft())
        where = self.where([f["rank"] for f in out if "rank" in f]) if out else {}
        for f in out:
            if f.get("rank") in where:
                f["node_rank"], f["host"] = where[f["rank"]]
        return out

    def _name_silent(self, threshold_s: float, grace_s: float) -> None:
        """While some rank waits in a collective (a peer's post, or rank 0's own stall), name the
        ranks that have neither posted nor sent a row for `threshold_s`: their silence counts from
        their last row, their last sign of life, not from when the others noticed their own wait
        (that named a frozen host at twice the limit). The ranks that wait too are given
        `grace_s` after the first sign to post (see the module docstring)."""
        waits = [t for t in (self._waiting_since, self._own_waiting_since) if t is not None]
        now = time.monotonic()
        if self.rank != 0 or not waits or now - min(waits) <= grace_s:
            return
        with self._peer_lock:
            last = {r: self._heard.get(r, self._started) for r in range(1, self.world_size)
                    if r not in self._silent and r not in self._posted}
            silent = sorted(r for r, t in last.items() if now - t > threshold_s)
            if not silent:
                return
            for r in silent:
                self._missing_since.setdefault(r, last[r])
            self._silent.update(silent)
            seq = self._pending[0] if self._pending else max(self._last_step.values(), default=0)
            quiet = now - max(last[r] for r in silent)  # the shortest silence among them
            self._peer_events.extend(_peer_fields("stalled", silent, self._last_step, quiet,
                                                  threshold_s, seq, how="silent"))

    def _rows_seen(self, rows, seq: int, sent: Optional[float], update: bool = True) -> list[int]:
        """The ranks missing from `rows` of exchange `seq` (sent by rank 0 at `sent`); those
        missing since more than peer_threshold_s are named stalled, named ones back resumed
        (as events queued for the peer watch). `update`: these are the exchange's final rows."""
        import numpy as np

        ranks = rows[:, len(HEADER) + FIELDS.index("rank")].astype(int)
        ranks = ranks[(ranks >= 0) & (ranks < self.world_size)]
        seen = np.zeros(self.world_size, dtype=bool)
        seen[ranks] = True
        missing = np.flatnonzero(~seen).tolist()
        with self._peer_lock:
            heard = time.monotonic() if sent is None else sent
            for r in ranks.tolist():  # alive when they sent it, final rows or a peek at the pending ones
                self._heard[r] = max(self._heard.get(r, heard), heard)
            if update:
                self._last_step.update(zip(ranks.tolist(), rows[:, len(HEADER) + FIELDS.index("last_step")]
                                           .astype(int).tolist()))
            back = sorted(r for r in self._missing_since if seen[r])
            for r in back:
                del self._missing_since[r]
            if sent is not None:
                for r in missing:
                    self._missing_since[r] = min(self._missing_since.get(r, sent), sent)
            threshold, now = self.peer_threshold_s, time.monotonic()
            named = [] if threshold is None else sorted(
                r for r in missing if r not in self._silent and now - self._missing_since.get(r, now) > threshold)
            resumed = [r for r in back if r in self._silent]
            self._silent.difference_update(resumed)
            self._silent.update(named)
            if named:
                waited = now - min(self._missing_since[r] for r in named)
                self._peer_events.extend(_peer_fields("stalled", named, self._last_step, waited, threshold, seq))
            if resumed:
                self._peer_events.extend(_peer_fields("resumed", resumed, self._last_step, None, None, seq))
        return missing

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def enabled(self) -> bool:
        return self.transport is not None

    def close(self, timeout_s: float = 2.0) -> Optional[WindowJudgement]:
        """Rank 0: judge the exchange in flight if its rows come within `timeout_s` (its peers
        sent them a window ago; at exit some may be gone), and return its verdict. Nothing to
        tear down: the store belongs to the job."""
        return self.collect(block=True, wait_s=timeout_s)


def _peer_fields(phase: str, ranks: list[int], last_step: dict[int, int], waited: Optional[float],
                 threshold_s: Optional[float], seq: int, how: str = "rows stopped") -> list[dict]:
    """Rank 0's `stall` event fields for peers whose exchange rows stopped (or came again):
    one event per rank up to stall.NAMED_PEERS, else one naming them all in list form."""

    def one(rank_fields: dict, last: Optional[int]) -> dict:
        f = {"phase": phase, **rank_fields, "reported_by": 0, "how": how, "exchange": seq,
             "last_step": last}
        who = f"rank {rank_fields['rank']}" if "rank" in rank_fields else f"{len(ranks)} ranks ({rank_fields['ranks']})"
        if phase == "stalled" and how == "silent":
            f.update(stalled_s=round(waited, 3), threshold_s=round(threshold_s, 3))
            f["message"] = (f"{who}: no stall post and no exchange row for {waited:.1f} s while its peers wait in "
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


def _lateness(rows, slots: int):
    """Per-rank lateness (ms), vectorised as stragglers/cost.py arrival_lateness_ms: per step, the most
    comm time of any rank minus its own (durations on each rank's own clock: no skew), median
    over the steps every rank measured. None when not comparable."""
    import numpy as np

    f = {name: len(HEADER) + i for i, name in enumerate(FIELDS)}
    if len(np.unique(rows[:, f["first_step"]])) != 1 or len(np.unique(rows[:, f["last_step"]])) != 1:
        return None
    comm = rows[:, len(HEADER) + len(FIELDS):len(HEADER) + len(FIELDS) + slots]
    full = np.isfinite(comm).all(axis=0)
    if int(full.sum()) < MIN_COMMON_STEPS:
        return None
    cols = comm[:, full]
    return np.median(cols.max(axis=0) - cols, axis=1)


def judge_rows(rows, slots: int, world_size: int, baseline_ms: Optional[float], th: Thresholds,
               name: Callable[[StragglerReport], StragglerReport] = lambda report: report):
    """(figures judged, report, {rank: node_rank} of the ranks named) from the rows of one exchange;
    `name` picks which candidates are named (Exchange: its Naming), before the report is compacted."""
    import numpy as np

    f = {name: len(HEADER) + i for i, name in enumerate(FIELDS)}
    active = rows[rows[:, f["steps"]] > 0]
    node_of = {int(r): (None if n != n else int(n)) for r, n in zip(rows[:, f["rank"]].tolist(), rows[:, 1].tolist())}
    if len(active) <= TRIAGE_ABOVE:
        figures = [RankFigures.from_row(r[len(HEADER):].tolist()) for r in rows]
        report = compact(name(classify(figures, baseline_ms, th)))
        return figures, report, _named_nodes(report, node_of)
    lat = _lateness(active, slots)
    if lat is None:
        pick = np.arange(min(len(active), PEER_SAMPLE))
    else:
        limit = max(th.late_ms, th.late_frac * float(np.median(active[:, f["step_ms"]])))
        late = np.flatnonzero(lat > 0.5 * limit)
        late = late[np.argsort(-lat[late])][:4 * TRIAGE_ABOVE]
        punctual = np.flatnonzero(lat <= 0.5 * limit)
        sample = punctual[np.linspace(0, len(punctual) - 1, min(PEER_SAMPLE, len(punctual))).astype(int)] \
            if len(punctual) else punctual
        entries = active[:, len(HEADER) + len(FIELDS):len(HEADER) + len(FIELDS) + slots]
        earliest = np.argmax(np.where(np.isfinite(entries), entries, -np.inf), axis=0)  # waited longest
        comm = active[:, f["comm_ms"]]
        fastest = [int(np.nanargmin(comm))] if np.isfinite(comm).any() else []
        pick = np.unique(np.concatenate([late, sample, earliest, fastest]).astype(int))
    figures = [RankFigures.from_row(active[i, len(HEADER):].tolist()) for i in pick]
    report = name(classify(figures, baseline_ms, th))
    all_ranks = [int(r) for r in active[:, f["rank"]]]
    if report.stragglers:
        named = set(report.names())
        report.waiting = [r for r in all_ranks if r not in named]
    report = compact(report)
    return figures, report, _named_nodes(report, node_of)


def _named_nodes(report: StragglerReport, node_of: dict[int, Optional[int]]) -> dict[int, Optional[int]]:
    return {r: node_of.get(r) for s in report.stragglers for r in (s.ranks if isinstance(s.ranks, list) else [])}


def compact(report: StragglerReport) -> StragglerReport:
    """The report as an event carries it at any W: the NAMED worst stragglers in full (costliest
    first), the rest counted by kind (`more`), long rank lists in range form."""
    singles = sorted(report.stragglers, key=lambda s: (-(s.cost_ms_per_step or 0.0), -(s.lateness_ms or 0.0)))
    more: dict[str, dict] = {}
    for s in singles[NAMED:]:
        m = more.setdefault(str(s.kind), {"count": 0, "ranks": []})
        m["count"] += len(s.ranks)
        m["ranks"].extend(s.ranks)
    for m in more.values():
        m["ranks"] = format_cpulist(m["ranks"])
    waiting = format_cpulist(report.waiting) if len(report.waiting) > LISTED else report.waiting
    return dataclasses.replace(report, stragglers=singles[:NAMED], more=more, waiting=waiting)


def straggler_event(v: WindowJudgement) -> dict[str, Any]:
    """The fields of rank 0's `straggler` event for one window (figures of the ranks named)."""
    report, figures = v.report, v.figures
    steps = [f for f in figures if f.steps]
    first = min((f.first_step for f in steps), default=0)
    last = max((f.last_step for f in steps), default=0)
    named = set(report.names()) if all(isinstance(s.ranks, list) for s in report.stragglers) else \
        {r for s in report.stragglers if isinstance(s.ranks, list) for r in s.ranks}
    fields = {"steps": [first, last], **report.to_dict()}
    fields["figures"] = {str(f.rank): {"step_ms": round(f.step_ms, 3), "data_ms": round(f.data_ms, 3),
                                       "comm_ms": None if f.comm_ms is None else round(f.comm_ms, 3),
                                       "stall_ms": None if f.stall_ms() is None else round(f.stall_ms(), 3)}
                         for f in steps if f.rank in named or len(steps) <= NAMED}
    nodes = {str(r): n for r, n in (v.nodes or {}).items() if n is not None}
    if nodes:
        fields["nodes"] = nodes
    if v.hosts:
        fields["hosts"] = {str(r): h for r, h in v.hosts.items()}
    fields["ranks_judged"] = v.ranks_judged
    if v.missing:
        fields["missing"] = format_cpulist(v.missing)
    return fields


def straggler_lines(report: StragglerReport, steps: list[int], hosts: dict[int, str]) -> list[str]:
    """The log lines of one judged window: a line per straggler named (its cost first), one per
    kind counted at scale, one for a job-wide slowdown."""
    first, last = steps
    out = []
    for s in report.stragglers:
        on = sorted({hosts[r] for r in s.ranks if r in hosts}) if isinstance(s.ranks, list) else []
        cost = cost_words(s.cost_ms_per_step, s.cost_pct, s.cost_by_cause)
        out.append(f"placement: straggler {s.kind} rank(s) {s.ranks}{' on ' + ', '.join(on) if on else ''} "
                   f"steps {first}-{last}: {cost + '; ' if cost else ''}{s.why}")
    for kind, more in report.more.items():
        out.append(f"placement: straggler {kind}: {more['count']} more rank(s) steps {first}-{last}: {more['ranks']}")
    job = report.job_wide
    if job is not None:
        out.append(f"placement: job-wide {job.kind} steps {first}-{last}: "
                   f"{cost_words(job.cost_ms_per_step, job.cost_pct, {job.cause: job.cost_ms_per_step})}; {job.why}")
    return out
