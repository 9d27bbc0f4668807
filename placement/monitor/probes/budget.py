"""How often the kernel counters are read, from what the monitor costs on this machine.

What
    ProbeBudget chooses k: the hot threads' counters are read every k-th step (by the monitor
    thread, sampled.py), and each of those k steps gets their per-step mean
    (StepRecord.probe_steps = k). k = 1 while the cost per step (the step hook's on the training
    thread and all of the monitor thread's CPU: the readings and their wake-ups, the records,
    the hand-overs) fits monitor.budget_pct of the step; budget_pct = 0 reads them every step,
    in the hook, whatever it costs.

Why
    A step's time, data wait and comm come from clocks the hook reads anyway; the runqueue wait
    and on-CPU time need system calls, whose cost differs tenfold between machines (bare metal
    against a nested-virtualised VM: benchmarks/monitor_overhead.py prints both). The hook times
    itself from the inside, so its figure misses its call and handle.watch()'s clock reads: k is
    chosen for AIM of the budget, so that all of it together stays inside the budget. Only the
    readings' cost depends on k; when the rest alone is over the budget, k goes to its cap
    (max_every: MAX_EVERY steps, or MAX_PERIOD_S of steps when that is more) and the monitor says
    so once, when JUDGED batches there say so. The cap is in time at short steps: each reading
    wakes the monitor thread, whose wake-up takes the GIL from a training thread that runs
    Python (tens to a hundred us of CPU on a VM, benchmarks/monitor_thread.py), and at a 0.4 ms
    step ten steps would be hundreds of wake-ups a second. When the steps grow, k comes back to
    the cap as soon as it is more than STRETCH times past it: a batch's median step time moves by
    tens of percent on a busy host, and each change of k is an event in the user's log.

    The controller has hysteresis, so that a noisy machine does not make it change its mind
    several times a second (each change is a `monitor` event in the user's log):
    - it judges the median of the last JUDGED batch costs measured at the current k, not one
      batch (a single window of a busy host can cost ten times the others);
    - it goes up as soon as that median is over the aim (the budget is a promise), to the k at
      which the readings' share would fit what the rest of the cost leaves of the aim (the cap
      when the rest alone is over it), and to the cap when the change before went up too and
      did not land; down only to a k whose cost would stay under LOWER_BELOW of the aim, and by
      a quarter at least;
    - after a change it holds for `hold` steps; a change against the previous one (down after
      up, up after down) doubles the hold, up to MAX_HOLD_STEPS; a change the same way keeps it.
    At steady state that is at most one change per MAX_HOLD_STEPS / 2 steps however noisy.

Cost
    A few float operations per hand-over, on the monitor thread.
"""
from __future__ import annotations

import collections
import math
import statistics
from typing import Optional

MAX_EVERY = 10  # the cap at steps of 50 ms or more: a hog of a few steps must still show
# ... and at shorter steps, a reading at least twice a second: at a 10 ms step on a VM a reading
# with its wake-up costs ~130 us (benchmarks/monitor_thread.py), 5 us a step at four a second.
# A window's sums are the same at any k; what k spreads is where within it a hog fell.
MAX_PERIOD_S = 0.5
STRETCH = 2  # k past the cap by more than this factor (the steps grew) comes back to it at once
# ... and k at this share of the cap or more is at it (the steps shrank a little): the cap follows
# the median step, which drifts by a few percent from batch to batch, and each move up to it
# was a `monitor` event every few seconds
NEAR_CAP = 0.75
AIM = 0.6  # share of the budget the hook's own figure is held to (the rest: its call, handle.watch())
LOWER_BELOW = 0.8  # come down only to a k whose cost would stay under this share of the aim
JUDGED = 5  # batch costs (at the current k) whose median is judged
MIN_HOLD_STEPS = 100  # steps after a change before the next, at first
MAX_HOLD_STEPS = 2000  # ... doubled at each reversal, up to this


def max_every(step_ms: float) -> int:
    """The coarsest cadence allowed at this step time."""
    return max(MAX_EVERY, int(MAX_PERIOD_S * 1e3 / step_ms)) if step_ms > 0 else MAX_EVERY


