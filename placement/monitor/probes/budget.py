"""How often the step hook reads the kernel counters, from what the hook costs on this machine.

A step's time, data wait and comm come from clocks the hook reads anyway; the hot threads'
runqueue wait and on-CPU time need system calls, whose cost differs tenfold between
machines: about 1-2 us on bare metal, 20-40 us right after a training step on a
nested-virtualised VM (benchmarks/monitor_overhead.py prints both). The hook may spend
monitor.budget_pct of the step time on the training thread. When its measured cost per
step is above that, the counters are read every k-th step, and each of those k steps gets
their per-step mean (StepRecord.probe_steps = k); when k-1 would fit again with room to
spare, k comes down. budget_pct = 0 reads them every step whatever it costs.

The hook times itself from the inside, so its figure misses what it cannot see of itself
on the same thread: the call into it and handle.watch()'s clock reads around each batch
(about a third of the inside figure on our VM). k is therefore chosen for AIM of the
budget, so that all of it together stays inside the budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

MAX_EVERY = 10  # never coarser than this: a hog of a few steps must still show
AIM = 0.6  # share of the budget the hook's own figure is held to (the rest: its call, handle.watch())
LOWER_BELOW = 0.8  # come down a step only when the cost would stay under this share of the aim


@dataclass
class ProbeBudget:
    budget_pct: float
    every: int = 1  # the counters are read every `every` steps

    def update(self, hook_us_per_step: float, step_ms: float) -> Optional[int]:
        """Judge one batch: the hook's mean cost per step and the median step time. Returns
        the new `every` when it changes, else None."""
        if self.budget_pct <= 0 or step_ms <= 0 or hook_us_per_step <= 0:
            return None
        aim_us = AIM * self.budget_pct / 100.0 * step_ms * 1e3
        k = self.every
        if hook_us_per_step > aim_us and k < MAX_EVERY:
            # Cost ~ fixed + reads / k; scaling k by the overshoot assumes all of it is reads,
            # so it lands inside the aim in an update or two.
            new = min(MAX_EVERY, max(k + 1, math.ceil(k * hook_us_per_step / aim_us)))
        elif k > 1 and hook_us_per_step * k / (k - 1) < LOWER_BELOW * aim_us:
            new = k - 1  # the cost at k-1 if all of it were reads: an upper bound
        else:
            return None
        self.every = new
        return new

    def over(self, hook_us_per_step: float, step_ms: float) -> bool:
        """Whether the cost is over the budget although the counters are read as seldom as allowed."""
        return (self.budget_pct > 0 and self.every >= MAX_EVERY
                and hook_us_per_step > self.budget_pct / 100.0 * step_ms * 1e3)
