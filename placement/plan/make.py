"""make_plan: Topology + JobSpec + PlacementConfig -> Plan. Pure: reads nothing, writes nothing."""
from __future__ import annotations

from placement.config import PROCESS_LEVEL_POLICIES, MemoryMode, PlacementConfig, Policy, validate
from placement.cpuset import format_cpulist
from placement.errors import PlanError
from placement.plan.auto import plan_auto, plan_auto_within
from placement.plan.context import PlanContext, RankSlot
from placement.plan.cores import share_cores
from placement.plan.gpus import rank_slots
from placement.plan.model import GpuRef, JobSpec, MemoryPolicy, Plan, RankPlan
from placement.plan.process_level import plan_process_level
from placement.topology.model import Topology

def make_plan(topo: Topology, job: JobSpec, cfg: PlacementConfig) -> Plan:
    """The per-rank, per-role CPU plan for one node, each rank with the physical cores of its
    share (RankPlan.cores: what the tuner needs of the topology, so no worker loads it).

    Raises PlanError (one line naming the shortfall and what is available) when the plan cannot
    be met and cfg.strict; with strict off, returns a degraded plan whose warnings say what it
    gave up.
    """
    plan = _make_plan(topo, job, cfg)
    for r in plan.ranks:
        r.cores = share_cores(topo, r.share())
    return plan


def _make_plan(topo: Topology, job: JobSpec, cfg: PlacementConfig) -> Plan:
    validate(cfg)
    if job.nproc_per_node < 1:
        raise PlanError(f"nproc_per_node={job.nproc_per_node} is not valid; valid: an integer >= 1")
    ctx = PlanContext.create(topo, cfg)
    slots = rank_slots(ctx, job)
    if cfg.policy == Policy.NONE:
        return _plan(ctx, Policy.NONE, _unbound(slots))
    if not ctx.usable:
        problem = (f"placement.reserved_cpus={cfg.reserved_cpus!r} leaves no usable CPU "
                   f"(online and allowed: {format_cpulist(topo.usable())})" if topo.usable() else
                   f"no CPU of {topo.root} is both online and allowed "
                   f"(online: {format_cpulist(c.id for c in topo.cpus if c.online) or 'none'})")
        ctx.shortfall(problem, "no binding at all, ranks run where the OS puts them (monitor only)")
        return _plan(ctx, cfg.policy, _unbound(slots))
    if cfg.policy in PROCESS_LEVEL_POLICIES:
        return _plan(ctx, cfg.policy, plan_process_level(ctx, slots, job))
    if job.within is not None:
        if job.within not in PROCESS_LEVEL_POLICIES:
            raise PlanError(f"--numa-binding={job.within!r} is not valid; valid: {', '.join(map(str, PROCESS_LEVEL_POLICIES))}")
        within = Policy(job.within)
        return _plan(ctx, f"auto within {within}", plan_auto_within(ctx, slots, job, within))
    return _plan(ctx, cfg.policy, plan_auto(ctx, slots, job))


def _plan(ctx: PlanContext, policy: str, ranks: list[RankPlan]) -> Plan:
    return Plan(str(policy), ranks, ctx.warnings, ctx.shortfalls[0] if ctx.shortfalls else None)


def _unbound(slots: list[RankSlot]) -> list[RankPlan]:
    return [RankPlan(local_rank=s.local_rank, gpu=None if s.gpu is None else GpuRef(s.gpu.index, s.gpu.pci),
                     numa=[], memory=MemoryPolicy(MemoryMode.NONE, []), env={}, roles={}) for s in slots]
