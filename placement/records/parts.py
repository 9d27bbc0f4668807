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
    data wait, up to the collectives' time in flight: the steps less their data wait, less main's
    on-CPU and runqueue time (its schedstat), at most comm in flight, over each reading of main's
    counters, shared among its steps as their time in flight is. Compute is then never less than
    main's time on a CPU over a reading. Comm in flight stays a figure of its own
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

from typing import NamedTuple, Optional, Sequence

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


def comm_wait_ms(step_ms: Sequence[float], data_ms: Sequence[float], inflight_ms: Sequence[Optional[float]],
                 main_cpu_ms: Optional[float], main_runq_ms: Optional[float]) -> list[Optional[float]]:
    """The comm wait (the module docstring) of the steps one reading of main's counters covers,
    from what its schedstat says of them: `main_cpu_ms` and `main_runq_ms` are the reading's
    per-step means. Each step's first estimate is its time in flight up to its own time off-CPU
    outside data wait, with main's on-CPU and runqueue time taken as the mean; then the steps
    are scaled together (never past their time in flight) to what the reading says exactly (the
    readings telescope): main's time off-CPU outside data wait over them, at most their time in
    flight. The step-by-step estimate keeps which steps main waited in (the rank late at every
    step shows so); the reading's total keeps a busy host's runqueue spikes, which land on some
    steps of a reading and not others, from turning into waits lost or made up (the Ray Train
    job of tests/integrations/test_ray.py beside two spinners, at 150 ms/step of runqueue wait). None where in flight is not
    measured, or main's clock was not read: an in-flight figure is an upper bound, never the wait."""
    if main_cpu_ms is None:
        return [f if not f else None for f in inflight_ms]
    total = sum(f for f in inflight_ms if f)
    if not total:
        return list(inflight_ms)
    runq = main_runq_ms or 0.0
    busy = main_cpu_ms + runq
    # A data wait may hold main's runqueue wait (the batch is in, main waits for a CPU to take
    # it): that much of it is not off-CPU time, and is left to the data wait, not taken twice.
    first = [min(f, max(s - max(d - runq, 0.0) - busy, 0.0)) if f else 0.0
             for s, d, f in zip(step_ms, data_ms, inflight_ms)]
    off_cpu = sum(step_ms) - max(sum(data_ms) - len(step_ms) * runq, 0.0) - len(step_ms) * busy
    want = min(total, max(off_cpu, 0.0)) if off_cpu == off_cpu else 0.0
    got = sum(first)
    if got > 0:
        scale = want / got
        return [min(f, w * scale) if f else f for w, f in zip(first, inflight_ms)]
    share = want / total  # no step alone shows a wait: as their time in flight
    return [f * share if f else f for f in inflight_ms]


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
