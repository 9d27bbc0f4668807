"""Every monitor.exchange_every steps each rank's window figures reach rank 0 through the job's
c10d store; rank 0 judges them (stragglers/event.py) and hands what the rows say of its peers'
liveness to health/peers.py. The only monitor code that talks to the store.

What
    Exchange n (n: the last step of the window it carries, the same on every rank:
    exchange_steps) lives under two keys of a PrefixStore "placement/exchange" in the job's own
    c10d store:
    - every rank but rank 0, on its monitor thread: `append("<n>/rows", rows)` then
      `add("<n>/n", 1)`, a row per window the exchange carries (one; on the exchange grid, the
      windows since the last exchange: crossrank/schedule.py), each judged on its own;
    - rank 0, on its monitor thread, keeps its own rows (read first: a row in the store that
      says it is rank 0's is a duplicate) and at later hand-overs: `add("<n>/n", 0)` until it
      reads W - 1 (at its next exchange it polls for up to WAIT_S, then judges whoever came),
      then one `get("<n>/rows")` and two `delete_key`s, so the store holds only the exchanges
      in flight.
    A row is an 8-byte mark (MARK) then (2 + 12 + exchange_every) float64: n, node rank,
    stragglers.figures.FIELDS and the per-step collective times (280 bytes at exchange_every =
    20: crossrank/rows.py); rank 0 validates every row (decode_rows). Host names: each rank appends
    "<rank> <node rank> <hostname>" to "hosts" once; rank 0 reads it only when it names a rank
    whose host it does not know yet. Hang posts: a rank whose hang watch fires posts under
    "stalls" (append + add, from a short-lived thread); rank 0's peer watch reads
    `add("stalls/n", 0)` each poll, `get`s "stalls" only when the count moved (read_posts), and
    peeks at the exchange in flight once it is older than rank 0's hang limit (peek_overdue).

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
    - every rank but rank 0: 2 messages, ~300 bytes out, one round trip, whatever W;
    - rank 0: 1 message per poll, one get of (W - 1) x 280 bytes and the judgement, linear in W, on its
      monitor thread. Beyond TRIAGE_ABOVE ranks a vectorised pass finds the candidates and
      classify judges them against an even sample of PEER_SAMPLE punctual ranks; the event names
      the NAMED worst in full and counts the rest by kind ("3,17,200-207");
    - the store server: 2(W - 1) small requests, (W - 1) x 280 bytes held until rank 0 takes them; a row that
      comes after its exchange was judged makes its keys anew, swept for LATE_SWEEPS exchanges.
"""
from __future__ import annotations

import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from placement.cpuset import format_cpulist
from placement.monitor.health.hang import POSTS_MAX, post_line, read_posts
from placement.monitor.health.peers import PeerLiveness
from placement.monitor.crossrank.rows import (HEADER, SEQ, batch_windows, decode_rows, encode_row, row_ranks,
                                               split_rows)
from placement.monitor.probes.budget import MAX_EVERY
from placement.monitor.stragglers.classify import comm_baseline, next_transfer_history
from placement.monitor.stragglers.event import WindowJudgement, judge_rows
from placement.monitor.stragglers.figures import FIELDS, RankFigures, StragglerReport, Thresholds
from placement.monitor.stragglers.naming import Naming
from placement.monitor.warn import WarnOnce, first_line
from placement.roles import OWN_THREADS

PREFIX = "placement/exchange"
COSTS_KEPT = 1000
MAX_GRID_STRIDE = 64  # the most windows per exchange a grid may say (schedule.py: at 1 ms steps, ~1.3 s)
MAX_GRID_SEGMENTS = 16  # the most segments a grid may have (schedule.py: rank 0 adds one as the floor moves)
GRID_MAX = 40 * MAX_GRID_SEGMENTS  # bytes of the grid's line read at most ("<since> <stride>" a segment)
LATE_SWEEPS = 8  # exchanges during which rank 0 sweeps the keys late rows re-create (Exchange._sweep_late)


def exchange_steps(step: int, every: int) -> tuple[int, int]:
    """The absolute steps (first, last) every rank sends at the exchange of step `step`: the
    `every` steps ending MAX_EVERY - 1 before it. Each rank builds its records up to its last
    reading of the counters; the hand-over of step `step` takes one at its last step
    (probes/sampled.py), and the lag leaves room for one that lands a few steps past it. So
    these are built on every rank at that hand-over, whatever its cadence; an exchange waits
    for its steps to be built (their comm figures settled: StepMonitor._send_due_exchanges)."""
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
    """What rank 0 took for one window of an exchange: its rows as an array (W' x row length)."""

    seq: int
    rows: Any  # numpy float64, one row per rank that sent in time
    world_size: int
    take_ms: float  # store time on rank 0: polls, get, deletes


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

    def post_grid(self, line: bytes) -> None:
        self.store.set("grid", line)
        self.store.add("grid/n", 1)

    def read_grid(self, known: int) -> Optional[tuple[int, bytes]]:
        """(posts so far, the grid rank 0 posted last), None while there are no more than `known`
        posts (one round trip then)."""
        n = int(self.store.add("grid/n", 0))
        if n <= known:
            return None
        return n, bytes(self.store.get("grid"))[:GRID_MAX]

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


