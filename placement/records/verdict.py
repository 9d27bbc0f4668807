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

from placement.vocab import Vocabulary


class StepVerdict(Vocabulary):
    """A step's verdict word, as the log writes it (a member is the `str` it prints)."""

    CPU_BOUND = "cpu-bound"
    COMM_BOUND = "comm-bound"
    DATA_BOUND = "data-bound"
    BALANCED = "balanced"


VERDICTS = StepVerdict.values()  # in this order: the report's columns keep a verdict as its index


def step_verdict(step_ms: float, data_ms: float, comm_ms: Optional[float], stall_ms: Optional[float],
                 runq_wait_pct: float, comm_share_pct: float, data_share_pct: float) -> StepVerdict:
    if step_ms <= 0:
        return StepVerdict.BALANCED
    best, best_ratio = StepVerdict.BALANCED, 1.0
    for verdict, ms, pct in ((StepVerdict.CPU_BOUND, stall_ms, runq_wait_pct),
                             (StepVerdict.COMM_BOUND, comm_ms, comm_share_pct),
                             (StepVerdict.DATA_BOUND, data_ms, data_share_pct)):
        if ms is None or pct <= 0:
            continue
        ratio = (100.0 * ms / step_ms) / pct
        if ratio >= best_ratio:
            best, best_ratio = verdict, ratio
    return best
