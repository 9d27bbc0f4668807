"""One per-rank record of the monitor's steps (JSONL line with "type": "step").

What
    Figures a probe could not read are None (and warned about once), never guessed.

Steps a record holds
    A record holds `steps` consecutive steps, `step` the last of them: one while steps are
    long, several at short ones (monitor.record_min_s: each record costs the monitor thread the
    same Python whatever it holds, monitor/build.py). Its figures are per-step means over its
    steps, its verdict judged on them; `each_ms` keeps every step's own time (the step-time
    percentiles, the tuner's spikes and the hang watch need them), and readers weight a record
    by its `steps` (step_times, record_steps). A line without `steps` holds one step.

Sampling tiers
    What keeps the monitor inside its cost budget:
    - every step, the hot roles (`main`, `backward`, `nccl`, `pin_memory`) get cpu_ms and
      runq_ms (per-step means over `probe_steps` steps when the monitor's budget has their
      counters read every k-th step);
    - their other counters (nivcsw, minflt, migrations, cpus, mhz), and every figure of
      `dataloader` and `other`, are read every monitor.rescan_every steps (while no tuner
      judges windows, at least 4 x monitor.handover_min_s apart) and appear in that
      step's record as per-step means over the `span_steps` steps since the previous reading
      (None on the steps between; `dataloader` and `other` are absent from `roles` there).
      cpus/mhz of the hot roles on the steps between are the last reading's. While a tuner
      judges windows, a light reading at each hand-over between those gives `dataloader`
      and `other` their cpu_ms and runq_ms (over the steps since the last reading of either
      kind; their cpus and mhz the last full one's); the other counters are then per-step
      means since the last full reading.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from placement.events import EventKind
from placement.records.parts import StepParts
from placement.records.verdict import StepVerdict
from placement.roles import ThreadRole

_ROLE_NAMES = frozenset(r.value for r in ThreadRole)


def _num(v: Any) -> str:
    """A number (or None) as JSON; NaN and infinities as null, which JSON has no word for.
    (v - v is 0.0 for a finite float, NaN for NaN and the infinities.)"""
    if v.__class__ is float:
        return repr(v) if v - v == 0.0 else "null"
    if v is None or v != v or v in (math.inf, -math.inf):
        return "null"
    return repr(v)


# The fixed parts of a line, formatted once (an enum member formats through Enum.__format__, ~1 us).
_ROLE_KEY = {role: f'"{role.value}":' for role in ThreadRole}
_VERDICT = {v: f'"verdict":"{v.value}"' for v in StepVerdict}


# Counters read at span readings only (see the module docstring): None between them.
SPAN_FIELDS = ("nivcsw", "migrations", "minflt", "mhz")


@dataclass(slots=True)
class RoleSample:
    """What the threads of one role did during one step (deltas over the step)."""

    threads: int = 0
    cpu_ms: Optional[float] = None  # on-CPU time (schedstat field 1)
    runq_ms: Optional[float] = None  # time runnable but waiting for a CPU (schedstat field 2)
    nivcsw: Optional[int] = None  # involuntary context switches
    migrations: Optional[int] = None  # times the thread's last CPU changed between samples
    minflt: Optional[int] = None  # minor faults
    mhz: Optional[float] = None  # current MHz of the core it last ran on (mean over threads)
    cpus: list[int] = field(default_factory=list)  # CPUs the role's threads last ran on
    # Steps the sampled counters cover (1 = this step alone); figures are per-step means.
    span_steps: int = 1

    def to_dict(self) -> dict[str, Any]:
        """Its fields, less the span counters when not read (between span readings: None) and
        span_steps when 1: a reader takes a missing one as None (1), and the line is ~60 bytes
        shorter per role on most steps (docs/monitor.md, log size)."""
        out = {"threads": self.threads, "cpu_ms": self.cpu_ms, "runq_ms": self.runq_ms}
        for name in SPAN_FIELDS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out["cpus"] = list(self.cpus)
        if self.span_steps != 1:
            out["span_steps"] = self.span_steps
        return out

    def to_json(self) -> str:
        """json.dumps(self.to_dict(), separators=(",", ":")), at a fifth of its cost: the monitor
        thread encodes one per role per step (benchmarks/hook_profile.py, its profile)."""
        span = "" if self.mhz is None and self.nivcsw is None and self.minflt is None and self.migrations is None \
            else "".join([f'"{name}":{_num(getattr(self, name))},' for name in SPAN_FIELDS
                          if getattr(self, name) is not None])
        cpus = self.cpus
        return (f'{{"threads":{self.threads},"cpu_ms":{_num(self.cpu_ms)},"runq_ms":{_num(self.runq_ms)},{span}'
                f'"cpus":[{",".join(map(str, cpus)) if len(cpus) != 1 else cpus[0]}]'
                + ("}" if self.span_steps == 1 else f',"span_steps":{self.span_steps}}}'))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RoleSample":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(slots=True)
class StepRecord:
    rank: int
    step: int
    t: float  # wall clock at the end of the step (time.time())
    step_ms: float
    data_ms: float = 0.0  # time blocked waiting for the next batch
    # Comm wait: the time the step waited for its collectives (records/parts.py comm_wait_ms),
    # the step's comm part; None: not measured.
    comm_ms: Optional[float] = 0.0
    comm_count: int = 0
    # Keyed by role (a ThreadRole is also its name: rec.roles["main"] finds it); JSON keys are the names.
    roles: dict[ThreadRole, RoleSample] = field(default_factory=dict)
    verdict: str = StepVerdict.BALANCED  # records/verdict.py; read back from a log, the plain word
    local_rank: int = 0
    # When this rank entered its first collective of the step (time.time()); tells the late
    # arriver from the ranks that waited for it.
    comm_enter_t: Optional[float] = None
    # Steps the hot roles' cpu_ms/runq_ms cover, as per-step means: 1 when the counters are
    # read every step, k when the monitor's budget has them read every k-th step, 0 when not
    # read (steps after the last reading, at exit).
    probe_steps: int = 1
    run: Optional[str] = None  # the run's id (identity.py): which run of the job wrote it
    # Comm in flight: the union of the step's collectives' intervals, overlapping compute or not
    # (NCCL: PyTorch's GPU-side timing; gloo: call wall time); the comm-overlap view, never a
    # part. A log line without it was written before comm wait: its comm_ms is this figure.
    comm_inflight_ms: Optional[float] = None
    # The CPU placement's own threads spent in this process (roles.OWN_THREADS: the monitor's,
    # the binder's watcher, ...), ms per step over the batch of records it was built with (the
    # threads' clocks read once per batch): what of main's CPU stall placement itself may have
    # caused. None: not read (a log written before it).
    placement_cpu_ms: Optional[float] = None
    # Steps this record holds (step the last): its figures are per-step means over them, and
    # each_ms their own times in order (None when it holds one: step_ms is that step's).
    steps: int = 1
    each_ms: Optional[tuple[float, ...]] = None
    # Each step's comm wait (None: no collective, or not measured) of a record of several steps,
    # as built: the exchange tells a late rank step by step (stragglers/cost.py). Not written to
    # the log (its comm_ms is their mean).
    each_comm_ms: Optional[tuple] = field(default=None, repr=False, compare=False)
    # Its parts (records/parts.py record_parts), split at the first asking; not written to the log.
    parts: Optional[StepParts] = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        # Built by hand: dataclasses.asdict costs ~50 us per record, a whole step's budget.
        return {"type": EventKind.STEP, "rank": self.rank, "step": self.step, "t": self.t,
                "step_ms": self.step_ms, "data_ms": self.data_ms, "comm_ms": self.comm_ms,
                "comm_inflight_ms": self.comm_inflight_ms, "comm_count": self.comm_count,
                "roles": {name: s.to_dict() for name, s in self.roles.items()},
                "verdict": self.verdict, "local_rank": self.local_rank,
                "comm_enter_t": self.comm_enter_t, "probe_steps": self.probe_steps,
                **({} if self.run is None else {"run": self.run}),
                **({} if self.placement_cpu_ms is None else {"placement_cpu_ms": self.placement_cpu_ms}),
                **({} if self.steps == 1 else {"steps": self.steps, "each_ms": list(self.each_ms or ())})}

    def roles_json(self) -> str:
        """The `roles` object's members as JSON (shared by the steps between two readings of the
        counters: sinks/jsonl.py encodes them once)."""
        key = _ROLE_KEY
        return ",".join([(key.get(name) or f'"{name}":') + s.to_json() for name, s in self.roles.items()])

    def to_json(self, roles: Optional[str] = None) -> str:
        """One JSONL line, equal to json.dumps(self.to_dict(), separators=(",", ":")) but built
        by formatting (the monitor encodes one per step inside its cost budget); `roles`: this
        record's roles_json() when the caller has it already."""
        roles = self.roles_json() if roles is None else roles
        verdict = _VERDICT.get(self.verdict) or '"verdict":"%s"' % self.verdict  # a word read back from a newer log
        return (f'{{"type":"step","rank":{self.rank},"step":{self.step},"t":{_num(self.t)},'
                f'"step_ms":{_num(self.step_ms)},"data_ms":{_num(self.data_ms)},"comm_ms":{_num(self.comm_ms)},'
                f'"comm_inflight_ms":{_num(self.comm_inflight_ms)},"comm_count":{self.comm_count},'
                f'"roles":{{{roles}}},{verdict},'
                f'"local_rank":{self.local_rank},"comm_enter_t":{_num(self.comm_enter_t)},'
                f'"probe_steps":{self.probe_steps}' + ("" if self.run is None else f',"run":"{self.run}"')
                + ("" if self.placement_cpu_ms is None else f',"placement_cpu_ms":{_num(self.placement_cpu_ms)}')
                + ("}" if self.steps == 1 else
                   f',"steps":{self.steps},"each_ms":[{",".join([_num(v) for v in self.each_ms or ()])}]}}'))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepRecord":
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        # A role this version does not know (a newer writer's) is left out: nothing here could read it.
        kw["roles"] = {ThreadRole(r): RoleSample.from_dict(s) for r, s in (d.get("roles") or {}).items()
                       if r in _ROLE_NAMES}
        if kw.get("each_ms") is not None:
            kw["each_ms"] = tuple(kw["each_ms"])
        return cls(**kw)