class ProbeBudget:
    __slots__ = ("budget_pct", "every", "hold_steps", "_costs", "_reads", "_changed_at", "_direction")

    def __init__(self, budget_pct: float, every: int = 1):
        self.budget_pct = budget_pct
        self.every = every  # the counters are read every `every` steps
        self.hold_steps = MIN_HOLD_STEPS
        self._costs: collections.deque = collections.deque(maxlen=JUDGED)
        self._reads: collections.deque = collections.deque(maxlen=JUDGED)  # the readings' share of each
        self._changed_at = -MAX_HOLD_STEPS  # the step of the last change
        self._direction = 0  # +1: the last change went up, -1: down

    def update(self, hook_us_per_step: float, step_ms: float, step: int = 0,
               reads_us: Optional[float] = None) -> Optional[int]:
        """Judge one batch ending at `step`: the monitor's mean cost per step, of which
        `reads_us` (when known) is the readings', and the median step time. Returns the new
        `every` when it changes, else None."""
        if self.budget_pct <= 0 or step_ms <= 0 or hook_us_per_step <= 0:
            return None
        self._costs.append(hook_us_per_step)
        if reads_us is not None:
            self._reads.append(min(reads_us, hook_us_per_step))
        k, cap = self.every, max_every(step_ms)
        if k > STRETCH * cap:
            new = cap  # the steps grew longer: back under the cap at once, held or not
        elif step - self._changed_at < self.hold_steps:
            return None
        else:
            cost = statistics.median(self._costs)
            aim_us = AIM * self.budget_pct / 100.0 * step_ms * 1e3
            if cost > aim_us and k < NEAR_CAP * cap:
                if self._direction > 0:
                    # The last change went up and did not land: the cost does not fall as 1/k
                    # (a wake-up costs more the longer the thread slept), so to the cap, and the
                    # down-moves find the k from there.
                    new = cap
                else:
                    # Cost = fixed + reads * k / k': the k' whose readings fit what the rest
                    # leaves of the aim, the cap when the rest alone is over it (records and
                    # hand-overs at sub-ms steps). With the readings' share unknown, all of
                    # the cost is taken for readings: k scales by the overshoot.
                    reads = statistics.median(self._reads) if len(self._reads) == len(self._costs) else cost
                    room = aim_us - (cost - reads)
                    new = cap if room <= 0 else min(cap, max(k + 1, math.ceil(k * reads / room)))
            elif k > 1 and len(self._costs) == JUDGED:
                # Down to the finest k whose cost, if all of it were reads (cost * k / k', an
                # upper bound), stays under LOWER_BELOW of the aim: in one change, not one a hold.
                # A quarter down at least: a cost that falls slower than 1/k would otherwise
                # bring it down a few percent a hold, each an event in the user's log.
                new = max(1, math.floor(cost * k / (LOWER_BELOW * aim_us)) + 1)
                if new > k - max(1, k // 4):
                    return None
            else:
                return None
        direction = 1 if new > k else -1
        if self._direction and direction != self._direction:
            self.hold_steps = min(MAX_HOLD_STEPS, 2 * self.hold_steps)
        self._direction = direction
        self._changed_at = step
        self._costs.clear()  # costs measured at the old k say little of the new one
        self._reads.clear()
        self.every = new
        return new

    def to_cap(self, step_ms: float, step: int) -> Optional[int]:
        """Go to the cap now (CostRate saw the cost over the budget within the last second):
        the new `every`, or None when it is there already."""
        cap = max_every(step_ms)
        if self.budget_pct <= 0 or self.at_cap(step_ms):
            return None
        self._direction, self._changed_at, self.every = 1, step, cap
        self._costs.clear()
        self._reads.clear()
        return cap

    def at_cap(self, step_ms: float) -> bool:
        """Whether the counters are read as seldom as allowed at this step time (NEAR_CAP)."""
        return self.every >= NEAR_CAP * max_every(step_ms)

    def judged_us(self) -> Optional[float]:
        """The median of the batch costs judged at the current k (None before the first)."""
        return statistics.median(self._costs) if self._costs else None

    def over(self, step_ms: float) -> bool:
        """Whether the cost is over the budget although the counters are read as seldom as
        allowed: the median of JUDGED batches at this k, so that one busy window does not say so."""
        return (self.budget_pct > 0 and self.at_cap(step_ms) and len(self._costs) == JUDGED
                and statistics.median(self._costs) > self.budget_pct / 100.0 * step_ms * 1e3)


class CostRate:
    """placement's share of the rank's time, judged every PERIOD_S of wall time whatever the
    steps do: the CPU of its threads and the hook's time per second is its share of every step
    in that second (cost per step x steps per second). The per-batch judgement (ProbeBudget)
    waits for JUDGED batches; at long or hung steps that is many seconds, while a thread of
    ours that spins (timed waits that return at once, as under libfaketime) costs the job every
    second meanwhile. Over the budget in a whole period: `tick` says so, and the monitor takes
    the readings to their cap and warns once, within a second."""

    PERIOD_S = 1.0
    __slots__ = ("budget_pct", "_at", "_cpu_ns", "_last_pct", "_periods")

    def __init__(self, budget_pct: float):
        self.budget_pct = budget_pct
        self._at: Optional[float] = None  # monotonic seconds at the period's start
        self._cpu_ns = 0
        self._last_pct: Optional[float] = None
        self._periods = 0  # periods ended; the first (the threads' start, the first window) is not judged

    def tick(self, now_s: float, cpu_ns: int) -> Optional[float]:
        """`cpu_ns`: placement's CPU so far (its threads' and the hook's). The share of the period
        that just ended when it was over the budget, else None."""
        if self.budget_pct <= 0:
            return None
        if self._at is None:
            self._at, self._cpu_ns = now_s, cpu_ns
            return None
        elapsed = now_s - self._at
        if elapsed < self.PERIOD_S:
            return None
        pct = 100.0 * (cpu_ns - self._cpu_ns) / 1e9 / elapsed
        self._at, self._cpu_ns, self._last_pct = now_s, cpu_ns, pct
        self._periods += 1
        return pct if pct > self.budget_pct and self._periods > 1 else None

    @property
    def last_pct(self) -> Optional[float]:
        """The share of the last whole period (None before one ended)."""
        return self._last_pct


# ---- the paced floor ----------------------------------------------------------------------
FLOOR_JUDGE_S = 2.0  # the least time a period of the paced floor's judgement covers, at first
FLOOR_MAX_HOLD_S = 64.0  # doubled at each reversal, up to this
FLOOR_DOWN_BELOW = 0.4  # half the floor doubles at most what it paces: down only under 0.4 x the budget


class PacedFloor:
    """How many times monitor.handover_min_s the hand-overs (and tune.window_min_s the tuner's
    windows) are apart at least: `scale`, a power of two from 1 up to `most`
    (monitor.handover_max_s over handover_min_s). At short steps what placement spends is
    mostly per hand-over (the builds, the sinks' writes, the tuner's window, a span reading:
    ~1-2 ms of the monitor thread in a DDP job, benchmarks/job_cost.py); with the readings at
    their cap (ProbeBudget), the floor is what is left to the budget. It is judged at
    hand-overs, on a period from one to another of at least `hold_s`: placement's CPU (its
    threads' and the hook's) over the period's wall time, which then holds the whole cost of
    the hand-overs in it (the monitor thread builds a hand-over after it comes). Over the
    budget, the scale doubles; under FLOOR_DOWN_BELOW of it, it halves. A change against the
    one before doubles `hold_s`, up to FLOOR_MAX_HOLD_S. What it delays is said in the
    `monitor` event of each change: the log's records, the live metrics, straggler naming and
    the tuner's moves come up to a floor later."""

    __slots__ = ("budget_pct", "most", "scale", "hold_s", "_period", "_direction")

    def __init__(self, budget_pct: float, most: int):
        self.budget_pct = budget_pct
        self.most = max(1, most)
        self.scale = 1
        self.hold_s = FLOOR_JUDGE_S
        self._period: Optional[tuple[float, int]] = None  # (monotonic s, CPU ns) at its start
        self._direction = 0  # +1: the last change went up, -1: down

    def judge(self, now_s: float, cpu_ns: int, may_rise: bool) -> Optional[tuple[int, float, float]]:
        """At a hand-over (the first of the run starts the first period): `cpu_ns`,
        placement's CPU so far; `may_rise`: the readings are at their cap (the floor rises only
        after them). At the end of a period: (the new scale, placement's share of the period in
        %, its seconds) when the scale changes, else None."""
        if self.budget_pct <= 0 or self.most <= 1:
            return None
        if self._period is None:
            self._period = (now_s, cpu_ns)
            return None
        t0, c0 = self._period
        elapsed = now_s - t0
        if elapsed < self.hold_s:
            return None
        self._period = (now_s, cpu_ns)
        pct = 100.0 * max(0, cpu_ns - c0) / 1e9 / elapsed
        if pct > self.budget_pct and may_rise and self.scale < self.most:
            new = self.scale * 2
        elif pct < FLOOR_DOWN_BELOW * self.budget_pct and self.scale > 1:
            new = self.scale // 2
        else:
            return None
        direction = 1 if new > self.scale else -1
        if self._direction and direction != self._direction:
            self.hold_s = min(FLOOR_MAX_HOLD_S, 2 * self.hold_s)
        self._direction = direction
        self.scale = new
        return new, pct, elapsed


def floor_scales(min_s: float, max_s: float) -> int:
    """The most a paced floor of `min_s` may be scaled (a power of two) and stay within `max_s`."""
    if min_s <= 0 or max_s <= min_s:
        return 1
    k = 1
    while 2 * k * min_s <= max_s + 1e-9:
        k *= 2
    return k
