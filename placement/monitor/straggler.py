"""Which ranks hold the others back, and why: a pure function over per-rank figures.

Collectives make every rank wait for the last one to arrive, so a slow rank shows up
in its peers' comm time, not its own. Arrival tells them apart (C4's receiver-driven
analysis): a rank that enters its collectives well after the earliest one is late; the
others waited. The late rank's own breakdown, against its punctual peers, then says why:
- data-slow: its extra data wait accounts for a good share of the lateness
- cpu-slow: its extra main/NCCL runqueue wait does, or its main thread runs on a
  clearly slower core
- compute-slow: neither (more work, a slower GPU, thermal throttling...)
When every rank arrives together but the collective itself takes much longer than it
used to (the baseline), the verdict is comm-slow: the link or network.

How lateness is measured, so that no clock skew can fake it: from durations each rank
measures on its own clock, never by comparing wall clocks of different hosts (NTP keeps
them 1-10 ms apart, as much as the lateness we look for). A collective ends at the same
moment on every rank (none can finish before the last one's data is in), so a rank that
entered L ms after the earliest spends L ms less inside it: per step, a rank's lateness
is the most comm time of any rank minus its own (summed over the step's collectives,
hence "ms/step"), and its figure is the median over the steps (one GC pause is not a
straggler). Chosen over estimating per-host clock offsets from the collectives' common
end because the durations exist on every backend with no extra moment to record (on
NCCL the CPU never sees a collective end; PyTorch's records give its GPU duration, which
includes the wait for a late peer), need no estimation window, and are exact whatever
the offsets and their drift. Figures are compared step by step: every rank sends the same
absolute steps (RankFigures.first_step .. last_step, exchange_steps below),
whatever its probe cadence.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Optional

from placement.monitor.budget import MAX_EVERY
from placement.monitor.summary import cpu_stall_ms

KINDS = ("cpu-slow", "data-slow", "compute-slow", "comm-slow")

# Steps measured on every rank that a lateness needs (the first exchange of a run may
# cover only the first step or two, warm-up).
MIN_COMMON_STEPS = 3

# Figures each rank sends, in this order, as one float64 tensor (NaN = unknown).
FIELDS = ("rank", "steps", "first_step", "last_step", "step_ms", "data_ms", "comm_ms",
          "main_runq_ms", "nccl_runq_ms", "main_cpu_ms", "main_mhz")


@dataclass
class RankFigures:
    """One rank's means per step over the same steps as its peers (first_step..last_step,
    `steps` of them measured), plus its comm time of each of those steps (step first_step + i
    at index i; None: not measured, or no collective that step)."""

    rank: int
    steps: int
    first_step: int
    last_step: int
    step_ms: float
    data_ms: float
    comm_ms: Optional[float]
    main_runq_ms: Optional[float]
    nccl_runq_ms: Optional[float]
    main_cpu_ms: Optional[float]
    main_mhz: Optional[float]
    comm_steps: tuple[Optional[float], ...] = ()

    @classmethod
    def empty(cls, rank: int, first_step: int = 0, last_step: int = 0) -> "RankFigures":
        """A rank with no measured step in the window."""
        return cls(rank, 0, first_step, last_step, 0.0, 0.0, None, None, None, None, None)

    def to_row(self, slots: int) -> list[float]:
        """FIELDS then `slots` per-step comm times, as floats (NaN = unknown)."""
        head = [math.nan if getattr(self, f) is None else float(getattr(self, f)) for f in FIELDS]
        tail = [math.nan if t is None else float(t) for t in self.comm_steps[:slots]]
        return head + tail + [math.nan] * (slots - len(tail))

    @classmethod
    def from_row(cls, row: list[float]) -> "RankFigures":
        vals = {f: (None if math.isnan(v) else v) for f, v in zip(FIELDS, row)}
        for f in ("rank", "steps", "first_step", "last_step"):
            vals[f] = int(vals[f] or 0)
        vals["step_ms"] = vals["step_ms"] or 0.0
        vals["data_ms"] = vals["data_ms"] or 0.0
        comm = [None if math.isnan(v) else v for v in row[len(FIELDS):]]
        span = max(0, vals["last_step"] - vals["first_step"] + 1) if vals["steps"] else 0
        vals["comm_steps"] = tuple(comm[:span])
        return cls(**vals)

    def stall_ms(self) -> Optional[float]:
        return cpu_stall_ms(self.main_runq_ms, self.nccl_runq_ms)


@dataclass
class Thresholds:
    late_ms: float = 1.0  # a rank is late when it arrives this much after the earliest ...
    late_frac: float = 0.1  # ... and by this fraction of the median step, whichever is larger
    explain_frac: float = 0.3  # an excess (data, runqueue) must account for this share of the lateness
    slow_core_ratio: float = 0.9  # main's MHz below this fraction of its peers' = slower core
    comm_slow_factor: float = 1.5  # collective time over this multiple of the baseline = comm-slow
    baseline_windows: int = 3  # windows of history the comm baseline needs


@dataclass
class Straggler:
    kind: str  # one of KINDS
    ranks: list[int]
    lateness_ms: Optional[float]
    why: str


@dataclass
class StragglerReport:
    stragglers: list[Straggler] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)  # ranks whose comm time grew waiting for them
    transfer_ms: Optional[float] = None  # comm time of the rank that waited least: the collective itself
    # At scale (exchange.compact): stragglers beyond the worst few, counted by kind:
    # kind -> {"count": n, "ranks": "3,17,200-207"}.
    more: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {"stragglers": [asdict(s) for s in self.stragglers], "waiting": self.waiting,
               "transfer_ms": self.transfer_ms}
        if self.more:
            out["more"] = self.more
        return out

    def names(self, kind: Optional[str] = None) -> list[int]:
        return sorted(r for s in self.stragglers if kind is None or s.kind == kind for r in s.ranks)


def _mean(values) -> Optional[float]:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def figures_from_records(rank: int, records: list, first_step: int, last_step: int) -> RankFigures:
    """Means per step of one rank's StepRecords of steps first_step..last_step (the same
    steps on every rank; records outside them are ignored, steps without one are None)."""
    records = [r for r in records if first_step <= r.step <= last_step]
    if not records:
        return RankFigures.empty(rank, first_step, last_step)

    def role(rec, name, attr):
        s = rec.roles.get(name)
        return None if s is None else getattr(s, attr)

    comm_of = {r.step: (r.comm_ms if r.comm_count else None) for r in records}
    return RankFigures(
        rank=rank, steps=len(records), first_step=first_step, last_step=last_step,
        step_ms=_mean(r.step_ms for r in records) or 0.0,
        data_ms=_mean(r.data_ms for r in records) or 0.0,
        comm_ms=_mean(r.comm_ms for r in records),
        comm_steps=tuple(comm_of.get(s) for s in range(first_step, last_step + 1)),
        main_runq_ms=_mean(role(r, "main", "runq_ms") for r in records),
        nccl_runq_ms=_mean(role(r, "nccl", "runq_ms") for r in records),
        main_cpu_ms=_mean(role(r, "main", "cpu_ms") for r in records),
        main_mhz=_mean(role(r, "main", "mhz") for r in records))


def exchange_steps(step: int, every: int) -> tuple[int, int]:
    """The absolute steps (first, last) every rank sends at the exchange of step `step`: the
    `every` steps ending MAX_EVERY - 1 before it. Each rank builds its records up to its own
    last probe step (a probe every MAX_EVERY steps at most, whatever its budget chose), so these
    are built on every rank, whatever its cadence; an exchange waits for its steps to be built
    (their comm figures settled: StepMonitor._send_due_exchanges)."""
    last = step - MAX_EVERY + 1
    return max(1, last - every + 1), last


def comm_baseline(history: list[float], th: Thresholds = Thresholds()) -> Optional[float]:
    """The usual collective time: the median of the straggler-free windows so far (a median,
    not the minimum, so one lucky window does not make every later one look slow)."""
    if len(history) < th.baseline_windows:
        return None
    return statistics.median(history)


def _median(values: list[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _fmt(v: Optional[float]) -> str:
    return "?" if v is None else f"{v:.1f}"


def arrival_lateness_ms(ranks: list[RankFigures]) -> Optional[dict[int, float]]:
    """How late each rank enters its collectives of a step, after the earliest rank, from
    each rank's own comm durations (see the module docstring): per absolute step, the most
    comm time of any rank minus its own; the median over the steps every rank measured
    (robust to one slow step). None when no step was measured on every rank, or the ranks
    sent different steps."""
    if len({(r.first_step, r.last_step) for r in ranks}) != 1:
        return None  # not the same steps: nothing to compare step by step
    per_step: dict[int, list[float]] = {r.rank: [] for r in ranks}
    for i in range(min(len(r.comm_steps) for r in ranks)):
        comm = [r.comm_steps[i] for r in ranks]
        if any(c is None for c in comm):
            continue
        longest = max(comm)
        for r, c in zip(ranks, comm):
            per_step[r.rank].append(longest - c)
    if any(len(v) < MIN_COMMON_STEPS for v in per_step.values()):
        return None  # too few steps to tell lateness from one step's noise
    return {rank: statistics.median(v) for rank, v in per_step.items()}


def classify(ranks: list[RankFigures], baseline_transfer_ms: Optional[float] = None,
             th: Thresholds = Thresholds()) -> StragglerReport:
    """Name the ranks that hold the others back. Pure: same figures, same answer.

    `baseline_transfer_ms`: the usual time of the collectives themselves (see
    comm_baseline), without which comm-slow is never said."""
    ranks = [r for r in ranks if r.steps > 0]
    report = StragglerReport()
    if len(ranks) < 2:
        return report
    comm = [r.comm_ms for r in ranks if r.comm_ms is not None]
    lateness = arrival_lateness_ms(ranks)
    if lateness is None:
        return report  # no collective seen on some rank: arrivals cannot be compared
    median_step = statistics.median(r.step_ms for r in ranks)
    limit = max(th.late_ms, th.late_frac * median_step)
    late = [r for r in ranks if lateness[r.rank] > limit]
    punctual = [r for r in ranks if lateness[r.rank] <= limit]
    report.transfer_ms = min(comm, default=None)
    first = min(punctual, key=lambda r: lateness[r.rank])
    for r in sorted(late, key=lambda r: -lateness[r.rank]):
        lat = lateness[r.rank]
        data_x = r.data_ms - (_median([p.data_ms for p in punctual]) or 0.0)
        peer_stall = _median([p.stall_ms() for p in punctual])
        stall_x = None if r.stall_ms() is None else r.stall_ms() - (peer_stall or 0.0)
        peer_mhz = _median([p.main_mhz for p in punctual])
        slow_core = (r.main_mhz is not None and peer_mhz is not None and r.main_mhz < th.slow_core_ratio * peer_mhz)
        arrives = f"enters its collectives {lat:.1f} ms/step after rank {first.rank}"
        if data_x >= th.explain_frac * lat and data_x >= (stall_x or 0.0):
            kind = "data-slow"
            why = f"{arrives}; waits {r.data_ms:.1f} ms/step for data vs {_fmt(_median([p.data_ms for p in punctual]))} on peers"
        elif stall_x is not None and stall_x >= th.explain_frac * lat:
            kind = "cpu-slow"
            why = (f"{arrives}; its main/NCCL threads wait {r.stall_ms():.1f} ms/step in the runqueue "
                   f"vs {_fmt(peer_stall)} on peers")
        elif slow_core:
            kind = "cpu-slow"
            why = f"{arrives}; its main thread runs at {r.main_mhz:.0f} MHz vs {peer_mhz:.0f} on peers"
        else:
            kind = "compute-slow"
            why = (f"{arrives}; neither data wait ({r.data_ms:.1f} ms) nor runqueue wait "
                   f"({_fmt(r.stall_ms())} ms) explains it")
        report.stragglers.append(Straggler(kind, [r.rank], round(lat, 3), why))
    if late:
        report.waiting = sorted(p.rank for p in punctual)
        return report
    transfer = report.transfer_ms
    if (transfer is not None and baseline_transfer_ms is not None and comm
            and transfer > th.comm_slow_factor * baseline_transfer_ms and transfer - baseline_transfer_ms > th.late_ms):
        excess = transfer - baseline_transfer_ms
        starved = _cpu_starved(ranks, excess, th)
        if starved:
            # The collective is slow because one rank's threads cannot run (its comm threads
            # share a busy core): that rank is cpu-slow, the link is not to blame.
            for r, peer_stall in starved:
                report.stragglers.append(Straggler(
                    "cpu-slow", [r.rank], None,
                    f"all ranks enter together but collectives take {transfer:.1f} ms/step vs "
                    f"{baseline_transfer_ms:.1f} ms before; its main/NCCL threads wait {r.stall_ms():.1f} "
                    f"ms/step in the runqueue vs {_fmt(peer_stall)} on peers"))
            report.waiting = sorted(r.rank for r in ranks if r.rank not in {s.rank for s, _ in starved})
            return report
        report.stragglers.append(Straggler(
            "comm-slow", sorted(r.rank for r in ranks), None,
            f"all ranks enter within {max(lateness.values()):.1f} ms but collectives take {transfer:.1f} ms/step "
            f"vs {baseline_transfer_ms:.1f} ms before and no rank waits for a CPU: the link or network is slow"))
    return report


def _cpu_starved(ranks: list[RankFigures], excess_ms: float, th: Thresholds) -> list[tuple[RankFigures, Optional[float]]]:
    """Ranks whose runqueue wait above their peers' explains a share of the collectives' excess time
    (with the peers' median wait), fewest first: when every rank is starved, nobody stands out."""
    out = []
    for r in ranks:
        stall = r.stall_ms()
        peer = _median([p.stall_ms() for p in ranks if p.rank != r.rank])
        if stall is not None and stall - (peer or 0.0) >= th.explain_frac * excess_ms:
            out.append((r, peer))
    return out if len(out) < len(ranks) else []