def line_steps(d: dict) -> range:
    """The steps a step line (as json.loads gives it, valid_step) holds."""
    return range(d["step"] - d.get("steps", 1) + 1, d["step"] + 1)


def record_steps(rec: StepRecord) -> range:
    """The steps a record holds."""
    return range(rec.step - rec.steps + 1, rec.step + 1)


def step_times(rec: StepRecord) -> tuple[float, ...]:
    """Each step's own time (ms) of a record, in order: one for a record of one step."""
    each = rec.each_ms
    return (rec.step_ms,) if each is None else each


# ---- reading a step line back (the report) --------------------------------------------------
_I64 = 1 << 63
# The most steps a record read back may say it holds (the monitor writes at most
# monitor.exchange_every's upper bound): a line is bounded input (report/logs.py).
MAX_RECORD_STEPS = 10_000


def is_number(v: Any, optional: bool = False) -> bool:
    """A finite float or an int64, as json.loads gives them (a bool is not a number)."""
    if v is None:
        return optional
    kind = type(v)
    return (kind is float and v - v == 0.0) or (kind is int and -_I64 <= v < _I64)


def is_integer(v: Any) -> bool:
    return type(v) is int and -_I64 <= v < _I64


def role_runq(roles: dict, name: str) -> Optional[float]:
    """A role's runqueue wait in a step line's `roles` (main's is the step's CPU stall)."""
    sample = roles.get(name)
    return None if sample is None else sample.get("runq_ms")


