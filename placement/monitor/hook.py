"""The step hook: the training thread's side of the monitor.

What
    on_step() ends a step: a perf_counter stamp, the step's data wait (added to `data_ns` by the
    watched iterator, watch.py) and comm counters, kept as a tuple (RawStep's fields, build.py);
    no system call. At the next due step (a span reading, a flush, an exchange or the end of
    an observer's window) the steps are handed over to the monitor thread: one call of
    `hand_over`, a deque append and a wake-up there. At short steps the monitor thread sets
    `stride`: a hand-over every `stride` flushes only (monitor.handover_min_s apart at least).
    An observer's windows (the tuner's) then come with those hand-overs, several at once, but
    a window whose steps ran WINDOW_SLOWER slower than the recent ones (SlowerWindows: a
    co-runner, batches too heavy for the DataLoader, a move that hurt) is handed over as it
    ends, so that what the tuner answers is answered one window after it began.

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

import collections
import queue
from time import perf_counter_ns
from typing import Callable, Optional

from placement.monitor.warn import WarnOnce, first_line
from placement.pacing import doubling

NEVER = 1 << 62  # a due step that never comes
# The most flush_every strides one hand-over may hold (a power of two; see StepHook.pace).
MAX_STRIDE = 32
# At paced hand-overs, an observer's window whose mean step ran this much slower than the
# median of the RECENT_WINDOWS windows before it is handed over as it ends (SlowerWindows).
WINDOW_SLOWER = 0.10
RECENT_WINDOWS = 4


class HandOver:
    """What the training thread hands to the monitor thread at a due step."""

    __slots__ = ("last_step", "raw", "span", "hook_ns", "hook_steps")

    def __init__(self, last_step: int, raw: list[tuple], span: bool, hook_ns: int, hook_steps: int):
        self.last_step = last_step  # the step number of raw[-1]
        self.raw = raw  # RawStep's fields, one tuple per step
        self.span = span  # a span reading is due at last_step
        self.hook_ns = hook_ns  # time spent in the hook so far
        self.hook_steps = hook_steps  # steps the hook timed so far


class ReadAt(int):
    """A wake-up of the monitor thread for a reading of the counters alone, put on this step:
    an observer's window ended and its steps wait for the next paced hand-over, but its
    counters are read at its end, so that each window keeps figures of its own (a reading
    costs tens of microseconds, a hand-over's processing a millisecond)."""

    __slots__ = ()


class HandOvers:
    """What the training thread has handed over and the monitor thread not yet taken: HandOver
    items in order (deque appends and pops are atomic; only the holder of the monitor's lock
    pops) and a wake-up for each."""

    __slots__ = ("_items", "_wake")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._wake: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item: HandOver) -> int:
        """Hand `item` over and wake the monitor thread; the hand-overs now waiting."""
        self._items.append(item)
        self._wake.put(item.last_step)
        return len(self._items)

    def wait(self, timeout: float) -> tuple[bool, Optional[int]]:
        """(woken, the waking hand-over's last step: None when woken to end, a ReadAt when
        woken for a reading alone) within `timeout`."""
        try:
            return True, self._wake.get(timeout=timeout)
        except queue.Empty:
            return False, None

    def ask_read(self, step: int) -> None:
        """Wake the monitor thread for a reading put on `step` (ReadAt), nothing handed over."""
        self._wake.put(ReadAt(step))

    def wake_to_end(self) -> None:
        self._wake.put(None)

    def pop(self) -> Optional[HandOver]:
        try:
            return self._items.popleft()
        except IndexError:
            return None

    def oldest_step(self) -> Optional[int]:
        """The last step of the oldest hand-over waiting (None: none)."""
        try:
            return self._items[0].last_step
        except IndexError:  # emptied meanwhile by the training thread (the monitor's MAX_BACKLOG)
            return None

    def newest_step(self) -> Optional[int]:
        try:
            return self._items[-1].last_step
        except IndexError:
            return None

    def __len__(self) -> int:
        return len(self._items)


