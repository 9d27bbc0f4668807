"""Which ranks hold the others back, and why: the figures each rank sends (RankFigures, made from
its records by figures_from_records), the thresholds, and the report they are judged into
(StragglerReport); the judgement itself, a pure function over them, is classify.py.

What
    Collectives make every rank wait for the last one to arrive, so a slow rank shows up
    in its peers' comm time, not its own. Arrival tells them apart (C4's receiver-driven
    analysis): a rank that enters its collectives well after the earliest one is late; the
    others waited. The late rank's own breakdown, against its punctual peers, then says why:
    - data-slow: its extra data wait accounts for a good share of the lateness
    - cpu-slow: its extra main/NCCL runqueue wait does, or its main thread runs on a
      clearly slower core
    - compute-slow: neither (more work, a slower GPU, thermal throttling...)
    When every rank arrives together but the collective itself takes much longer than its
    baseline, the verdict is comm-slow: the link or network.

    What a straggler costs, and how lateness is measured step by step: monitor/stragglers/cost.py.

How lateness is measured
    So that no clock skew can fake it: from durations each rank measures on its own clock,
    never by comparing wall clocks of different hosts (NTP keeps them 1-10 ms apart, as much as
    the lateness we look for). A collective ends at the same moment on every rank (none can
    finish before the last one's data is in), so a rank that arrived L ms after the earliest
    waits L ms less for it: per step, a rank's lateness is the most comm wait of any rank
    minus its own (summed over the step's collectives, hence "ms/step"), and its figure is the
    median over the steps (one GC pause is not a straggler). Comm wait, not comm in flight
    (records/parts.py): DDP's buckets are in flight while backward computes, on the rank that
    computes longer as on the ranks that wait for it, so their time in flight tells neither
    apart; the time main waited does. Figures are compared step by step:
    every rank sends the same absolute steps (RankFigures.first_step .. last_step,
    crossrank.exchange.exchange_steps), whatever its probe cadence.

Why this way
    Chosen over estimating per-host clock offsets from the collectives' common end because the
    durations exist on every backend with no extra moment to record (on NCCL the CPU never sees
    a collective end; PyTorch's records give its GPU duration, which includes the wait for a
    late peer), need no estimation window, and are exact whatever the offsets and their drift.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

from placement.records.parts import StepPart, record_parts
from placement.records.words import StragglerKind




# Figures each rank sends, in this order, as one float64 tensor (NaN = unknown).
FIELDS = ("rank", "steps", "first_step", "last_step", "step_ms", "data_ms", "comm_ms",
          "cpu_stall_ms", "nccl_runq_ms", "main_cpu_ms", "main_mhz", "placement_cpu_ms")
_N_FIELDS = len(FIELDS)


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
    cpu_stall_ms: Optional[float]  # the main thread's CPU-stall part of a step (records/parts.py)
    nccl_runq_ms: Optional[float]
    main_cpu_ms: Optional[float]
    main_mhz: Optional[float]
    comm_steps: tuple[Optional[float], ...] = ()
    # placement's own threads' CPU on the rank (records' placement_cpu_ms): what of its stall
    # placement itself may have caused (classify.py never blames the rank for it)
    placement_cpu_ms: Optional[float] = None

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
        # (v == v: False for NaN alone; rank 0 reads W rows a window, at every window: by
        # position, FIELDS' order, a keyword dict cost as much as the rest)
        (rank, steps, first, last, step_ms, data_ms, comm_ms, stall, nccl, main_cpu, mhz,
         own) = [v if v == v else None for v in row[:_N_FIELDS]]
        steps, first, last = int(steps or 0), int(first or 0), int(last or 0)
        span = max(0, last - first + 1) if steps else 0
        return cls(int(rank or 0), steps, first, last, step_ms or 0.0, data_ms or 0.0, comm_ms, stall, nccl,
                   main_cpu, mhz, tuple([v if v == v else None for v in row[_N_FIELDS:_N_FIELDS + span]]), own)

    def threads_stall_ms(self) -> Optional[float]:
        """Runqueue wait per step of its main (its CPU stall) and NCCL threads together: the collectives of a
        rank whose comm threads cannot run are slow for every rank (_cpu_starved)."""
        if self.cpu_stall_ms is None and self.nccl_runq_ms is None:
            return None
        return (self.cpu_stall_ms or 0.0) + (self.nccl_runq_ms or 0.0)


@dataclass
class Thresholds:
    # A rank is a candidate when it arrives this much after the earliest ... (low: what it costs
    # decides whether it is named, monitor/stragglers/naming.py)
    late_ms: float = 0.5
    late_frac: float = 0.02  # ... and by this fraction of the median step, whichever is larger
    explain_frac: float = 0.3  # an excess (data, runqueue) must account for this share of the lateness
    slow_core_ratio: float = 0.9  # main's MHz below this fraction of its peers' = slower core
    comm_slow_factor: float = 1.5  # collective time over this multiple of the baseline = comm-slow
    baseline_windows: int = 3  # windows of history the comm baseline needs
    # Naming (monitor/stragglers/naming.py): a window whose candidates together cost the job at least this
    # share of its step time is material (monitor.straggler_min_cost_pct) ...
    min_cost_pct: float = 3.0
    # ... and a rank is named once material in this many consecutive windows, for as long as it
    # stays so (monitor.straggler_confirm_windows), when it was late at this share (%) of their
    # steps or more, from its first late step (Straggler.steps_late: a slow rank is late at
    # every step; on a busy host the ranks take turns, one late at 50-85% of a window's steps;
    # monitor.straggler_steady_pct) ...
    confirm_windows: int = 2
    steady_pct: float = 90.0
    # ... or, late at fewer of its steps, once material in this many consecutive windows (a
    # rank starved on a shared core is late at most steps, not all; monitor.straggler_persist_windows).
    persist_windows: int = 20

    @classmethod
    def from_monitor(cls, m) -> "Thresholds":
        """The thresholds a MonitorConfig's straggler keys set (the rest: these defaults)."""
        return cls(min_cost_pct=m.straggler_min_cost_pct, confirm_windows=m.straggler_confirm_windows,
                   steady_pct=m.straggler_steady_pct, persist_windows=m.straggler_persist_windows)


