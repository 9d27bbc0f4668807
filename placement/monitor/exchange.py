"""Every monitor.exchange_every steps each rank's window figures reach rank 0, which names the
ranks that hold the others back and writes a `straggler` event.

Transport: the job's own c10d store (torch.distributed's default store, of which every rank
already holds a client: torch elastic's agent store under torchrun/placerun, or the TCPStore
of init_process_group). No process group is created, no port opened, no connection added.
Exchange n lives under two keys of a PrefixStore "placement/exchange":
- every rank, on its monitor thread: `append("<n>/rows", row)` (TCPStore answers no SET or
  APPEND: the client sends and goes on) then `add("<n>/n", 1)` (one round trip);
- rank 0, on its monitor thread, at later hand-overs: `add("<n>/n", 0)` until it reads W (one
  round trip each; at its next exchange it polls for up to WAIT_S, then judges whoever came),
  then one `get("<n>/rows")` of all rows and two `delete_key`s, so the store holds at most the
  keys of the exchanges in flight. `get` only follows a count that says the key exists: a store
  op never waits on a missing key (it would hold the client's lock, torch's TCPStore
  activeOpLock_, against the training thread's own store calls).
A row is (2 + 12 + exchange_every) float64: sequence, node rank, straggler.FIELDS, and the
per-step collective entry times. With exchange_every = 20: 272 bytes.

Cost at W ranks, per exchange:
- every rank, rank 0 included: 2 messages, ~300 bytes out, one round trip: the same at
  16,384 ranks as at 2 (benchmarks/exchange_scale.py measures it per W);
- rank 0: 1 message per poll, then one get of W x 272 bytes (4.3 MiB at 16,384) and the
  judgement, linear in W, all on its monitor thread (placement_mon, never on a hot core);
- the store server: 2W small requests, W x 272 bytes held until rank 0 takes them.
The old design (an all-gather on a side gloo group) connected a full mesh at attach (W-1
sockets per rank) and moved W x row bytes to every rank: O(W^2) for a result only rank 0 uses.

Judging at scale: up to TRIAGE_ABOVE ranks every rank's figures go to straggler.classify. Beyond,
a vectorised pass over all rows finds the candidates (ranks entering their collectives later
than half the lateness limit, the earliest arrivers, the fastest collective) and classify judges
them against an even sample of the punctual ranks (their medians stand for all peers'); the
event names the NAMED worst ranks in full and counts the rest by kind, with their ranks in list
form ("3,17,200-207"). Lateness compares per-step comm durations within the window's steps,
as straggler.arrival_lateness_ms does (no wall clocks: skew-free).
"""
from __future__ import annotations

import math
import os
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from placement.cpuset import format_cpulist
from placement.monitor.straggler import (FIELDS, MIN_COMMON_STEPS, RankFigures, Straggler, StragglerReport, Thresholds, classify,
                                         comm_baseline)
from placement.monitor.warn import WarnOnce, first_line

PREFIX = "placement/exchange"
HEADER = ("seq", "node_rank")
TRIAGE_ABOVE = 512  # ranks beyond which classify sees candidates and a sample of peers
PEER_SAMPLE = 256  # punctual ranks classify compares candidates with, at scale
NAMED = 8  # stragglers an event names in full; the rest are counted by kind
LISTED = 64  # ranks beyond which an event's rank lists are written in range form
COSTS_KEPT = 1000


def default_store():
    """The store of the default process group (every rank holds a client), or None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def node_rank_from_env() -> Optional[int]:
    """torch elastic's GROUP_RANK: which node (agent) this rank runs on."""
    try:
        return int(os.environ["GROUP_RANK"])
    except (KeyError, ValueError):
        return None


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
        raw = self.store.get(f"{seq}/rows")
        self.store.delete_key(f"{seq}/rows")
        self.store.delete_key(f"{seq}/n")
        return bytes(raw)


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