class SlowerWindows:
    """The mean step time of an observer's recent windows, from the hook's own stamps (nothing
    read): whether the window that just ended ran WINDOW_SLOWER slower than their median. A
    window of a job that a co-runner, heavy batches or a move that hurt slows down is; a quiet
    window is not, and waits for the next paced hand-over (the tuner judges it then)."""

    __slots__ = ("_end_ns", "_end_step", "_recent")

    def __init__(self) -> None:
        self._end_ns: Optional[int] = None  # the stamp of the last window's last step
        self._end_step = 0
        self._recent: collections.deque = collections.deque(maxlen=RECENT_WINDOWS)  # ms per step

    def ended(self, step: int, end_ns: int) -> bool:
        """A window ended with `step` (its end stamp `end_ns`): True when it ran slower."""
        slower = False
        if self._end_ns is not None and step > self._end_step:
            ms = (end_ns - self._end_ns) / 1e6 / (step - self._end_step)
            recent = self._recent
            if len(recent) >= 2:
                ordered = sorted(recent)
                slower = ms > (1.0 + WINDOW_SLOWER) * ordered[len(ordered) // 2]
            recent.append(ms)
        self._end_ns, self._end_step = end_ns, step
        return slower


def next_multiple(step: int, every: int) -> int:
    """The first multiple of `every` after `step`."""
    return (step // every + 1) * every


class StepHook:
    """The steps the training thread has ended and not handed over, and when the next is due.
    `hand_over(item)`: the monitor's, called at a due step; `next_exchange(step)`: the next
    exchange step after `step` (NEVER without an exchange); `read_counters`: the sampler's
    (main, hot) reading, at every step when the budget is 0, else None; `gate`: the exit
    paths' (exitflush.FlushGate: a flush deferred to the step's end runs there); `ask_read(step)`:
    a reading of the counters put on `step`, at the end of a window that waits for the next
    paced hand-over (None: the hook reads them itself)."""

    def __init__(self, comm, step: int, cfg, hand_over: Callable[[HandOver], None],
                 next_exchange: Callable[[int], int], read_counters: Optional[Callable[[], tuple]],
                 gate, warn: WarnOnce, ask_read: Optional[Callable[[int], None]] = None):
        self.step = step  # steps ended (the last step's number)
        self.data_ns = 0  # data wait of the current step, added to by the watched iterator (watch.py)
        self.last_batch = None  # the last batch the watched iterator handed out (the residence watch reads it)
        self.self_ns = 0  # time spent inside the hook (over steps_timed steps)
        self.stride = 1  # flush_every strides per hand-over, set by the monitor thread (pace())
        self.stopped = False  # set as the monitor closes: no step is taken any more
        self._zero = step
        self._raw: list[tuple] = []
        # The comm clock, read here directly: two attribute reads on a step without a collective,
        # where the call it replaced cost ~2 us cold (benchmarks/hook_profile.py).
        self._clock, self._no_comm = comm.clock, comm.no_collective
        self._every = (cfg.flush_every, cfg.rescan_every)
        self._pace_by = (cfg.handover_min_s, cfg.exchange_every)
        self._due = [step + cfg.rescan_every, 0]  # the next span step; the next step with work for the monitor thread
        self._due[1] = min(self._due[0], next_multiple(step, cfg.flush_every), next_multiple(step, cfg.exchange_every))
        self._calls = (hand_over, next_exchange, read_counters, gate, warn)
        self._window_ends: list[Callable[[int], Optional[int]]] = []
        self._handed = step  # the last step of the last hand-over
        self._slower = SlowerWindows()
        self._ask_read = ask_read

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

    def flushes_at(self, step: int) -> bool:
        """`step` is a flush step (every monitor.flush_every)."""
        return step % self._every[0] == 0

    def pace(self, step_ms: Optional[float], exchange_windows: Optional[int], scale: int = 1) -> None:
        """Set the hand-overs' stride: the fewest flush_every strides (a power of two, so that
        ranks whose step times differ a little still meet at the larger one's exchange steps)
        that last monitor.handover_min_s x `scale` (the paced floor the budget sets,
        probes/budget.py PacedFloor) at this step time, at most MAX_STRIDE and, with an
        exchange, `exchange_windows` exchange windows. A hand-over's fixed cost (a wake-up, the
        span reading, the builds, the sinks' writes, the flush, the tuner's window judgement,
        the exchanges' round trips: ~1.5 ms on the monitor thread in a DDP job of 10 ms steps,
        benchmarks/job_cost.py) is then paid a few times a second whatever the step time. An
        observer's window that ran slower is still handed over as it ends (SlowerWindows)."""
        if step_ms is None or step_ms <= 0:
            return
        flush_every = self._every[0]
        floor_s, exchange_every = self._pace_by
        cap = MAX_STRIDE
        if exchange_windows is not None:
            cap = min(cap, max(1, exchange_windows * exchange_every // flush_every))
        self.stride = doubling(flush_every, step_ms, floor_s * scale, cap)

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
        hand_over, _, read_counters, gate, warn = self._calls
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
                self._hand_over(step, hand_over, t0)
        except Exception as e:
            warn("on_step", f"monitor step failed ({type(e).__name__}: {first_line(e)}); continuing")
        finally:
            gate.in_step = False
            self.self_ns += perf_counter_ns() - h0
            if gate.deferred:
                gate.flush_if_due()

    def _hand_over(self, step: int, hand_over: Callable[[HandOver], None], end_ns: int) -> None:
        due = self._due
        flush_every, rescan_every = self._every
        if self._window_ends and self.window_due(step - 1) == step:  # an observer's window ends here
            slower = self._slower.ended(step, end_ns)
            # the next paced hand-over, at the stride as it is now (the monitor thread sets it)
            paced = next_multiple(self._handed, flush_every * self.stride)
            if self.stride > 1 and step < paced and not slower:
                due[1] = min(paced, self.window_due(step))  # it comes with the paced hand-over
                if self._ask_read is not None:
                    self._ask_read(step)  # its counters read at its end all the same
                return
        raw, self._raw = self._raw, []
        self._handed = step
        span = step >= due[0]
        if span:
            due[0] = step + rescan_every
        item = HandOver(step, raw, span, self.self_ns, self.step - self._zero)
        if self.stride > 1:  # short steps: spans and exchanges come with the next flush, windows too unless slower
            paced = next_multiple(step, flush_every * self.stride)
            due[1] = min(paced, self.window_due(step)) if self._window_ends else paced
        else:
            due[1] = min(due[0], next_multiple(step, flush_every), self._calls[1](step),
                         self.window_due(step) if self._window_ends else NEVER)
        hand_over(item)
