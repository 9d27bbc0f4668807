"""Communication time of one rank per step, behind one interface (CommTiming).

What
    - gloo (and any backend whose calls block until done): the wall time of the collective
      calls. DDP runs its bucket all-reduces in the C++ reducer, so a DDP comm hook times
      each one from the hook call to its future's completion; collectives called from Python
      (torch.distributed.all_reduce, ...: Megatron's grad buffers, user code) are wrapped.
      comm_ms is the union of those intervals within the step (buckets overlap).
    - NCCL: calls return at enqueue, so the wrappers give only entry times and counts; the
      durations come from PyTorch's own per-collective records (placement.monitor.comm.nccl).
      DDP's bucket all-reduces are in the flight recorder too, counts and enqueue times
      included, so they get no comm hook there (ddp_bucket_route).

    The interface, the per-step figure and the collective wrappers every source shares live in
    placement.monitor.comm.base; make_comm_timing() here chooses the source.

Cost
    The DDP comm hook costs a Python call and a `fut.then` future per bucket, as torch's own
    Python allreduce_hook does (benchmarks/ddp_hook.py), and each call takes the GIL on the
    autograd thread in the middle of backward, where DDP's own all-reduce takes none: on a GPU a
    launch-bound DDP loop is measurably slower with it (`benchmarks/gpu_check.py --only ablation`,
    docs/benchmarks.md). So it is installed only where nothing else sees the buckets: gloo (wall
    time), NCCL's completion-hook route, a torch whose NCCL flight recorder cannot be read; never
    in a one-rank gloo job under `auto`.

    Its future's callback runs on the thread that completes the all-reduce (gloo's run loop),
    where it keeps that thread's Python state (base.ThreadStates): without it, each bucket made
    and deleted a few.
"""
from __future__ import annotations

import enum
from typing import Optional

from placement.config import BUDGET_PCT, CommTimingMode
from placement.monitor.comm.base import THREAD_STATES, CollectiveClock, CommTiming, OriginalCollectives
from placement.monitor.comm.groups import nccl_groups
from placement.monitor.comm.nccl import choose_nccl_timing
from placement.monitor.warn import WarnOnce, first_line


class WallComm(CommTiming):
    """gloo: collective calls block until done, so their wall time is the comm time."""

    name = "wall"


class NoComm(CommTiming):
    """monitor.comm_timing=off: nothing wrapped, nothing timed."""

    name = "off"

    def in_collective(self) -> Optional[bool]:
        return None  # nothing wrapped: no call is seen

    def install(self, original: "OriginalCollectives") -> None:
        return None


class DdpHookTarget:
    """The clock a model's one placement DDP hook times into: DDP comm hooks cannot be
    removed nor registered twice, so a re-attach (close(), then attach() on the same model)
    points the registered hook at its own clock instead of losing comm timing."""

    __slots__ = ("clock",)

    def __init__(self, clock: CollectiveClock):
        self.clock = clock


# What a one-rank DDP job's log says of its comm time (ddp_bucket_route).
ONE_RANK_LINE = ("comm time is not measured in a one-rank DDP job on gloo (comm_ms null): a rank alone moves "
                 "nothing, and timing DDP's bucket all-reduces costs a Python call per bucket "
                 "(benchmarks/ddp_hook.py); placement.monitor.comm_timing=wall measures it")


class DdpBuckets(enum.Enum):
    """How a model's DDP bucket all-reduces are seen (ddp_bucket_route)."""

    NOT_DDP = "not_ddp"  # no DDP model: nothing to decide
    HOOK = "hook"  # placement's DDP comm hook times them (install_ddp_hook)
    RECORDER = "flight_recorder"  # the NCCL flight recorder holds them; no hook
    UNMEASURED = "unmeasured"  # a one-rank gloo job under `auto`: not measured (ONE_RANK_LINE)