class Exchange:
    # How long rank 0 waits at its next exchange for ranks that have not sent the previous one
    # (a peer more than a whole exchange window behind). The monitor thread waits, not training.
    WAIT_S = 10.0
    POLL_S = 0.01

    def __init__(self, rank: int, world_size: int, store, warn: WarnOnce,
                 on_report: Callable[[StragglerReport, list[RankFigures], dict], None], slots: int,
                 thresholds: Thresholds = Thresholds(), node_rank: Optional[int] = None):
        self.rank = rank
        self.world_size = world_size
        self._warn = warn
        self._on_report = on_report
        self._th = thresholds
        self.slots = slots  # per-step entry times sent (monitor.exchange_every, the same on every rank)
        self.node_rank = node_rank
        self.transfer_history: list[float] = []  # collective time of straggler-free windows
        self._seq = 0
        self._pending: Optional[tuple[int, float]] = None  # rank 0: (seq, monotonic time sent)
        self.transport: Optional[StoreTransport] = StoreTransport(store, rank, world_size)
        # Costs per exchange, the last COSTS_KEPT (benchmarks/exchange_scale.py reads them):
        self.send_us: deque = deque(maxlen=COSTS_KEPT)  # wall time of a submit on the monitor thread
        self.send_cpu_us: deque = deque(maxlen=COSTS_KEPT)  # its CPU time (a round trip's wait is not)
        self.judge_ms: deque = deque(maxlen=COSTS_KEPT)  # rank 0: last poll + take + judge
        self.take_ms: deque = deque(maxlen=COSTS_KEPT)  # rank 0: last poll + take alone

    def submit(self, figs: RankFigures) -> None:
        """Send this rank's figures (rank 0 first finishes the previous exchange)."""
        if self.transport is None:
            return
        self.collect(block=True)
        self._seq += 1
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self.transport.send(self._seq, encode_row(self._seq, self.node_rank, figs, self.slots))
        except Exception as e:
            self._warn("exchange", f"cross-rank exchange through the c10d store failed ({first_line(e)}); "
                                   "straggler naming is off")
            self.transport = None
            return
        self.send_us.append((time.perf_counter() - t0) * 1e6)
        self.send_cpu_us.append((time.thread_time() - c0) * 1e6)
        if self.rank == 0:
            self._pending = (self._seq, time.monotonic())

    def collect(self, block: bool = False) -> None:
        """Rank 0: judge the pending exchange once every rank has sent (with `block`, after at
        most WAIT_S whoever has)."""
        if self._pending is None or self.transport is None:
            return
        seq, sent = self._pending
        t0 = time.perf_counter()
        try:
            n = self.transport.arrived(seq)
            while n < self.world_size and block and time.monotonic() - sent < self.WAIT_S:
                time.sleep(self.POLL_S)
                t0 = time.perf_counter()  # rank 0's cost: from its last poll, not its wait for peers
                n = self.transport.arrived(seq)
            if n < self.world_size and not block:
                return
            self._pending = None
            raw = self.transport.take(seq) if n > 0 else b""
        except Exception as e:
            self._pending = None
            self._warn("exchange", f"cross-rank exchange failed ({first_line(e)})")
            return
        take_ms = (time.perf_counter() - t0) * 1e3
        self.take_ms.append(take_ms)
        rows = decode_rows(raw, self.slots, seq)
        got = Received(seq, rows, self.world_size, take_ms)
        self.judge(got)
        self.judge_ms.append((time.perf_counter() - t0) * 1e3)

    def judge(self, got: Received) -> StragglerReport:
        figures, report, nodes = judge_rows(got.rows, self.slots, self.world_size,
                                            comm_baseline(self.transfer_history, self._th), self._th)
        missing = sorted(set(range(self.world_size)) - {int(r) for r in got.rows[:, len(HEADER)]})
        if missing:
            self._warn(f"exchange-missing:{got.seq}",
                       f"exchange {got.seq}: {len(missing)} rank(s) sent nothing within {self.WAIT_S:.0f} s "
                       f"({_rank_list(missing)}); judged without them")
        if not report.stragglers and report.transfer_ms is not None:
            self.transfer_history = (self.transfer_history + [report.transfer_ms])[-50:]
        self._on_report(report, figures, {"nodes": nodes, "ranks_judged": int(len(got.rows)), "missing": missing})
        return report

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def enabled(self) -> bool:
        return self.transport is not None

    def close(self, timeout_s: float = 2.0) -> None:
        """Rank 0: judge the exchange in flight if its rows come within `timeout_s` (its peers
        sent them a window ago; at exit some may be gone). Nothing to tear down: the store
        belongs to the job."""
        if self._pending is None:
            return
        seq, _sent = self._pending
        self._pending = (seq, time.monotonic() - self.WAIT_S + timeout_s)
        self.collect(block=True)


