"""A rank's step records in digests: what `placement report` reads of a long job.

What
    Every monitor.digest_every steps the monitor writes one `digest` record beside the step
    lines: the steps it covers, their count, the sums of step time and of its parts (parts.py),
    the verdicts counted, and a histogram of step times on log-spaced bins HIST_RATIO wide.
    Digests merge exactly (sums, counts, bins add), so a rank's, a node's or the job's p50/p99
    over any number of them is within a bin (1%) of the steps' own, and the parts' shares are
    the same sums the step lines give.

Why
    A week at 1 step/s is 604,800 step lines per rank, 619 M on 1,024 ranks: too many to parse
    for a report (their size and the time to parse them: docs/monitor.md, A long job: digests).
    The digests of the same week are 605 per rank, and the report finds them without parsing a
    step line (report/logs.py). Step lines stay whole for --plot, --trace and a short run.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

from placement.records.parts import StepParts, record_parts
from placement.records.step import StepRecord, step_times
from placement.records.summary import RunSummary

HIST_RATIO = 1.01  # each bin 1% wider than the one below: percentiles within 1%
_LOG_RATIO = math.log(HIST_RATIO)
_FLOOR_MS = 1e-3  # steps shorter than 1 us share the lowest bin


def hist_bin(step_ms: float) -> int:
    return math.floor(math.log(max(step_ms, _FLOOR_MS)) / _LOG_RATIO)


def bin_ms(b: int) -> float:
    """A bin's middle (geometric), ms."""
    return HIST_RATIO ** (b + 0.5)


@dataclass
class StepDigest:
    """The steps first_step..last_step of one rank (or many ranks merged: rank None)."""

    rank: Optional[int]
    first_step: int = 0
    last_step: int = 0
    t: float = 0.0  # wall clock at the end of its last step
    steps: int = 0
    step_ms: float = 0.0  # sums over the steps, ms
    data_ms: float = 0.0
    comm_ms: Optional[float] = None  # None: no step said (comm not measured)
    stall_ms: Optional[float] = None  # None: main's runqueue wait never read
    compute_ms: float = 0.0
    hist: Counter = field(default_factory=Counter)  # hist_bin -> steps
    verdicts: Counter = field(default_factory=Counter)

    def add(self, rec: StepRecord) -> None:
        self.add_step(rec.step, rec.t, rec.step_ms, record_parts(rec), rec.verdict, rec.comm_ms is not None,
                      rec.steps, step_times(rec))

    def add_step(self, step: int, t: float, step_ms: float, parts: StepParts, verdict: str, comm_read: bool,
                 steps: int = 1, each: tuple = ()) -> None:
        """A record's steps by its figures (add: a StepRecord's; benchmarks/report_scale.py:
        generated ones): `step` the last of `steps`, its figures and parts per-step means,
        `each` each step's own time (a record of one step: step_ms)."""
        if not self.steps:
            self.first_step = step - steps + 1
        self.last_step, self.t = step, t
        self.steps += steps
        self.step_ms += step_ms * steps
        self.data_ms += parts.data_ms * steps
        if comm_read:
            self.comm_ms = (self.comm_ms or 0.0) + parts.comm_ms * steps
        if parts.cpu_stall_ms is not None:
            self.stall_ms = (self.stall_ms or 0.0) + parts.cpu_stall_ms * steps
        self.compute_ms += parts.compute_ms * steps
        self.hist.update(map(hist_bin, each or (step_ms,)))  # (Counter counts an iterable in C)
        self.verdicts[verdict] += steps

    @classmethod
    def pooled(cls, digests) -> "StepDigest":
        """Digests of many ranks (or windows) merged into one (rank None)."""
        out = cls(None)
        for d in digests:
            out.merge(d)
        return out

    def merge(self, other: "StepDigest") -> None:
        if not other.steps:
            return
        self.first_step = other.first_step if not self.steps else min(self.first_step, other.first_step)
        self.last_step = max(self.last_step, other.last_step) if self.steps else other.last_step
        self.t = max(self.t, other.t)
        self.steps += other.steps
        self.step_ms += other.step_ms
        self.data_ms += other.data_ms
        self.compute_ms += other.compute_ms
        if other.comm_ms is not None:
            self.comm_ms = (self.comm_ms or 0.0) + other.comm_ms
        if other.stall_ms is not None:
            self.stall_ms = (self.stall_ms or 0.0) + other.stall_ms
        self.hist.update(other.hist)
        self.verdicts.update(other.verdicts)

    def percentile(self, q: float) -> Optional[float]:
        """Nearest-rank percentile (as summary.percentile) of the step times, a bin's middle."""
        if not self.steps:
            return None
        k = max(1, min(self.steps, int(round(q / 100.0 * self.steps + 0.5))))
        seen = 0
        for b in sorted(self.hist):
            seen += self.hist[b]
            if seen >= k:
                return bin_ms(b)
        return None  # not reached: the bins hold `steps` steps

    def summary(self) -> RunSummary:
        """The figures of summary.summarize over the same steps (p50/p99 within a bin)."""
        total = self.step_ms or 1e-9
        return RunSummary(
            rank=-1 if self.rank is None else self.rank, steps=self.steps, first_step=self.first_step,
            last_step=self.last_step, p50_ms=self.percentile(50), p99_ms=self.percentile(99),
            stall_pct=None if self.stall_ms is None else 100.0 * self.stall_ms / total,
            comm_pct=None if self.comm_ms is None else 100.0 * self.comm_ms / total,
            data_pct=100.0 * self.data_ms / total, verdicts=dict(self.verdicts),
            compute_pct=100.0 * self.compute_ms / total)

    def fields(self) -> dict[str, Any]:
        """The `digest` event's fields (figures rounded to the us: sums of many steps need no more)."""
        def r(v):
            return None if v is None else round(v, 3)

        return {"t": self.t, "rank": self.rank, "steps": [self.first_step, self.last_step],
                "n": self.steps, "step_ms": r(self.step_ms), "data_ms": r(self.data_ms), "comm_ms": r(self.comm_ms),
                "stall_ms": r(self.stall_ms), "compute_ms": r(self.compute_ms),
                "hist": {str(b): n for b, n in sorted(self.hist.items())}, "verdicts": dict(self.verdicts)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Optional["StepDigest"]:
        """A digest line as the report reads it; None when a field is not of the type written."""
        try:
            first, last = d["steps"]
            out = cls(rank=d["rank"], first_step=int(first), last_step=int(last), t=float(d["t"]), steps=int(d["n"]),
                      step_ms=float(d["step_ms"]), data_ms=float(d["data_ms"]),
                      comm_ms=None if d.get("comm_ms") is None else float(d["comm_ms"]),
                      stall_ms=None if d.get("stall_ms") is None else float(d["stall_ms"]),
                      compute_ms=float(d["compute_ms"]),
                      hist=Counter({int(b): int(n) for b, n in d["hist"].items()}),
                      verdicts=Counter({str(v): int(n) for v, n in d["verdicts"].items()}))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if out.steps < 1 or sum(out.hist.values()) != out.steps or not isinstance(out.rank, int):
            return None
        return out