def valid_step(d: dict) -> bool:
    """A step line as json.loads gave it has the types StepRecord.to_json writes, as far as the
    report reads them (report/logs.py skips and counts a line that does not): every top-level
    field, and of the roles (a dict of dicts, so StepRecord.from_dict(d) cannot fail) the
    runqueue wait of main (its CPU stall) and NCCL. The roles' other figures are carried as
    written: no view reads them, and checking them on every line would cost a fifth of the
    reading."""
    get = d.get
    roles = get("roles", {})
    if not (is_integer(get("rank")) and is_integer(get("step")) and is_number(get("t")) and is_number(get("step_ms"))
            and ("data_ms" not in d or is_number(d["data_ms"])) and is_number(get("comm_ms"), optional=True)
            and is_number(get("comm_inflight_ms"), optional=True)
            and is_number(get("comm_enter_t"), optional=True) and is_number(get("placement_cpu_ms"), optional=True)
            and is_integer(get("comm_count", 0))
            and is_integer(get("local_rank", 0)) and is_integer(get("probe_steps", 1))
            and type(get("verdict", "")) is str and type(roles) is dict and type(get("run", "")) is str):
        return False
    steps = get("steps", 1)
    if not is_integer(steps):
        return False
    if steps != 1:  # a record of several steps: each one's time, as many as it says, all numbers
        each = get("each_ms")
        if not (1 < steps <= MAX_RECORD_STEPS and type(each) is list and len(each) == steps
                and all(is_number(v) for v in each)):
            return False
    for sample in roles.values():
        if type(sample) is not dict:
            return False
    return is_number(role_runq(roles, "main"), optional=True) and is_number(role_runq(roles, "nccl"), optional=True)
