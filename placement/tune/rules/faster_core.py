"""faster_core: a busy hot thread runs on a core slower than a free one in its share.

Slower by perf_rank (from the topology) or, where ranks tie or are unknown, by measured
MHz: the MHz its core ran at over the window against the free core's current MHz.
"""
from __future__ import annotations

from typing import Optional

from placement.cpuset import format_cpulist
from placement.roles import HOT_ROLES
from placement.tune.rules.base import Proposal, Rule, RuleContext, rounded
from placement.tune.rules.free import active_hot_roles, free_cores

# Only a thread on-CPU for at least this share of the step gains from a faster core.
HOT_BUSY_PCT = 25.0
# A free core must clock at least this much faster to count as faster by MHz alone.
MHZ_GAIN = 1.10
# Cores whose MHz is read per window (cpufreq files), fastest candidates first: bounds the cost
# on a large share where every core ties on perf_rank.
MAX_MHZ_CORES = 8


class FasterCoreRule(Rule):
    name = "faster_core"

    def propose(self, ctx: RuleContext) -> Optional[Proposal]:
        layout = ctx.layout
        busy = []
        for role in HOT_ROLES:
            rw = ctx.stats.role(role)
            if rw is not None and layout.cpus(role) and (rw.cpu_share_pct or 0.0) >= HOT_BUSY_PCT:
                busy.append((rw.cpu_share_pct, role))
        for _, role in sorted(busy, reverse=True):
            rw = ctx.stats.role(role)
            now = rw.cpus & layout.cpus(role) or layout.cpus(role)
            now_rank = layout.cores.rank_of(now)
            faster = {}
            mhz_reads = MAX_MHZ_CORES
            for core in layout.candidate_cores(role, active_hot_roles(ctx)):  # /proc only when one is faster
                rank = layout.cores.rank_of(core)
                by_rank = now_rank is not None and rank is not None and rank < now_rank
                free_mhz = None
                if not by_rank and rw.mhz is not None and (rank == now_rank or None in (rank, now_rank)) \
                        and mhz_reads > 0:
                    mhz_reads -= 1
                    free_mhz = max((m for m in map(ctx.facts.cpu_mhz, sorted(core)) if m is not None), default=None)
                by_mhz = free_mhz is not None and free_mhz >= MHZ_GAIN * rw.mhz
                if by_rank or by_mhz:
                    faster[core] = (rank, free_mhz, by_rank)
            for core in (free_cores(ctx, role) if faster else []):
                if core not in faster:
                    continue
                rank, free_mhz, by_rank = faster[core]
                target = layout.shaped_like(role, core)
                evidence = {"role": role.value, "cpu_pct": rounded(rw.cpu_share_pct), "cpus": sorted(now),
                            "perf_rank": now_rank, "mhz": rounded(rw.mhz), "free_core": sorted(core),
                            "free_perf_rank": rank, "free_mhz": rounded(free_mhz),
                            "window": [ctx.stats.first_step, ctx.stats.last_step]}
                what = (f"perf_rank {now_rank} vs {rank}" if by_rank else f"{rw.mhz:.0f} vs {free_mhz:.0f} MHz")
                return Proposal(self.name, role, target,
                                f"{role} runs on a slower core than free {format_cpulist(core)} ({what}): "
                                f"move it there", evidence)
        return None