@dataclass
class Straggler:
    kind: StragglerKind
    ranks: list[int]
    lateness_ms: Optional[float]
    why: str
    # What the job's step would have been shorter by, had this rank alone been at its peers'
    # median (costs_ms), ms per step and % of the job's step; by StepPart, summing to the cost.
    cost_ms_per_step: Optional[float] = None
    cost_pct: Optional[float] = None
    cost_by_cause: dict[StepPart, float] = field(default_factory=dict)
    since_step: Optional[int] = None  # named: the first step of the windows that confirmed it (naming.py)
    # Of the window's steps measured on every rank (steps_judged), those at which it entered late
    # by more than a candidate's limit (steps_late; Thresholds.late_ms / late_frac, the bar its
    # median lateness passed: a rank starved of CPU is late at every step by varying amounts,
    # ranks taking turns are on time at some), and those before the first of them
    # (steps_before_late: a slowdown that starts inside the window): how steady its lateness
    # is (naming.py).
    steps_late: Optional[int] = None
    steps_judged: Optional[int] = None
    steps_before_late: Optional[int] = None
    # Its CPU stall is placement's own doing: its threads took more CPU on this rank than on its
    # peers by at least Thresholds.explain_frac of the stall they are blamed for (classify.py).
    by_placement: bool = False
    # Whether it costs enough to be named (material_ranks; naming.py confirms it over windows).
    material: bool = field(default=True, compare=False)


@dataclass
class JobWide:
    """A slowdown every rank shares (no rank to name): reported once, as the job's."""

    kind: StragglerKind
    cause: StepPart
    cost_ms_per_step: float
    cost_pct: float
    why: str


@dataclass
class StragglerReport:
    stragglers: list[Straggler] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)  # ranks whose comm time grew waiting for them
    transfer_ms: Optional[float] = None  # comm time of the rank that waited least: the collective itself
    # At scale (stragglers/event.py compact): stragglers beyond the worst few, counted by kind:
    # kind -> {"count": n, "ranks": "3,17,200-207"}.
    more: dict = field(default_factory=dict)
    step_ms: Optional[float] = None  # the job's step as measured (median over ranks of their mean)
    # What the job's step would have been shorter by with every straggler at its peers' median
    # (their lateness removed together), ms per step and % of step_ms.
    cost_ms_per_step: Optional[float] = None
    cost_pct: Optional[float] = None
    job_wide: Optional[JobWide] = None
    # Per rank, its lateness at each step every rank measured (costs_ms's input; not sent on).
    lateness_steps: dict[int, list[float]] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict:
        out = {"stragglers": [_straggler_dict(s) for s in self.stragglers], "waiting": self.waiting,
               "transfer_ms": self.transfer_ms, "step_ms": _round(self.step_ms),
               "cost_ms_per_step": _round(self.cost_ms_per_step), "cost_pct": _round(self.cost_pct, 2)}
        if self.job_wide is not None:
            out["job_wide"] = {k: (_round(v) if isinstance(v, float) else v) for k, v in asdict(self.job_wide).items()}
        if self.more:
            out["more"] = self.more
        return out

    def names(self, kind: Optional[str] = None) -> list[int]:
        return sorted(r for s in self.stragglers if kind is None or s.kind == kind for r in s.ranks)


def _round(v: Optional[float], digits: int = 3) -> Optional[float]:
    return None if v is None else round(v, digits)


