"""numa_balancing: bursts of minor faults and thread migrations that coincide with step-time
spikes are the signature of the kernel's automatic NUMA balancing (hinting faults, then
page and thread migration). Warn once per run; there is nothing to move.
"""
from __future__ import annotations

import math
import statistics
from typing import Optional

from placement.tune.rules.base import Proposal, Rule, RuleContext

# A step's minor faults form a burst above this multiple of the window's median and this floor.
BURST_FACTOR = 4.0
MIN_BURST_FAULTS = 64
# Bursts coinciding with spikes in at least this share of the window's steps (and >= 2 steps).
MIN_COINCIDING_SHARE = 0.05
COUNTERS = ("task_total_numa_faults", "task_numa_pages_migrated", "numa_hint_faults", "numa_pages_migrated")


class NumaBalancingRule(Rule):
    name = "numa_balancing"

    def __init__(self) -> None:
        self._last_counters: Optional[dict[str, int]] = None
        self._warned = False

    def propose(self, ctx: RuleContext) -> Optional[Proposal]:
        if self._warned:
            return None
        if self._last_counters is None:  # the baseline the counters' growth is measured from
            self._last_counters = ctx.facts.numa_counters()
        stats = ctx.stats
        faults = stats.step_totals("minflt")
        migrations = stats.step_totals("migrations")
        known_faults = [f for f in faults if f is not None]
        if not known_faults:
            return None
        fault_floor = max(BURST_FACTOR * statistics.median(known_faults), MIN_BURST_FAULTS)
        known_migr = [m for m in migrations if m is not None]
        migr_floor = statistics.median(known_migr) if known_migr else 0
        coinciding = sum(1 for spike, f, m in zip(stats.spikes(), faults, migrations)
                         if spike and f is not None and f > fault_floor and m is not None and m > migr_floor)
        if coinciding < max(2, math.ceil(MIN_COINCIDING_SHARE * stats.n)):
            return None
        counters = ctx.facts.numa_counters()  # read only with evidence: /proc/vmstat is long
        last, self._last_counters = self._last_counters, counters
        deltas = {k: counters[k] - last[k] for k in COUNTERS if k in counters and k in last}
        setting = ctx.facts.numa_balancing()
        numa_activity = sum(v for v in deltas.values() if v > 0)
        if not setting and not numa_activity:
            return None  # spikes with faults, but the kernel is not balancing: some other cause
        applied = ctx.facts.memory_policy()
        bound = applied in ("bind", "interleave", "preferred", "preferred_many", "weighted_interleave")
        memory = (f"memory binding is in force (policy {applied})" if bound else
                  f"memory binding is NOT in force (policy {applied or 'unknown'}, plan asked {ctx.memory_mode})")
        self._warned = True
        evidence = {"coinciding_steps": coinciding, "steps": stats.n, "kernel.numa_balancing": setting,
                    "numa_counter_deltas": deltas, "memory_policy": applied, "planned_memory": ctx.memory_mode,
                    "window": [stats.first_step, stats.last_step]}
        return Proposal(self.name, None, None,
                        f"step-time spikes coincide with bursts of minor faults and thread migrations in "
                        f"{coinciding} of {stats.n} steps; kernel.numa_balancing={setting}: automatic NUMA "
                        f"balancing is likely migrating this rank's pages and threads; {memory}. "
                        f"Consider sysctl kernel.numa_balancing=0 on training nodes", evidence)
