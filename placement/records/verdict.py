"""Per-step verdict from the step's own figures: which wait dominates, if any.

The thresholds are the tuner's (TuneConfig), so "data-bound" here is what makes the
dataloader rule act there:
- cpu-bound: main's (and NCCL threads') runqueue wait >= runq_wait_pct of the step
- comm-bound: comm time >= comm_share_pct of the step
- data-bound: data wait >= data_share_pct of the step
When more than one holds, the largest share relative to its threshold wins; else balanced.
"""
from __future__ import annotations

from typing import Optional


def step_verdict(step_ms: float, data_ms: float, comm_ms: Optional[float], stall_ms: Optional[float],
                 runq_wait_pct: float, comm_share_pct: float, data_share_pct: float) -> str:
    if step_ms <= 0:
        return "balanced"
    best, best_ratio = "balanced", 1.0
    for verdict, ms, pct in (("cpu-bound", stall_ms, runq_wait_pct),
                             ("comm-bound", comm_ms, comm_share_pct),
                             ("data-bound", data_ms, data_share_pct)):
        if ms is None or pct <= 0:
            continue
        ratio = (100.0 * ms / step_ms) / pct
        if ratio >= best_ratio:
            best, best_ratio = verdict, ratio
    return best