# An event's straggler fields, in declaration order: every one but `material` (every straggler an
# event names is). Read one by one, not through dataclasses.asdict, whose deep copy of each field
# was most of a straggler event's cost on rank 0's monitor thread.
_STRAGGLER_KEYS = tuple(f.name for f in fields(Straggler) if f.name != "material")


def _straggler_dict(s: Straggler) -> dict:
    d = {k: getattr(s, k) for k in _STRAGGLER_KEYS}
    d["ranks"] = list(s.ranks) if isinstance(s.ranks, list) else s.ranks
    d["cost_ms_per_step"], d["cost_pct"] = _round(s.cost_ms_per_step), _round(s.cost_pct, 2)
    d["cost_by_cause"] = {str(c): round(v, 3) for c, v in s.cost_by_cause.items()}
    return d


def _mean(values) -> Optional[float]:
    """The mean of (value, steps) pairs weighted by steps, those whose value is None left out."""
    known = [(v, n) for v, n in values if v is not None]
    steps = sum(n for _, n in known)
    return sum(v * n for v, n in known) / steps if known else None


def figures_from_records(rank: int, records: list, first_step: int, last_step: int) -> RankFigures:
    """Means per step of one rank's StepRecords of steps first_step..last_step (the same
    steps on every rank; records outside them are ignored, steps without one are None). One
    pass over the records: every rank makes these for each exchange window on its monitor
    thread."""
    if len(records) == 1 and records[0].step == last_step and records[0].step - records[0].steps + 1 == first_step:
        return _of_record(rank, records[0])
    step_ms: list = []
    data_ms: list = []
    comm_ms: list = []
    stall_ms: list = []
    nccl_runq: list = []
    main_cpu: list = []
    main_mhz: list = []
    own_cpu: list = []
    comm_of = {}
    steps = 0
    for r in records:
        if not first_step <= r.step <= last_step:
            continue
        # a record of n steps (records/step.py) counts n times: its figures are per-step means
        n = r.steps
        steps += n
        step_ms.append((r.step_ms, n))
        data_ms.append((r.data_ms, n))
        comm_ms.append((r.comm_ms, n))
        for s, c in zip(range(r.step - n + 1, r.step + 1), _step_comms(r)):
            comm_of[s] = c
        stall_ms.append((record_parts(r).cpu_stall_ms, n))
        roles = r.roles
        nccl, main = roles.get("nccl"), roles.get("main")
        nccl_runq.append((None if nccl is None else nccl.runq_ms, n))
        main_cpu.append((None if main is None else main.cpu_ms, n))
        main_mhz.append((None if main is None else main.mhz, n))
        own_cpu.append((r.placement_cpu_ms, n))
    if not step_ms:
        return RankFigures.empty(rank, first_step, last_step)
    return RankFigures(
        rank=rank, steps=steps, first_step=first_step, last_step=last_step,
        step_ms=_mean(step_ms) or 0.0,
        data_ms=_mean(data_ms) or 0.0,
        comm_ms=_mean(comm_ms),
        comm_steps=tuple(comm_of.get(s) for s in range(first_step, last_step + 1)),
        cpu_stall_ms=_mean(stall_ms),
        nccl_runq_ms=_mean(nccl_runq),
        main_cpu_ms=_mean(main_cpu),
        main_mhz=_mean(main_mhz),
        placement_cpu_ms=_mean(own_cpu))


def _of_record(rank: int, r) -> RankFigures:
    """figures_from_records of one record that holds the window's steps, no more, no less: what
    every window is at short steps (a record holds a group of steps dividing the window,
    build.py RecordBuilder.pace), read off the record's own per-step means."""
    n = r.steps
    roles = r.roles
    nccl, main = roles.get("nccl"), roles.get("main")
    each = _step_comms(r)
    return RankFigures(
        rank=rank, steps=n, first_step=r.step - n + 1, last_step=r.step, step_ms=r.step_ms or 0.0,
        data_ms=r.data_ms or 0.0, comm_ms=r.comm_ms,
        comm_steps=tuple(each[:n]) + (None,) * (n - len(each)),  # (None where it holds fewer: the walk's too)
        cpu_stall_ms=record_parts(r).cpu_stall_ms, nccl_runq_ms=None if nccl is None else nccl.runq_ms,
        main_cpu_ms=None if main is None else main.cpu_ms, main_mhz=None if main is None else main.mhz,
        placement_cpu_ms=r.placement_cpu_ms)


def _step_comms(r) -> tuple:
    """Each of a record's steps' comm time, as built (a record read back from a log has only
    their mean; a step without a collective has none)."""
    comm = r.comm_ms if r.comm_count else None
    return (comm,) if r.steps == 1 else r.each_comm_ms or (comm,) * r.steps
