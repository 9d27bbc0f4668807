"""The hot threads' kernel counters read from the monitor thread, each reading tagged with the
last step that had ended when it was taken.

What
    SampledReads.take() reads `main`'s CPU clock and schedstat and the every-step roles'
    (threads.EVERY_STEP_ROLES) schedstat from whichever thread calls it, and keeps the reading
    with the step number the training thread had last written. attach() puts each reading on
    the raw step it is tagged with, where the step hook used to put it on a probe step: the
    records are then built as before (threads.RoleSampler.samples spreads a reading's deltas
    over the steps since the reading before), so the figures of the steps between two readings
    still add up to the kernel's totals.

Why
    A system call right after a training step, on the training thread, runs with cold caches:
    on a VM it costs tens of microseconds (benchmarks/hook_profile.py: a probe step 42 us against
    9 us for a step without one), more than the rest of the hook. From the monitor thread the
    same reads cost the training thread nothing but the GIL for a few microseconds.

How exact
    A reading tagged with step s is taken after step s ended, most often within step s+1: up
    to one step's runqueue wait or CPU lands one reading early. The reading a hand-over wakes
    the monitor thread for is put on the hand-over's last step even when the training thread has
    gone past it (a main thread that holds the GIL lets the monitor thread run only every 5 ms):
    the steps in between then land one reading early too. Per-step means over the
    probe_steps a reading covers stay exact over any run of readings (they telescope). For
    figures exact at each boundary, monitor.budget_pct = 0 makes the step hook read them itself
    every step (step_monitor.py).

Cost
    On the monitor thread: one clock read and one pread per hot thread, every `every` steps'
    worth of time (the budget's cadence, probes/budget.py); its CPU, and that of the wake-up a
    reading of its own took (about as much on a VM: benchmarks/monitor_thread.py), is counted in
    `cost_ns` and judged with the hook's by that budget.
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Optional

from placement.monitor.probes.threads import RoleSampler

# Readings are at most this often (seconds): one wake-up of the monitor thread costs tens of
# microseconds of CPU, on a core the job may want; at 1 ms steps that is every other step.
MIN_PERIOD_S = 0.002
FIRST_PERIOD_S = 0.01  # before any step time is known


class SampledReads:
    """Readings of the hot threads' counters, each tagged with a step; see the module docstring."""

    __slots__ = ("_sampler", "_step_of", "_readings", "_last_tag", "cost_ns", "period_s", "_next_at")

    def __init__(self, sampler: RoleSampler, step_of: Callable[[], int]):
        self._sampler = sampler
        self._step_of = step_of  # the last step the training thread ended (an int read: atomic)
        self._readings: collections.deque = collections.deque()  # (step, MainRead, hot reads)
        self._last_tag = step_of()
        self.cost_ns = 0  # CPU spent taking readings, on whichever thread took them
        self.period_s = FIRST_PERIOD_S
        self._next_at = time.monotonic() + FIRST_PERIOD_S

    def pace(self, every: int, step_ms: float) -> None:
        """Read every `every` steps of `step_ms`, never more often than MIN_PERIOD_S."""
        self.period_s = max(MIN_PERIOD_S, every * step_ms / 1e3)

    def wait_s(self) -> float:
        """Seconds until the next reading is due."""
        return max(0.0, self._next_at - time.monotonic())

    def due(self) -> bool:
        """The period since the last reading has passed."""
        return time.monotonic() >= self._next_at

    def postpone(self) -> None:
        """No reading now: the next one is due a period from now (or at a take() before that)."""
        self._next_at = time.monotonic() + self.period_s

    def take(self, at_most: Optional[int] = None, woke_ns: int = 0) -> None:
        """Read now, unless no step ended since the last reading. `at_most`: a hand-over's last
        step, which the reading is put on even when the training thread has gone past it (so
        that the hand-over's steps can be built now, not at the next one: flushes and exchanges
        keep their steps). `woke_ns`: CPU the caller spent waking up for this reading, counted
        in its cost."""
        self._next_at = time.monotonic() + self.period_s
        tag = self._step_of()  # read before the counters: the reading is later than this step's end
        if at_most is not None and tag > at_most:
            tag = at_most
        if tag <= self._last_tag:
            return
        c0 = time.thread_time_ns() - woke_ns
        sampler = self._sampler
        main = sampler.main.step_read()
        hot = sampler.read_hot() if sampler.has_hot else ()
        self._readings.append((tag, main, hot))
        self._last_tag = tag
        self.cost_ns += time.thread_time_ns() - c0

    def attach(self, pending: list, first_step: int) -> None:
        """Put each reading on its step among `pending` (raw steps; pending[0] is `first_step`).
        A reading of a step already built is dropped (a later one, taken on the way out,
        covers it); one of a step not handed over yet waits."""
        readings = self._readings
        last = first_step + len(pending) - 1
        while readings and readings[0][0] <= last:
            tag, main, hot = readings.popleft()
            i = tag - first_step
            if i >= 0 and pending[i].main is None:
                pending[i].main, pending[i].hot = main, hot
