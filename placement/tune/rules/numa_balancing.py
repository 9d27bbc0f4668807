"""numa_balancing: a burst of minor faults, with migrations (of threads or pages), in a window
whose step times spike is the signature of the kernel's automatic NUMA balancing (hinting
faults, then page and thread migration). Warn once per run; there is nothing to move.

Faults are compared window against window (the monitor reports most counters as per-step
means over a span of steps, so single steps cannot be told apart).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Optional

from placement.tune.rules.base import Proposal, Rule, RuleContext, rounded

# A window's fault rate is a burst above this multiple of the recent windows' median rate
# and above this many faults per step.
BURST_FACTOR = 4.0
MIN_BURST_FAULTS = 64.0
HISTORY_WINDOWS = 8
MIN_HISTORY = 2
# Step-time spikes in at least this share of the window's steps (and in 2 steps or more).
MIN_SPIKE_SHARE = 0.05
COUNTERS = ("task_total_numa_faults", "task_numa_pages_migrated", "numa_hint_faults", "numa_pages_migrated")
PAGE_MIGRATIONS = ("task_numa_pages_migrated", "numa_pages_migrated")


def _mean(values) -> Optional[float]:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


class NumaBalancingRule(Rule):
    name = "numa_balancing"

    def __init__(self) -> None:
        self._last_counters: Optional[dict[str, int]] = None
        self._faults: deque[float] = deque(maxlen=HISTORY_WINDOWS)
        self._migrations: deque[float] = deque(maxlen=HISTORY_WINDOWS)
        self._warned = False

    def propose(self, ctx: RuleContext) -> Optional[Proposal]:
        if self._warned:
            return None
        if self._last_counters is None:  # the baseline the counters' growth is measured from
            self._last_counters = ctx.facts.numa_counters()
        stats = ctx.stats
        faults = _mean(stats.step_totals("minflt"))
        migrations = _mean(stats.step_totals("migrations")) or 0.0
        if faults is None:
            return None
        usual_faults = statistics.median(self._faults) if len(self._faults) >= MIN_HISTORY else None
        usual_migr = statistics.median(self._migrations) if self._migrations else 0.0
        self._faults.append(faults)
        self._migrations.append(migrations)
        spikes = sum(stats.spikes())
        if (usual_faults is None or faults <= max(BURST_FACTOR * usual_faults, MIN_BURST_FAULTS)
                or spikes < max(2, math.ceil(MIN_SPIKE_SHARE * stats.n))):
            return None
        counters = ctx.facts.numa_counters()  # read only with evidence: /proc/vmstat is long
        last, self._last_counters = self._last_counters, counters
        deltas = {k: counters[k] - last[k] for k in COUNTERS if k in counters and k in last}
        pages_moved = sum(deltas.get(k, 0) for k in PAGE_MIGRATIONS)
        if migrations <= usual_migr and pages_moved <= 0:
            return None  # faults without migrations: allocation, not balancing
        setting = ctx.facts.numa_balancing()
        if not setting and not any(v > 0 for v in deltas.values()):
            return None  # the kernel is not balancing: some other cause
        applied = ctx.facts.memory_policy()
        bound = applied in ("bind", "interleave", "preferred", "preferred_many", "weighted_interleave")
        memory = (f"memory binding is in force (policy {applied})" if bound else
                  f"memory binding is NOT in force (policy {applied or 'unknown'}, plan asked {ctx.memory_mode})")
        self._warned = True
        evidence = {"faults_per_step": rounded(faults), "usual_faults_per_step": rounded(usual_faults),
                    "migrations_per_step": rounded(migrations), "usual_migrations_per_step": rounded(usual_migr),
                    "spike_steps": spikes, "steps": stats.n, "kernel.numa_balancing": setting,
                    "numa_counter_deltas": deltas, "memory_policy": applied, "planned_memory": ctx.memory_mode,
                    "window": [stats.first_step, stats.last_step]}
        return Proposal(self.name, None, None,
                        f"steps {stats.first_step}-{stats.last_step}: {faults:.0f} minor faults per step "
                        f"(usually {usual_faults:.0f}) with migrations and {spikes} step-time spikes; "
                        f"kernel.numa_balancing={setting}: automatic NUMA balancing is likely migrating this "
                        f"rank's pages and threads; {memory}. Consider sysctl kernel.numa_balancing=0 on "
                        f"training nodes", evidence)
