"""Figures over a run of StepRecords, shared by the periodic log line and `placement report`."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from placement.monitor.record import StepRecord
from placement.roles import ThreadRole


def percentile(sorted_values: Sequence[float], q: float) -> Optional[float]:
    """Nearest-rank percentile of already sorted values (q in 0..100)."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, int(round(q / 100.0 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


def cpu_stall_ms(main_runq_ms: Optional[float], nccl_runq_ms: Optional[float]) -> Optional[float]:
    """CPU stall, the one definition (monitor, straggler figures, report): the runqueue wait of
    the main thread plus that of the NCCL threads; None when neither is known."""
    if main_runq_ms is None and nccl_runq_ms is None:
        return None
    return (main_runq_ms or 0.0) + (nccl_runq_ms or 0.0)


def stall_ms(rec: StepRecord) -> Optional[float]:
    """CPU stall of a step (cpu_stall_ms of its main and NCCL roles)."""
    main = rec.roles.get(ThreadRole.MAIN)
    nccl = rec.roles.get(ThreadRole.NCCL)
    return cpu_stall_ms(None if main is None else main.runq_ms, None if nccl is None else nccl.runq_ms)


@dataclass
class RunSummary:
    rank: int
    steps: int
    first_step: int
    last_step: int
    p50_ms: float
    p99_ms: float
    stall_pct: Optional[float]  # summed over steps, as % of summed step time
    comm_pct: Optional[float]
    data_pct: float
    verdicts: dict[str, int]


def summarize(rank: int, records: Sequence[StepRecord]) -> Optional[RunSummary]:
    if not records:
        return None
    steps = sorted(r.step_ms for r in records)
    total = sum(steps) or 1e-9
    stalls = [stall_ms(r) for r in records]
    comm = [r.comm_ms for r in records if r.comm_ms is not None]
    known_stall = [s for s in stalls if s is not None]
    return RunSummary(
        rank=rank, steps=len(records), first_step=records[0].step, last_step=records[-1].step,
        p50_ms=percentile(steps, 50), p99_ms=percentile(steps, 99),
        stall_pct=100.0 * sum(known_stall) / total if known_stall else None,
        comm_pct=100.0 * sum(comm) / total if comm else None,
        data_pct=100.0 * sum(r.data_ms for r in records) / total,
        verdicts=dict(Counter(r.verdict for r in records)))


def _pct(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.1f}%"


def one_line(s: RunSummary) -> str:
    verdicts = ", ".join(f"{k} {v}" for k, v in sorted(s.verdicts.items(), key=lambda kv: -kv[1]))
    return (f"placement rank {s.rank} steps {s.first_step}-{s.last_step}: step p50 {s.p50_ms:.1f} ms "
            f"p99 {s.p99_ms:.1f} ms | CPU stall {_pct(s.stall_pct)} comm {_pct(s.comm_pct)} "
            f"data {_pct(s.data_pct)} | {verdicts}")
