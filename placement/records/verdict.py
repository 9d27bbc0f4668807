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


_CPU_BOUND, _COMM_BOUND, _DATA_BOUND, _BALANCED = (StepVerdict.CPU_BOUND, StepVerdict.COMM_BOUND,
                                                  StepVerdict.DATA_BOUND, StepVerdict.BALANCED)


def step_verdict(step_ms: float, data_ms: float, comm_ms: Optional[float], stall_ms: Optional[float],
                 runq_wait_pct: float, comm_share_pct: float, data_share_pct: float) -> StepVerdict:
    """Written out, not looped over a table: the monitor thread judges every step."""
    if step_ms <= 0:
        return _BALANCED
    best, best_ratio = _BALANCED, 1.0
    if stall_ms is not None and runq_wait_pct > 0:
        ratio = (100.0 * stall_ms / step_ms) / runq_wait_pct
        if ratio >= best_ratio:
            best, best_ratio = _CPU_BOUND, ratio
    if comm_ms is not None and comm_share_pct > 0:
        ratio = (100.0 * comm_ms / step_ms) / comm_share_pct
        if ratio >= best_ratio:
            best, best_ratio = _COMM_BOUND, ratio
    if data_ms is not None and data_share_pct > 0 and (100.0 * data_ms / step_ms) / data_share_pct >= best_ratio:
        best = _DATA_BOUND
    return best
