"""The parts of a step, disjoint and adding up to it: the one definition the records' verdicts, the
periodic summary, `placement report` (table, plot, heatmap, trace, --compare) and the straggler causes use.

What
    A step's time is its data wait (blocked on the next batch), then its comm wait (blocked on
    its collectives), then its CPU stall (the main thread's runqueue wait: runnable, waiting for
    a CPU), then compute, the rest.

Comm wait is what main waited, not what was in flight
    DDP all-reduces its buckets while backward goes on, so a collective in flight is not a step
    waiting: a rank that computes longer inside backward has its buckets in flight all the
    while, and booking that time as comm hides the very rank the others wait for (TraceML's
    users see the same: traceml#252). While main is on a CPU or runnable it computes or stalls,
    whatever is in flight; so comm wait (comm_wait_ms) is the time main was off-CPU outside its
    data wait, up to the collectives' time in flight: the step less its data wait, less main's
    on-CPU and runqueue time (its schedstat), at most comm in flight. Compute is then never
    less than main's time on a CPU. Comm in flight stays a figure of its own
    (StepRecord.comm_inflight_ms: the comm-overlap view), never a part. Where the CPU cannot see
    the wait (NCCL: calls return at enqueue, and a CUDA sync spins on a CPU), comm wait is the
    GPU-side time in flight, which includes the wait for a late peer (docs/monitor.md).

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


def comm_wait_ms(step_ms: float, data_ms: Optional[float], inflight_ms: Optional[float],
                 main_cpu_ms: Optional[float], main_runq_ms: Optional[float]) -> Optional[float]:
    """A step's comm wait (the module docstring) from what main's schedstat says of it: its
    time in flight, less whatever of it main spent on a CPU or in the runqueue. None when
    either is not measured: an in-flight figure is an upper bound, never the wait."""
    if not inflight_ms:
        return inflight_ms
    if main_cpu_ms is None:
        return None
    off_cpu = step_ms - (data_ms or 0.0) - main_cpu_ms - (main_runq_ms or 0.0)
    return inflight_ms if off_cpu >= inflight_ms else max(off_cpu, 0.0)


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
