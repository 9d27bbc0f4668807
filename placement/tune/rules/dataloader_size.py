"""dataloader_size: grow the DataLoader set when the step waits for data and the workers are
CPU-saturated; shrink it when the workers are mostly idle while a hot thread waits on a
core they share.

The grow and shrink thresholds are far apart (hysteresis), so the two never chase each other.
"""
from __future__ import annotations

from typing import Optional

from placement.cpuset import format_cpulist
from placement.roles import HOT_ROLES, ThreadRole
from placement.tune.rules.base import Proposal, Rule, RuleContext, rounded
from placement.tune.rules.free import free_cores

# Busy (on-CPU + waiting for a CPU) per CPU of the set, % of step time.
SATURATED_PCT = 80.0
IDLE_PCT = 25.0
# A hot role on-CPU less than this share of the step is mostly waiting (e.g. for data),
# so its core can be lent to niced workers.
LENDABLE_BUSY_PCT = 50.0

DL = ThreadRole.DATALOADER


class DataloaderSizeRule(Rule):
    name = "dataloader_size"

    def propose(self, ctx: RuleContext) -> Optional[Proposal]:
        dl = ctx.stats.role(DL)
        dl_cpus = ctx.layout.cpus(DL)
        if dl is None or not dl_cpus or dl.cpu_share_pct is None:
            return None
        busy_per_cpu = (dl.cpu_share_pct + (dl.runq_share_pct or 0.0)) / len(dl_cpus)
        evidence = {"data_pct": rounded(ctx.stats.data_share_pct), "threshold_pct": ctx.cfg.data_share_pct,
                    "workers_busy_pct_per_cpu": rounded(busy_per_cpu), "dataloader_cpus": sorted(dl_cpus),
                    "window": [ctx.stats.first_step, ctx.stats.last_step]}
        if ctx.stats.data_share_pct > ctx.cfg.data_share_pct and busy_per_cpu >= SATURATED_PCT:
            return self._grow(ctx, dl_cpus, busy_per_cpu, evidence)
        if busy_per_cpu <= IDLE_PCT:
            return self._shrink(ctx, dl_cpus, busy_per_cpu, evidence)
        return None

    def _grow(self, ctx: RuleContext, dl_cpus: frozenset[int], busy: float, evidence: dict) -> Optional[Proposal]:
        spare = [c for c in free_cores(ctx, DL) if not c <= dl_cpus]
        if spare:
            add, how = spare[0] - dl_cpus, "a spare core"
        else:
            add, how = self._lendable(ctx, dl_cpus), "the core of a hot thread that waits for data (workers are niced)"
        if not add:
            return None
        target = dl_cpus | add
        evidence["added"] = sorted(add)
        return Proposal(self.name, DL, target,
                        f"data wait is {ctx.stats.data_share_pct:.0f}% of the step and workers are "
                        f"{busy:.0f}% busy per CPU: grow dataloader to {format_cpulist(target)} ({how})",
                        evidence)

    @staticmethod
    def _lendable(ctx: RuleContext, dl_cpus: frozenset[int]) -> frozenset[int]:
        """With no spare core: a hot role's core when that role is mostly idle and the workers
        run at a higher nice value, so the hot thread still preempts them."""
        if not ctx.background_niced:
            return frozenset()
        for role in HOT_ROLES:
            rw = ctx.stats.role(role)
            cpus = ctx.layout.cpus(role) - dl_cpus
            if rw is not None and cpus and rw.cpu_share_pct is not None and rw.cpu_share_pct < LENDABLE_BUSY_PCT:
                return cpus
        return frozenset()

    def _shrink(self, ctx: RuleContext, dl_cpus: frozenset[int], busy: float, evidence: dict) -> Optional[Proposal]:
        layout = ctx.layout
        for role in HOT_ROLES:
            rw = ctx.stats.role(role)
            if rw is None or rw.runq_share_pct is None or rw.runq_share_pct <= ctx.cfg.runq_wait_pct:
                continue
            core = layout.cores.cores_of(layout.cpus(role))
            target = dl_cpus - core
            if not (dl_cpus & core) or not target:
                continue
            evidence.update({"waiting_role": role.value, "runq_pct": rounded(rw.runq_share_pct),
                             "removed": sorted(dl_cpus & core)})
            return Proposal(self.name, DL, target,
                            f"workers are {busy:.0f}% busy per CPU while {role} waits "
                            f"{rw.runq_share_pct:.0f}% of the step on a core they share: shrink dataloader "
                            f"to {format_cpulist(target)}", evidence)
        return None