def ddp_bucket_route(mode: CommTimingMode, comm: CommTiming, world_size: int, model) -> DdpBuckets:
    """How DDP's bucket all-reduces are seen. From the flight recorder where it sees every
    collective (comm.sees_all): the hook would only add its cost. Not at all in a one-rank gloo
    world under `auto`: its all-reduces move nothing, and the hook is the whole gap between
    placerun and torchrun on such a job; the caller makes the clock untimed, so comm_ms is null,
    not a short figure, and says ONE_RANK_LINE once. Elsewhere by the hook."""
    if not _is_ddp(model):
        return DdpBuckets.NOT_DDP
    if comm.sees_all:
        return DdpBuckets.RECORDER
    if mode == CommTimingMode.AUTO and world_size == 1 and comm.timed_calls:
        return DdpBuckets.UNMEASURED
    return DdpBuckets.HOOK


def _is_ddp(model) -> bool:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return False
    return isinstance(model, DistributedDataParallel)


def install_ddp_hook(model, clock: CollectiveClock, original: OriginalCollectives, warn: WarnOnce) -> bool:
    """Register a DDP comm hook that all-reduces each bucket exactly as DDP's default does
    (average over the group) and times it from the hook call to its future's completion
    into the current attach's clock (the model's DdpHookTarget; a closed clock keeps nothing)."""
    if not _is_ddp(model):
        return False
    target = getattr(model, "_placement_ddp_target", None)
    if isinstance(target, DdpHookTarget):  # our hook from an earlier attach: follow this one
        target.clock = clock
        return True
    if getattr(model, "_comm_hooks", None):
        warn("ddp-hook", "the DDP model already has a comm hook; its bucket all-reduces are timed only "
                         "when that hook calls torch.distributed collectives from Python")
        return False
    all_reduce = original.all_reduce
    group = model.process_group
    target = DdpHookTarget(clock)

    def placement_timed_allreduce(_state, bucket):
        clock = target.clock
        t0 = clock.enter()
        tensor = bucket.buffer()
        tensor.div_(group.size())
        fut = all_reduce(tensor, group=group, async_op=True).get_future()

        def finished(f):
            clock.done(t0)
            THREAD_STATES.keep()
            return f.value()[0]

        return fut.then(finished)

    try:
        model.register_comm_hook(None, placement_timed_allreduce)
    except Exception as e:  # e.g. a hook registered in C++ (register_builtin_comm_hook)
        warn("ddp-hook", f"cannot time DDP bucket all-reduces: {first_line(e)}")
        return False
    model._placement_ddp_target = target
    return True


def make_comm_timing(mode: CommTimingMode, backend: Optional[str], warn: WarnOnce, *, window: int = 20,
                     budget_pct: float = BUDGET_PCT) -> CommTiming:
    """The CommTiming for monitor.comm_timing `mode`. NCCL timing when the default group's
    backend (comm_groups.default_backend: from its backend config, not the string the user
    gave) is NCCL or any group runs NCCL on some device. `window`: steps after which comm
    time still all null is warned about (monitor.exchange_every); `budget_pct`: the share of
    step time reading PyTorch's records may hold the GIL (monitor.budget_pct)."""
    mode = CommTimingMode(mode)
    if mode == CommTimingMode.OFF:
        return NoComm(warn)
    nccl = backend == "nccl" or bool(nccl_groups())
    if nccl and mode != CommTimingMode.WALL:
        return choose_nccl_timing(mode, warn, window=window, budget_pct=budget_pct)
    if mode in (CommTimingMode.FLIGHT_RECORDER, CommTimingMode.HOOK):
        warn("comm-mode", f"monitor.comm_timing={mode} needs the NCCL backend (this job uses "
                          f"{backend or 'no process group'}); timing collective calls by wall time")
    if nccl:
        warn("comm-wall-nccl", "monitor.comm_timing=wall on NCCL measures only the launch of each "
                               "collective (calls return at enqueue)")
    return WallComm(warn)
