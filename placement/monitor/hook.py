"""The step hook: the training thread's side of the monitor.

What
    on_step() ends a step: a perf_counter stamp, the step's data wait (added to `data_ns` by the
    watched iterator, watch.py) and comm counters, kept as a tuple (RawStep's fields, build.py);
    no system call. At the next due step (a span reading, a flush, an exchange or the end of
    an observer's window) the steps are handed over to the monitor thread: one call of
    `hand_over`, a deque append and a wake-up there. At short steps with no observer judging
    windows the monitor thread sets `stride`: a hand-over every `stride` flushes only.

Cost
    Right after a training step every code path runs cold (caches and TLB hold the step's
    data): each call, property or object built here costs microseconds (benchmarks/
    hook_profile.py), so the state is one flag, a step is a tuple, and the kernel counters
    are read by the monitor thread (probes/sampled.py), here only when the budget is 0 (exact
    at every step).

Threads
    Only the training thread calls on_step. The monitor thread reads `step` and sets
    `stride`; an exit path takes the steps not handed over (take_raw) under the monitor's lock.
"""
from __future__ import annotations

from time import perf_counter_ns
from typing import Callable, Optional

from placement.monitor.warn import WarnOnce, first_line

NEVER = 1 << 62  # a due step that never comes


class HandOver:
    """What the training thread hands to the monitor thread at a due step."""

    __slots__ = ("last_step", "raw", "span", "hook_ns", "hook_steps")

    def __init__(self, last_step: int, raw: list[tuple], span: bool, hook_ns: int, hook_steps: int):
        self.last_step = last_step  # the step number of raw[-1]
        self.raw = raw  # RawStep's fields, one tuple per step
        self.span = span  # a span reading is due at last_step
        self.hook_ns = hook_ns  # time spent in the hook so far
        self.hook_steps = hook_steps  # steps the hook timed so far


def next_multiple(step: int, every: int) -> int:
    """The first multiple of `every` after `step`."""
    return (step // every + 1) * every


class StepHook:
    """The steps the training thread has ended and not handed over, and when the next is due.
    `hand_over(item)`: the monitor's, called at a due step; `next_exchange(step)`: the next
    exchange step after `step` (NEVER without an exchange); `read_counters`: the sampler's
    (main, hot) reading, at every step when the budget is 0, else None; `gate`: the exit
    paths' (exitflush.FlushGate), `deferred()` runs a flush one deferred to the step's end."""

    def __init__(self, comm, step: int, cfg, hand_over: Callable[[HandOver], None],
                 next_exchange: Callable[[int], int], read_counters: Optional[Callable[[], tuple]],
                 gate, deferred: Callable[[], None], warn: WarnOnce):
        self.step = step  # steps ended (the last step's number)
        self.data_ns = 0  # data wait of the current step, added to by the watched iterator (watch.py)
        self.last_batch = None  # the last batch the watched iterator handed out (the residence watch reads it)
        self.self_ns = 0  # time spent inside the hook (over steps_timed steps)
        self.stride = 1  # flush_every strides per hand-over, set by the monitor thread (its _pace)
        self.stopped = False  # set as the monitor closes: no step is taken any more
        self._zero = step
        self._raw: list[tuple] = []
        # The comm clock, read here directly: two attribute reads on a step without a collective,
        # where the call it replaced cost ~2 us cold (benchmarks/hook_profile.py).
        self._clock, self._no_comm = comm.clock, comm.no_collective
        self._every = (cfg.flush_every, cfg.rescan_every)
        self._due = [step + cfg.rescan_every, 0]  # the next span step; the next step with work for the monitor thread
        self._due[1] = min(self._due[0], next_multiple(step, cfg.flush_every), next_multiple(step, cfg.exchange_every))
        self._calls = (hand_over, next_exchange, read_counters, gate, deferred, warn)
        self._window_ends: list[Callable[[int], Optional[int]]] = []

    @property
    def steps_timed(self) -> int:
        """Steps the hook took (and timed itself over, in self_ns)."""
        return self.step - self._zero

    @property
    def next_due(self) -> int:
        return self._due[1]

    def add_window_end(self, window_end: Callable[[int], Optional[int]]) -> None:
        """An observer judges whole windows: `window_end(step)` is the last step of its first
        window ending after `step` (None: none wanted); a hand-over is due there."""
        self._window_ends.append(window_end)
        self._due[1] = min(self._due[1], self.window_due(self.step))

    def window_due(self, step: int) -> int:
        """The next step after `step` that ends an observer's window: a hand-over there (a
        step whose counters are read then, where records can be cut) builds the window as soon
        as its comm figures are settled, and the monitor thread builds it on its own when they
        settle later. Windows are predicted on the observer's current grid; one it moves (a
        tuner action re-starts it) is caught at the next hand-over."""
        due = NEVER
        for window_end in self._window_ends:
            end = window_end(step)
            if end is not None:
                due = min(due, end)
        return due

    def window_ends_by(self, first: int, step: int) -> bool:
        """An observer's window that starts after `first` - 1 ends by `step`."""
        for window_end in self._window_ends:
            end = window_end(first - 1)
            if end is not None and end <= step:
                return True
        return False

    @property
    def windowed(self) -> bool:
        return bool(self._window_ends)

    def take_raw(self) -> list[tuple]:
        """The steps not handed over (an exit path, under the monitor's lock)."""
        raw, self._raw = self._raw, []
        return raw

    def on_step(self, _optimizer=None, _args=None, _kwargs=None, at: Optional[int] = None) -> None:
        """Mark the end of one training step, now, or at perf_counter_ns `at` (the automatic
        monitor ends a step at the start of a fetch it has just seen return). Never raises.
        Registered as the optimizer's post-step hook itself: one frame, its own cost counted
        from its first line."""
        h0 = perf_counter_ns()
        t0 = h0 if at is None else at
        if self.stopped:
            return
        hand_over, _, read_counters, gate, deferred, warn = self._calls
        gate.in_step = True
        try:
            clock = self._clock
            comm = clock.take_raw() if clock._count or clock._intervals else self._no_comm
            if read_counters is None:
                self._raw.append((t0, self.data_ns, comm))
            else:
                self._raw.append((t0, self.data_ns, comm, *read_counters()))
            self.data_ns = 0
            step = self.step = self.step + 1
            if step >= self._due[1]:
                self._hand_over(step, hand_over)
        except Exception as e:
            warn("on_step", f"monitor step failed ({type(e).__name__}: {first_line(e)}); continuing")
        finally:
            gate.in_step = False
            self.self_ns += perf_counter_ns() - h0
            if gate.deferred and gate.due():
                deferred()

    def _hand_over(self, step: int, hand_over: Callable[[HandOver], None]) -> None:
        raw, self._raw = self._raw, []
        flush_every, rescan_every = self._every
        due = self._due
        span = step >= due[0]
        if span:
            due[0] = step + rescan_every
        item = HandOver(step, raw, span, self.self_ns, self.step - self._zero)
        if self.stride > 1:  # short steps: spans, exchanges and windows come with the next flush
            due[1] = next_multiple(step, flush_every * self.stride)
        else:
            due[1] = min(due[0], next_multiple(step, flush_every), self._calls[1](step),
                         self.window_due(step) if self._window_ends else NEVER)
        hand_over(item)
