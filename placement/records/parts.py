"""The parts of a step, disjoint and adding up to it: the one definition the records' verdicts, the
periodic summary, `placement report` (table, plot, heatmap, trace, --compare) and the straggler causes use.

What
    A step's time is its data wait (blocked on the next batch), then its comm wait (in
    collectives), then its CPU stall (the main thread's runqueue wait: runnable, waiting for a
    CPU), then compute, the rest.

Why they do not overlap
    Blocked on data or on a collective the main thread sleeps, so its runqueue wait falls in the
    time it would compute: the parts do not overlap. Each is clamped to what the earlier ones
    left, so a counter read every k steps (a per-step mean over steps of different lengths)
    never makes a short step's parts add to more than the step. The NCCL threads' runqueue wait
    is not a part of its own: they wait while the collectives run, inside comm wait (the
    straggler classifier reads it as evidence that a rank's collectives are starved,
    monitor/stragglers/classify.py).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from placement.roles import ThreadRole
from placement.vocab import Vocabulary


class StepPart(Vocabulary):
    DATA = "data"
    COMM = "comm"
    CPU_STALL = "cpu_stall"
    COMPUTE = "compute"


class StepParts(NamedTuple):
    """A step's parts in ms (a tuple: built for every record on the monitor thread)."""

    data_ms: float
    comm_ms: float
    cpu_stall_ms: Optional[float]  # None: main's runqueue wait not read (then inside compute_ms)
    compute_ms: float

    def as_dict(self) -> dict[StepPart, Optional[float]]:
        return {StepPart.DATA: self.data_ms, StepPart.COMM: self.comm_ms, StepPart.CPU_STALL: self.cpu_stall_ms,
                StepPart.COMPUTE: self.compute_ms}


def _within(v: Optional[float], left: float) -> float:
    return 0.0 if v is None or v != v else min(max(v, 0.0), left)


def split_step(step_ms: float, data_ms: Optional[float], comm_ms: Optional[float],
               main_runq_ms: Optional[float]) -> StepParts:
    """A step's parts (the module docstring), in ms, adding up to max(step_ms, 0). The common
    case (no data wait, no collective) skips their clamps: the monitor thread splits every step."""
    left = max(step_ms, 0.0) if step_ms == step_ms else 0.0
    data = _within(data_ms, left) if data_ms else 0.0
    left -= data
    comm = _within(comm_ms, left) if comm_ms else 0.0
    left -= comm
    if main_runq_ms is None or main_runq_ms != main_runq_ms:
        return StepParts(data, comm, None, left)
    stall = _within(main_runq_ms, left)
    return StepParts(data, comm, stall, left - stall)


def record_parts(rec) -> StepParts:
    """The parts of a StepRecord, split once and kept on it (StepRecord.parts): the verdict, the
    digest, the summary and the live metrics each ask for them."""
    parts = rec.parts
    if parts is None:
        main = rec.roles.get(ThreadRole.MAIN)
        parts = rec.parts = split_step(rec.step_ms, rec.data_ms, rec.comm_ms, None if main is None else main.runq_ms)
    return parts
