"""What placement costs a rank, all of it, and the judgement that keeps it inside the budget.

What
    CostKeeper owns the cost's state: the batches' judgement (ProbeBudget: how often the hot
    threads' counters are read), the per-second one (CostRate), and the figures the `monitor`
    and `end` events carry. The cost is the step hook's time on the training thread and the CPU
    of every thread of placement's in the process (roles.OWN_THREADS: the monitor thread's
    readings, records, hand-overs, the tuner's windows, the exchange; the binder's watcher; rank
    0's peer watch; the posts), read by their CPU clocks, and at close, close's own work.
    - judge_batch(): at each hand-over, the batch's cost per step against the budget; k moves
      (probes/budget.py), a `monitor` event says so, and the budget's warning comes once when
      the median of the batches at the cap is still over it.
    - tick(): once a second of wall time, whatever the steps do: placement's CPU in that second
      is its share of every step in it; over the budget, the readings go to their cap at once,
      and RATE_WARN_S such seconds in a row at the cap say the budget's warning.
    - whole(): the end event's placement_cpu_us_per_step and placement_cost_pct; thread(): its
      monitor_thread_us_per_step.

Threads
    judge_batch() runs on whoever holds the monitor's lock (the monitor thread, an exit path);
    tick() on the monitor thread between hand-overs, without that lock (a hung main thread may
    hold it). The keeper's own lock guards the budget between the two.

Cost
    A clock read per thread of ours and a few float operations, per hand-over and per second.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from placement.events import EventKind
from placement.monitor.probes.budget import CostRate, PacedFloor, ProbeBudget, floor_scales
from placement.monitor.probes.sampled import SampledReads
from placement.roles import OWN_THREADS

RATE_WARN_S = 3  # seconds in a row over the budget, the readings at their cap, before the warning


class CostKeeper:
    def __init__(self, budget_pct: float, events, warn: Callable[[str, str], None],
                 sampled: Optional[SampledReads], floor_s: tuple[float, float] = (0.0, 0.0)):
        self.budget = ProbeBudget(budget_pct)
        self._rate = CostRate(budget_pct)
        # the paced floor: (monitor.handover_min_s, monitor.handover_max_s)
        self.floor = PacedFloor(budget_pct, floor_scales(*floor_s))
        self._floor_s = floor_s[0]
        self._events = events
        self._warn = warn
        self._sampled = sampled  # where the readings are paced (None: the hook reads every step)
        self._lock = threading.Lock()  # the budget: judge_batch() against tick()
        # (hook ns, hook steps, placement's threads' CPU ns, readings' ns) at the last judgement
        self._seen = (0, 0, OWN_THREADS.cpu_ns(), 0)
        self._judged = False  # the first batch (the threads' start) is not judged
        self._rate_over = 0  # seconds in a row over the budget with the readings at their cap
        self._step_ms: Optional[float] = None  # the last batch's median step
        self._start = (time.perf_counter_ns(), OWN_THREADS.cpu_ns())  # step 1's start, our CPU then
        self._thread_ns: Optional[int] = None  # the monitor thread's CPU over its life, as it ended

    def start(self, hook_ns: int, hook_steps: int, start_ns: int) -> None:
        """Step 1 begins at perf_counter_ns `start_ns`: what was spent before is no step's."""
        own = OWN_THREADS.cpu_ns()
        self._seen = (hook_ns, hook_steps, own, 0)
        self._start = (start_ns, own)

    # ---- per batch ------------------------------------------------------------------------
    def judge_batch(self, step_ms: Optional[float], hook_ns: int, hook_steps: int, step: int) -> None:
        """Read the kernel counters every k-th step when placement costs more than the budget
        otherwise (ProbeBudget). Only the readings depend on k: when the rest alone is over the
        budget, k goes to its cap and the budget's warning is said once. A tuner still gets a
        reading at the end of each of its windows (its hand-over reads), whatever k."""
        if step_ms is not None:
            self._step_ms = step_ms
        ns0, steps0, own0, read0 = self._seen
        own_ns = OWN_THREADS.cpu_ns()
        sampled = self._sampled
        read_ns = sampled.cost_ns if sampled is not None else 0
        self._seen = (hook_ns, hook_steps, own_ns, read_ns)
        if hook_steps - steps0 < 4 or step_ms is None:
            return
        if self._judged:
            self._judge_floor(time.monotonic(), own_ns + hook_ns, step, step_ms)
        else:
            self._judged = True
            return  # (up to the first judgement: the threads' start, no per-step cost)
        steps = hook_steps - steps0
        hook_us = (hook_ns - ns0) / 1e3 / steps
        reads_us = (read_ns - read0) / 1e3 / steps  # the readings and the wake-ups they took
        own_us = max(0, own_ns - own0) / 1e3 / steps
        cost_us = hook_us + own_us
        budget = self.budget
        with self._lock:
            was = budget.every
            now = budget.update(cost_us, step_ms, step, reads_us=reads_us)
            if sampled is not None:
                sampled.pace(budget.every, step_ms)
        if now is not None:
            self._events.event(EventKind.MONITOR, message=(
                f"kernel counters read every {now} step(s), was {was}: placement costs {cost_us:.1f} us "
                f"per step on this machine ({hook_us:.1f} in the step hook, {own_us:.1f} on its own threads, "
                f"{reads_us:.1f} of it reading counters), {cost_us / 10 / step_ms:.2f}% of a {step_ms:.2f} ms "
                f"step, budget {budget.budget_pct}% (placement.monitor.budget_pct)"),
                probe_every=now, step=step, hook_us=round(hook_us, 1), thread_us=round(own_us, 1),
                reads_us=round(reads_us, 1), placement_cpu_us_per_step=round(cost_us, 1),
                placement_cost_pct=round(cost_us / 10 / step_ms, 3),
                step_ms=round(step_ms, 3), budget_pct=budget.budget_pct)
        elif budget.over(step_ms) and self.floor.scale >= self.floor.most:
            self._warn("budget", f"placement costs {budget.judged_us():.1f} us per step (the median of its "
                                 f"last batches; {hook_us:.1f} in the step hook and {own_us:.1f} on its own threads "
                                 f"in the last), over {budget.budget_pct}% of a {step_ms:.2f} ms step although "
                                 f"it reads the kernel counters only every {budget.every} steps")

    # ---- per second -----------------------------------------------------------------------
    def tick(self, now_s: float, hook_ns: int, step: int) -> None:
        """Once a second (CostRate): placement's share of the last second, its threads' CPU and
        the hook's time (`hook_ns` so far). Over the budget, the readings go to their cap at once,
        not after the batches judge_batch() waits for; still over there for RATE_WARN_S seconds in
        a row, the budget's warning is said (once)."""
        rate, budget = self._rate, self.budget
        pct = rate.tick(now_s, OWN_THREADS.cpu_ns() + hook_ns)
        if pct is None:
            if rate.last_pct is not None and rate.last_pct <= budget.budget_pct:
                self._rate_over = 0
            return
        step_ms = self._step_ms
        if step_ms is None:
            return
        with self._lock:
            was = budget.every
            now = budget.to_cap(step_ms, step)
            if now is not None and self._sampled is not None:
                self._sampled.pace(now, step_ms)
        if now is not None:
            self._rate_over = 0
            self._events.event(EventKind.MONITOR, message=(
                f"kernel counters read every {now} step(s), was {was}: placement took {pct:.2f}% of the last "
                f"second on this rank (its threads' CPU and the step hook), over the budget "
                f"{budget.budget_pct}% (placement.monitor.budget_pct)"),
                probe_every=now, step=step, placement_cost_pct=round(pct, 3), budget_pct=budget.budget_pct)
            return
        self._rate_over += 1
        if self._rate_over >= RATE_WARN_S and self.floor.scale >= self.floor.most:
            self._warn("budget", f"placement takes {pct:.1f}% of this rank's time (its threads' CPU and the step "
                                 f"hook over the last second, {RATE_WARN_S} seconds in a row), over "
                                 f"{budget.budget_pct}% although it reads the kernel counters only every "
                                 f"{budget.every} steps")

    def _judge_floor(self, now_s: float, cpu_ns: int, step: int, step_ms: float) -> None:
        """The paced floor (budget.py PacedFloor), judged at a hand-over; it rises only once the
        readings are at their cap."""
        floor = self.floor
        was = floor.scale
        changed = floor.judge(now_s, cpu_ns, self.budget.at_cap(step_ms))
        if changed is None:
            return
        scale, pct, period_s = changed
        self._events.event(EventKind.MONITOR, message=(
            f"hand-overs at least {scale * self._floor_s:g} s apart, was {was * self._floor_s:g} s: placement "
            f"took {pct:.2f}% of the last {period_s:.0f} s on this rank, "
            + (f"over the budget {floor.budget_pct}% (placement.monitor.budget_pct) with the kernel counters "
               f"read as seldom as allowed; the log's records, the live metrics, straggler naming and the "
               f"tuner's windows come up to that much later" if scale > was else
               f"well under the budget {floor.budget_pct}% (placement.monitor.budget_pct)")),
            handover_floor_s=scale * self._floor_s, step=step, placement_cost_pct=round(pct, 3),
            budget_pct=floor.budget_pct)

    # ---- at the end -----------------------------------------------------------------------
    def whole(self, steps: int, hook_ns: int, closing_ns: int, last_end_ns: int) -> dict:
        """The end event's `placement_cpu_us_per_step`: all that placement cost this rank over
        the `steps` monitored (the hook's time, the CPU of every thread of ours, the ones that
        ended included, and `closing_ns`, close's own work on its thread), and
        `placement_cost_pct`, its share of the mean step (the last ending at `last_end_ns`);
        null and `placement_cost_null` saying why when no step was monitored."""
        start_ns, own0 = self._start
        if steps <= 0 or last_end_ns <= start_ns:
            return {"placement_cpu_us_per_step": None, "placement_cost_pct": None,
                    "placement_cost_null": "no step was monitored"}
        us = (hook_ns + closing_ns + max(0, OWN_THREADS.cpu_ns() - own0)) / 1e3 / steps
        step_us = (last_end_ns - start_ns) / 1e3 / steps
        return {"placement_cpu_us_per_step": round(us, 2), "placement_cost_pct": round(100 * us / step_us, 3)}

    def floor_figures(self) -> dict:
        """The end event's `handover_floor_s`, the hand-overs' paced floor at the end (null where
        nothing is paced in time: handover_min_s 0), and `handover_floor_scale`, how many times
        monitor.handover_min_s the budget stretched it to (PacedFloor)."""
        scale = self.floor.scale
        return {"handover_floor_s": scale * self._floor_s if self._floor_s > 0 else None,
                "handover_floor_scale": scale}

    def thread_ended(self, cpu_ns: int) -> None:
        """The monitor thread ends, having spent `cpu_ns` of CPU (its own clock)."""
        self._thread_ns = cpu_ns

    def thread(self, steps: int, started: bool, waited_s: float) -> dict:
        """The end event's `monitor_thread_us_per_step`: the monitor thread's CPU over its life
        per step monitored (what a Python-bound step pays for it through the GIL, beside the
        hook's own figure), or null and `monitor_thread_null` saying why (`waited_s`: how long
        close waited for it)."""
        why = ("the monitor thread never started" if not started else
               f"the monitor thread was still busy at close (after {waited_s:.0f} s)" if self._thread_ns is None
               else "no step was monitored" if steps <= 0 else None)
        if why is not None:
            return {"monitor_thread_us_per_step": None, "monitor_thread_null": why}
        return {"monitor_thread_us_per_step": round(self._thread_ns / 1e3 / steps, 2)}