class Exchange:
    # How long rank 0 waits at its next exchange for ranks that have not sent the previous one
    # (a peer more than a whole exchange window behind). The monitor thread waits, not training.
    WAIT_S = 10.0
    # Its polls back off from POLL_S to POLL_MAX_S: each is a store round trip (~60 us of the
    # monitor thread's CPU), and a peer a hand-over behind (monitor.handover_min_s) would
    # otherwise cost a hundred of them a second.
    POLL_S = 0.01
    POLL_MAX_S = 0.1

    def __init__(self, rank: int, world_size: int, store, warn: WarnOnce, slots: int,
                 thresholds: Thresholds = Thresholds(), node_rank: Optional[int] = None,
                 liveness: Optional[PeerLiveness] = None):
        self.rank = rank
        self.world_size = world_size
        self._warn = warn
        self._th = thresholds
        self.slots = slots  # per-step entry times sent (monitor.exchange_every, the same on every rank)
        self.node_rank = node_rank
        self.liveness = liveness  # rank 0: what the rows it takes say of its peers (health/peers.py)
        self.transfer_history: list[float] = []  # collective time of straggler-free windows
        self.naming = Naming(thresholds)  # rank 0: which candidates are named (precision)
        self._pending: Optional[tuple[int, float]] = None  # rank 0: (seq, monotonic time sent)
        self._pending_windows = 1  # rank 0: the windows the pending exchange carries
        self._own = b""  # rank 0: its own rows of the pending exchange (they never go through the store)
        self.transport: Optional[StoreTransport] = StoreTransport(store, rank, world_size)
        self._hosts: dict[int, tuple[Optional[int], str]] = {}  # rank 0: rank -> (node rank, hostname)
        try:
            self.transport.post_host(rank, node_rank, socket.gethostname())
        except Exception as e:
            warn("exchange", f"cross-rank exchange through the c10d store failed ({first_line(e)}); "
                             "straggler naming is off")
            self.transport = None
        self._take_lock = threading.Lock()  # take() vs the peer watch's peek() of the same rows
        self._peeked = 0  # the last exchange in flight the peer watch peeked at
        self._late: dict[int, int] = {}  # exchange judged without every rank -> sweeps left
        self._posts_offset: Optional[int] = None  # bytes of "stalls" read (None: not yet looked)
        self._posts_seen = 0  # the posts count at the last read
        self._posts_sent = 0
        # Costs per exchange, the last COSTS_KEPT (benchmarks/exchange_scale.py reads them):
        self.send_us: deque = deque(maxlen=COSTS_KEPT)  # wall time of a submit on the monitor thread
        self.send_cpu_us: deque = deque(maxlen=COSTS_KEPT)  # its CPU time (a round trip's wait is not)
        self.judge_ms: deque = deque(maxlen=COSTS_KEPT)  # rank 0: last poll + take + judge
        self.rows_dropped = 0  # rank 0: rows read from the store and dropped as bad (decode_rows)
        self.take_ms: deque = deque(maxlen=COSTS_KEPT)  # rank 0: last poll + take alone

    def submit(self, windows: list[RankFigures], wait_s: Optional[float] = None,
               at_exit: bool = False) -> list[WindowJudgement]:
        """Send this rank's figures of `windows` (consecutive exchange windows, oldest first:
        one, or the grid's stride of them, schedule.py) in one row each, all under the key of
        the last one's last step (the same windows on every rank: exchange_steps), rank 0 first
        finishing the previous exchange (waiting at most WAIT_S since it sent it, or `wait_s`):
        its verdicts are returned, a window each."""
        if self.transport is None:
            return []
        verdicts = self.collect(block=True, wait_s=wait_s)
        key = windows[-1].last_step
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            rows = b"".join(encode_row(f.last_step, self.node_rank, f, self.slots) for f in windows)
            if self.rank == 0:
                # Rank 0 judges: its own rows stay here, read first (a row that says it is rank 0
                # in the store is then a duplicate), and its exchange is two round trips fewer
                self._own = rows
            else:
                self.transport.send(key, rows)
        except Exception as e:
            self._warn("exchange", f"the last window's figures were not sent to rank 0 ({first_line(e)})" if at_exit
                       else f"cross-rank exchange through the c10d store failed ({first_line(e)}); "
                            "straggler naming is off")
            self.transport = None
            return verdicts
        self.send_us.append((time.perf_counter() - t0) * 1e6)
        self.send_cpu_us.append((time.thread_time() - c0) * 1e6)
        if self.rank == 0:
            self._pending = (key, time.monotonic())
            self._pending_windows = len(windows)
        return verdicts

    def collect(self, block: bool = False, wait_s: Optional[float] = None) -> list[WindowJudgement]:
        """Rank 0: judge the pending exchange's windows once every rank has sent (with `block`,
        after at most WAIT_S, or `wait_s` from now, whoever has); their verdicts, oldest first,
        none when it was not judged."""
        if self._pending is None or self.transport is None:
            return []
        seq, sent = self._pending
        windows = self._pending_windows
        until = sent + self.WAIT_S if wait_s is None else time.monotonic() + wait_s
        # Ranks already named stalled because their rows stopped are not waited for: a frozen
        # peer would otherwise cost WAIT_S at every exchange, and once hand-overs queue up
        # (step_monitor.MAX_BACKLOG) the training thread would wait behind it. A row of theirs
        # that comes anyway is judged, and judge() names them resumed.
        expected = self.world_size - 1 - (self.liveness.named if self.liveness is not None else 0)  # peers' rows
        t0 = time.perf_counter()
        try:
            n = self.transport.arrived(seq)
            poll_s = self.POLL_S
            while n < expected and block and time.monotonic() < until:
                time.sleep(min(poll_s, max(0.0, until - time.monotonic())))
                poll_s = min(self.POLL_MAX_S, 2 * poll_s)
                t0 = time.perf_counter()  # rank 0's cost: from its last poll, not its wait for peers
                n = self.transport.arrived(seq)
            if n < expected and not block:
                return []
            with self._take_lock:
                self._pending = None
                own, self._own = self._own, b""
                raw = own + (self.transport.take(seq) if n > 0 else b"")
                if n < self.world_size - 1:
                    self._late[seq] = LATE_SWEEPS
                    if n == 0:
                        self.transport.forget(seq)  # the count key arrived() made
        except Exception as e:
            self._pending, self._own = None, b""
            self._warn("exchange", f"cross-rank exchange failed ({first_line(e)})")
            return []
        take_ms = (time.perf_counter() - t0) * 1e3
        self.take_ms.append(take_ms)
        rows, bad = decode_rows(raw, self.slots, seq, self.world_size, windows)
        if bad:
            self.rows_dropped += bad
            self._warn("exchange-bad-rows", f"exchange of steps to {seq}: {bad} row(s) read from the c10d store "
                                            "dropped (not a rank of this job, not finite, negative, duplicated or of "
                                            "the wrong length); the window is judged on the rest; further ones are "
                                            "counted (the end event's exchange_rows_dropped)")
        verdicts = [self.judge(Received(w, window_rows, self.world_size, take_ms), sent)
                    for w, window_rows in batch_windows(rows, seq, self.slots, windows)]
        self.judge_ms.append((time.perf_counter() - t0) * 1e3)
        self._sweep_late(seq)
        return verdicts

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
        ranks, last_steps, missing = row_ranks(got.rows, self.world_size)

        def name(report: StragglerReport) -> StragglerReport:
            candidates.append(report)
            steps = got.rows[:, len(HEADER) + FIELDS.index("first_step")].tolist()
            return self.naming.decide(report, int(min(steps)) if steps else got.seq, missing)

        figure_rows, node_of = split_rows(got.rows)
        figures, report, nodes = judge_rows(figure_rows, node_of, self.slots,
                                            comm_baseline(self.transfer_history, self._th), self._th, name)
        if self.liveness is not None:
            self.liveness.rows_seen(got.seq, ranks, last_steps, missing, sent)
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

    # ---- hang posts and peeks (rank 0's peer watch thread, health/peers.py) --------------------
    def post_hang(self, fields: dict, wait_s: float = 0.0) -> None:
        """A rank (not 0) posts its hang or resume for rank 0, from a short-lived thread: a
        store op may wait on the client's lock, held by a training thread blocked in a store
        call, and the monitor thread must not wait with it. `wait_s`: how long to wait for the
        post to be in the store (at close: before this rank's last rows, which rank 0 waits
        for before its last look)."""
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

        thread = OWN_THREADS.start(post, "placement_post")
        if wait_s > 0:
            thread.join(timeout=wait_s)

    def read_posts(self) -> list[dict]:
        """Rank 0: peers' hang posts not read yet (one round trip when there are none). Posts
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
        return [] if first_look else posts

    def peek_overdue(self, threshold_s: float) -> Optional[tuple[int, float, list[int], list[int]]]:
        """Rank 0: (seq, time sent, ranks whose rows came, ranks whose rows did not) of the
        exchange in flight once it is older than `threshold_s` and still short of rows (once per
        exchange), else None."""
        pending = self._pending
        if self.rank != 0 or pending is None or self.transport is None:
            return None
        seq, sent = pending
        if seq <= self._peeked or time.monotonic() - sent <= threshold_s:
            return None
        self._peeked = seq
        with self._take_lock:
            if self._pending is None or self._pending[0] != seq:
                return None  # judge() took them meanwhile
            n = self.transport.arrived(seq)
            if n >= self.world_size - 1:
                return None  # every peer's came
            raw = self._own + (self.transport.peek(seq) if n > 0 else b"")  # (get waits for a key not made yet)
            rows, _ = decode_rows(raw, self.slots, seq, self.world_size, self._pending_windows)
        ranks, _, missing = row_ranks(rows[rows[:, SEQ] == seq], self.world_size)
        return seq, sent, ranks, missing

    # ---- the exchange grid (schedule.py ExchangeGrid: which windows are exchanged) ---------------
    def post_grid(self, segments: tuple[tuple[int, int], ...]) -> None:
        """Rank 0: the grid's segments: from each `since` on, every `stride`-th window is exchanged."""
        if self.transport is not None:
            try:
                self.transport.post_grid(" ".join(f"{since} {stride}" for since, stride in segments).encode())
            except Exception as e:
                self._warn("exchange", f"cross-rank exchange through the c10d store failed ({first_line(e)})")

    def read_grid(self, known: int = 0) -> Optional[tuple[int, tuple[tuple[int, int], ...]]]:
        """(posts so far, the segments (since, stride) as rank 0 posted them last), None before
        it did or while there are no more than `known` posts. A line that is not pairs of whole
        numbers, each `since` after the one before and on a step of both its stride and the one
        before (multiples of this exchange's window), each stride a power of two up to
        MAX_GRID_STRIDE, at most MAX_GRID_SEGMENTS of them, is said once and read as every window
        from now on: no segment."""
        if self.transport is None:
            return None
        try:
            got = self.transport.read_grid(known)
        except Exception as e:
            self._warn("exchange", f"cross-rank exchange through the c10d store failed ({first_line(e)})")
            return None
        if got is None:
            return None
        n, raw = got
        parts = raw.split()
        segments: list[tuple[int, int]] = []
        ok = 0 < len(parts) <= 2 * MAX_GRID_SEGMENTS and len(parts) % 2 == 0 and \
            all(p.isdigit() and len(p) <= 18 for p in parts)
        before, prev = 0, 1
        for since, stride in zip(map(int, parts[::2]), map(int, parts[1::2])) if ok else ():
            if not (since > before and 1 <= stride <= MAX_GRID_STRIDE and stride & (stride - 1) == 0
                    and since % (self.slots * max(prev, stride)) == 0):
                ok = False
                break
            segments.append((since, stride))
            before, prev = since, stride
        if ok:
            return n, tuple(segments)
        self._warn("exchange-grid", f"the exchange grid read from the c10d store ({raw[:32]!r}) is not "
                                    "'<since> <stride> ...' (each since later than the one before and a "
                                    "multiple of monitor.exchange_every x both strides, each stride a power of "
                                    f"two up to {MAX_GRID_STRIDE}); every window is exchanged")
        return n, ()

    def forget(self, seq: int) -> None:
        """Remove the keys of exchange `seq` (a window this rank sent that nobody will take)."""
        if self.transport is not None:
            try:
                with self._take_lock:
                    self.transport.forget(seq)
            except Exception as e:
                self._warn("exchange", f"cross-rank exchange through the c10d store failed ({first_line(e)})")

    @property
    def pending_seq(self) -> Optional[int]:
        pending = self._pending
        return None if pending is None else pending[0]

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def enabled(self) -> bool:
        return self.transport is not None

    def close(self, timeout_s: float = 2.0) -> list[WindowJudgement]:
        """Rank 0: judge the exchange in flight if its rows come within `timeout_s` (its peers
        sent them a window ago; at exit some may be gone), and return its verdicts. Nothing to
        tear down: the store belongs to the job."""
        return self.collect(block=True, wait_s=timeout_s)
