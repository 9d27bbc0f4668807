"""Figures over a run of StepRecords, shared by the periodic log line and `placement report`."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from placement.records.parts import record_parts
from placement.records.step import StepRecord, step_times


def percentile(sorted_values: Sequence[float], q: float) -> Optional[float]:
    """Nearest-rank percentile of already sorted values (q in 0..100)."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, int(round(q / 100.0 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


def stall_ms(rec: StepRecord) -> Optional[float]:
    """CPU stall of a step: its part of that name (parts.py: main's runqueue wait within the
    step's compute time); None when not read."""
    return record_parts(rec).cpu_stall_ms


@dataclass
class RunSummary:
    rank: int
    steps: int
    first_step: int
    last_step: int
    p50_ms: float
    p99_ms: float
    # The parts of its steps (parts.py: disjoint, adding to 100), summed over steps, as % of
    # summed step time; CPU stall None when never read (then inside compute).
    stall_pct: Optional[float]
    comm_pct: Optional[float]
    data_pct: float
    verdicts: dict[str, int]
    compute_pct: float = 0.0


def summarize(rank: int, records: Sequence[StepRecord]) -> Optional[RunSummary]:
    if not records:
        return None
    # a record may hold several steps (records/step.py): its parts are per-step means, so each
    # counts `steps` times, and the percentiles are of each step's own time
    steps = sorted(t for r in records for t in step_times(r))
    total = sum(steps) or 1e-9
    parts = [(record_parts(r), r.steps) for r in records]
    known_stall = [p.cpu_stall_ms * n for p, n in parts if p.cpu_stall_ms is not None]
    measured_comm = any(r.comm_ms is not None for r in records)
    verdicts: Counter = Counter()
    for r in records:
        verdicts[r.verdict] += r.steps
    return RunSummary(
        rank=rank, steps=len(steps), first_step=records[0].step - records[0].steps + 1, last_step=records[-1].step,
        p50_ms=percentile(steps, 50), p99_ms=percentile(steps, 99),
        stall_pct=100.0 * sum(known_stall) / total if known_stall else None,
        comm_pct=100.0 * sum(p.comm_ms * n for p, n in parts) / total if measured_comm else None,
        data_pct=100.0 * sum(p.data_ms * n for p, n in parts) / total,
        verdicts=dict(verdicts),
        compute_pct=100.0 * sum(p.compute_ms * n for p, n in parts) / total)


def _pct(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.1f}%"


def one_line(s: RunSummary) -> str:
    verdicts = ", ".join(f"{k} {v}" for k, v in sorted(s.verdicts.items(), key=lambda kv: -kv[1]))
    return (f"placement rank {s.rank} steps {s.first_step}-{s.last_step}: step p50 {s.p50_ms:.1f} ms "
            f"p99 {s.p99_ms:.1f} ms | data {_pct(s.data_pct)} comm {_pct(s.comm_pct)} "
            f"CPU stall {_pct(s.stall_pct)} compute {_pct(s.compute_pct)} | {verdicts}")
