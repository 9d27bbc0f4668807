"""One window of StepRecords summarised into the figures the rules and the judge read.

Shares are medians over the window's steps (a role's runqueue wait as % of that step's
time, etc.): a median needs more than half the window to agree, which is what keeps a
rule from firing on a few noisy steps.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Optional, Sequence

from placement.records.step import StepRecord, step_times
from placement.roles import ThreadRole

# A step slower than this many times the window's median step is a spike.
SPIKE_FACTOR = 1.5


@dataclass(frozen=True)
class RoleWindow:
    """What one role's threads did over a window."""

    threads: int  # most threads seen in one step
    cpu_share_pct: Optional[float]  # median over steps of 100 * cpu_ms / step_ms (all threads summed)
    runq_share_pct: Optional[float]  # median over steps of 100 * runq_ms / step_ms
    mhz: Optional[float]  # median of the measured MHz of the cores it ran on
    cpus: frozenset[int]  # CPUs its threads last ran on, over the whole window
    minflt: tuple[Optional[float], ...]  # per step (per-step means on span-sampled steps)
    migrations: tuple[Optional[float], ...]  # per step


@dataclass(frozen=True)
class WindowStats:
    first_step: int
    last_step: int
    step_ms: tuple[float, ...]  # in step order
    data_share_pct: float  # median of 100 * data_ms / step_ms
    comm_share_pct: float  # median of 100 * comm_ms / step_ms
    roles: dict[ThreadRole, RoleWindow] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.step_ms)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def mad_ms(self) -> float:
        """Median absolute deviation of the step times."""
        m = self.median_ms
        return statistics.median(abs(x - m) for x in self.step_ms)

    def median_se_pct(self) -> float:
        """Standard error of this window's median step time, as % of it.

        sigma ~ 1.4826 * MAD for normal noise; the median's standard error is
        sqrt(pi/2) * sigma / sqrt(n).
        """
        m = self.median_ms
        if m <= 0 or self.n < 2:
            return 0.0
        sigma = 1.4826 * self.mad_ms
        return 100.0 * math.sqrt(math.pi / 2) * sigma / math.sqrt(self.n) / m

    def role(self, role: ThreadRole) -> Optional[RoleWindow]:
        r = self.roles.get(role)
        return r if r is not None and r.threads > 0 else None

    def spikes(self) -> tuple[bool, ...]:
        """Per step: slower than SPIKE_FACTOR x the window median."""
        m = self.median_ms
        return tuple(x > SPIKE_FACTOR * m for x in self.step_ms)

    def step_totals(self, attr: str) -> tuple[Optional[float], ...]:
        """Per step, the sum over roles of a per-step counter ("minflt" or "migrations");
        None for a step where no role had the figure."""
        columns = [getattr(r, attr) for r in self.roles.values()]
        if not columns:
            return (None,) * self.n
        out: list[Optional[float]] = []
        for vals in zip(*columns):
            known = [v for v in vals if v is not None]
            out.append(sum(known) if known else None)
        return tuple(out)


def _share(part: Optional[float], whole: float) -> Optional[float]:
    if part is None or whole <= 0:
        return None
    return 100.0 * part / whole


def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


_ROLES = {r: r for r in ThreadRole}  # a ThreadRole finds itself; its name finds it too (a str Enum)


def summarize(records: Sequence[StepRecord]) -> WindowStats:
    """Summarise a non-empty list of step records (one window)."""
    if not records:
        raise ValueError("a window needs at least one step record")
    # A record may hold several steps (records/step.py): the step times are each step's, the
    # shares each record's (per-step means over its steps).
    steps = [t for r in records for t in step_times(r)]
    role_names: list[ThreadRole] = []
    for rec in records:
        for key in rec.roles:
            role = _ROLES.get(key)  # keys are ThreadRoles; anything else (a name this version lacks) is ignored
            if role is not None and role not in role_names:
                role_names.append(role)
    # Roles sampled every N steps carry per-step means over those N steps (RoleSample.span_steps):
    # their shares are of the mean step time over the steps a sample covers, counted back in
    # steps from the record's last (running sums: the tuner summarises every window on the
    # monitor thread).
    sums = [0.0]
    for ms in steps:
        sums.append(sums[-1] + ms)
    ends = []  # each record's last step, as an index into steps (+1)
    k = 0
    for rec in records:
        k += rec.steps
        ends.append(k)
    roles: dict[ThreadRole, RoleWindow] = {}
    for role in role_names:
        samples = [rec.roles.get(role) for rec in records]
        cpus: set[int] = set()
        threads = 0
        cpu_shares, runq_shares, mhz = [], [], []
        for i, s in enumerate(samples):
            if s is None:
                continue
            cpus.update(s.cpus)
            threads = max(threads, s.threads)
            end = ends[i]
            first = max(0, end - max(1, s.span_steps, records[i].steps))
            span_ms = (sums[end] - sums[first]) / (end - first)
            cpu_shares.append(_share(s.cpu_ms, span_ms))
            runq_shares.append(_share(s.runq_ms, span_ms))
            mhz.append(s.mhz)
        roles[role] = RoleWindow(
            threads=threads,
            cpu_share_pct=_median(cpu_shares),
            runq_share_pct=_median(runq_shares),
            mhz=_median(mhz),
            cpus=frozenset(cpus),
            minflt=tuple(s.minflt if s else None for s in samples),
            migrations=tuple(s.migrations if s else None for s in samples),
        )
    return WindowStats(
        first_step=records[0].step - records[0].steps + 1,
        last_step=records[-1].step,
        step_ms=tuple(steps),
        data_share_pct=_median([_share(r.data_ms, r.step_ms) for r in records]) or 0.0,
        comm_share_pct=_median([_share(r.comm_ms, r.step_ms) for r in records]) or 0.0,
        roles=roles,
    )