def _rank_list(ranks: list[int]) -> str:
    return format_cpulist(ranks)


def _lateness(rows, slots: int):
    """Per-rank lateness (ms), vectorised as straggler.arrival_lateness_ms: per step, the most
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


def judge_rows(rows, slots: int, world_size: int, baseline_ms: Optional[float], th: Thresholds):
    """(figures judged, report, {rank: node_rank} of the ranks named) from the rows of one exchange."""
    import numpy as np

    f = {name: len(HEADER) + i for i, name in enumerate(FIELDS)}
    active = rows[rows[:, f["steps"]] > 0]
    node_of = {int(r): (None if math.isnan(n) else int(n)) for r, n in zip(rows[:, f["rank"]], rows[:, 1])}
    if len(active) <= TRIAGE_ABOVE:
        figures = [RankFigures.from_row(r[len(HEADER):].tolist()) for r in rows]
        report = compact(classify(figures, baseline_ms, th))
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
    report = classify(figures, baseline_ms, th)
    all_ranks = [int(r) for r in active[:, f["rank"]]]
    for s in report.stragglers:
        if s.kind == "comm-slow":  # every rank arrived together: all of them, not the sample
            s.ranks = all_ranks
    if report.stragglers:
        named = set(report.names())
        report.waiting = [r for r in all_ranks if r not in named]
    report = compact(report)
    return figures, report, _named_nodes(report, node_of)


def _named_nodes(report: StragglerReport, node_of: dict[int, Optional[int]]) -> dict[int, Optional[int]]:
    return {r: node_of.get(r) for s in report.stragglers for r in (s.ranks if isinstance(s.ranks, list) else [])
            if s.kind != "comm-slow"}


def compact(report: StragglerReport) -> StragglerReport:
    """The report as an event carries it at any W: the NAMED worst stragglers in full, the rest
    counted by kind (`more`), long rank lists in range form."""
    out = StragglerReport(waiting=report.waiting, transfer_ms=report.transfer_ms)
    singles = [s for s in report.stragglers if s.kind != "comm-slow"]
    singles.sort(key=lambda s: -(s.lateness_ms or 0.0))
    more: dict[str, dict] = {}
    for s in singles[NAMED:]:
        m = more.setdefault(s.kind, {"count": 0, "ranks": []})
        m["count"] += len(s.ranks)
        m["ranks"].extend(s.ranks)
    for m in more.values():
        m["ranks"] = _rank_list(m["ranks"])
    out.stragglers = singles[:NAMED] + [
        Straggler(s.kind, _rank_list(s.ranks) if len(s.ranks) > LISTED else s.ranks, s.lateness_ms, s.why)
        for s in report.stragglers if s.kind == "comm-slow"]
    out.more = more
    if len(out.waiting) > LISTED:
        out.waiting = _rank_list(out.waiting)  # type: ignore[assignment]
    return out


def straggler_event(report: StragglerReport, figures: list[RankFigures], extra: dict) -> dict[str, Any]:
    """The fields of rank 0's `straggler` event for one window (figures of the ranks named)."""
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
    nodes = {str(r): n for r, n in (extra.get("nodes") or {}).items() if n is not None}
    if nodes:
        fields["nodes"] = nodes
    fields["ranks_judged"] = extra.get("ranks_judged")
    if extra.get("missing"):
        fields["missing"] = _rank_list(extra["missing"])
    return fields
