"""nccl_core: NCCL threads share a core with main (or all sit on one core together) while
communication is a large share of the step: give them a core of their own."""
from __future__ import annotations

from typing import Optional

from placement.cpuset import format_cpulist
from placement.roles import ThreadRole
from placement.tune.rules.base import Proposal, Rule, RuleContext, rounded
from placement.tune.rules.free import free_cores


class NcclCoreRule(Rule):
    name = "nccl_core"

    def propose(self, ctx: RuleContext) -> Optional[Proposal]:
        nccl = ctx.stats.role(ThreadRole.NCCL)
        layout = ctx.layout
        nccl_cpus = layout.cpus(ThreadRole.NCCL)
        if nccl is None or not nccl_cpus or ctx.stats.comm_share_pct <= ctx.cfg.comm_share_pct:
            return None
        nccl_cores = layout.cores.cores_of(nccl_cpus)
        with_main = bool(nccl_cores & layout.cores.cores_of(layout.cpus(ThreadRole.MAIN)))
        crowded = nccl.threads > 1 and len({min(layout.cores.core_of(c)) for c in nccl_cpus}) == 1
        if not (with_main or crowded):
            return None
        cores = free_cores(ctx, ThreadRole.NCCL)
        if not cores:
            return None
        evidence = {"comm_pct": rounded(ctx.stats.comm_share_pct), "threshold_pct": ctx.cfg.comm_share_pct,
                    "nccl_threads": nccl.threads, "nccl_cpus": sorted(nccl_cpus),
                    "shares_with": "main" if with_main else "each other",
                    "window": [ctx.stats.first_step, ctx.stats.last_step]}
        if with_main:
            target = layout.shaped_like(ThreadRole.NCCL, cores[0])
            why = f"share main's core {format_cpulist(nccl_cores)}"
        else:
            target = nccl_cpus | cores[0]
            why = f"{nccl.threads} threads share core {format_cpulist(nccl_cores)}"
        return Proposal(self.name, ThreadRole.NCCL, target,
                        f"comm is {ctx.stats.comm_share_pct:.0f}% of the step and NCCL threads {why}: "
                        f"give them {format_cpulist(target)}", evidence)
