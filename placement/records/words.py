"""The words the monitor's events carry and `placement report` reads back: straggler kinds, how a
cost is said, and which hung rank is the likely cause. Written by the live monitor
(monitor/stragglers, monitor/health), read by the report: here, so the report needs no live code.
"""
from __future__ import annotations

from typing import Optional

from placement.vocab import Vocabulary


class StragglerKind(Vocabulary):
    CPU_SLOW = "cpu-slow"
    DATA_SLOW = "data-slow"
    COMPUTE_SLOW = "compute-slow"
    COMM_SLOW = "comm-slow"  # job-wide: every rank on time, the collectives slow (JobWide, not a Straggler)


KINDS = StragglerKind.values()


def cost_words(cost_ms: Optional[float], cost_pct: Optional[float], by_cause: Optional[dict] = None) -> str:
    """'cost the job 6.2% of step time (1.3 ms/step; cpu_stall 1.1, compute 0.2)', or '' unknown."""
    if cost_ms is None or cost_pct is None:
        return ""
    parts = ", ".join(f"{c} {v:.1f}" for c, v in (by_cause or {}).items() if v >= 0.05)
    return f"cost the job {cost_pct:.1f}% of step time ({cost_ms:.1f} ms/step" + (f"; {parts})" if parts else ")")


def collective_words(in_collective: Optional[bool]) -> str:
    """What a stall message says of where the rank stopped relative to its collectives."""
    if in_collective is None:
        return ""
    return ("; inside a collective call (waiting for a peer)" if in_collective
            else "; outside any collective call (peers waiting in one wait for this rank)")


def cause_first(in_collective: Optional[bool], last_step: Optional[int], rank: int) -> tuple:
    """Sort key of hung ranks, the likely cause first: outside any collective (the ranks
    inside one wait for it), then unknown, then inside one; then the lowest last step (the
    rank that stopped first), then the rank."""
    return (0 if in_collective is False else 2 if in_collective is True else 1,
            last_step if isinstance(last_step, int) else 1 << 62, rank)
