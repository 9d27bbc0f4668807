"""What every comm time source shares: the per-step figure (CommStep), the interface the monitor
reads (CommTiming), the clock that counts and times collective calls, and the wrappers that feed
it. The sources themselves: placement.monitor.comm.timing (wall time, off, the DDP hook, the choice of
source) and placement.monitor.comm.nccl (PyTorch's own NCCL records).

comm_enter_t, the wall time this rank entered its first collective of the step, is what
tells a late rank from the ranks that waited for it (placement.monitor.stragglers.figures).

The callbacks that time a collective's end (an async call's future, the DDP hook's, NCCL's
completion hook) run on the thread that completed it, a thread Python has never seen (gloo's run
loop, pt_nccl_runhook), inside pybind11's gil_scoped_acquire (torch/csrc/jit/python/
pybind_utils.h:174 PythonFutureWrapper::then, :203 add_done_callback; torch/csrc/distributed/
c10d/PyProcessGroup.hpp:366 PythonOnCompletionHook::operator() for NCCL's completion hook).
With no thread state on that thread, it makes one and deletes it again when the callback
returns (pybind11/gil.h:83 and :117, its count back at 0); so does the release of the callback's
function, and torch's decref of the tensors the work held (~AsyncWork): several a collective,
each under the interpreter's thread-list lock, which a fork must not find held (bind/fork.py).
Each callback keeps its thread's state instead (ThreadStates): one PyGILState_Ensure, never
released, leaves the count above 0, so every later acquire on that thread reuses it
(tests/monitor/comm/test_monitor_comm.py: 64 made over 30 DDP steps of two buckets before, none
after).
"""
from __future__ import annotations

import ctypes
import inspect
import math
import threading
import time
from typing import Callable, NamedTuple, Optional

from placement.monitor.clock import wall as wall_clock
from placement.monitor.warn import WarnOnce

# torch.distributed functions wrapped while a monitor is attached.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all", "all_to_all_single",
               "barrier", "gather", "scatter", "all_gather_object", "broadcast_object_list")


class CommStep(NamedTuple):
    """A step's collectives: one is made per step with a collective, on the monitor thread (a
    named tuple: half a frozen dataclass's making, which checks every field through
    object.__setattr__)."""

    comm_ms: Optional[float]  # None: resolved later (NCCL timings arrive after the step)
    count: int
    enter_t: Optional[float]  # time.time() of the first collective entered in the step


NO_COMM = CommStep(0.0, 0, None)  # a step without collectives (shared: most steps of a gloo-less loop)
# A step in which the clock saw no collective, of a job whose collectives run unseen by it (DDP's
# bucket all-reduces without a comm hook, timing.ddp_bucket_route): its figures are the source's
# (CommTiming.resolve_steps): the flight recorder's on NCCL, null where none has them.
UNSEEN = CommStep(None, 0, None)


_tuple_new = tuple.__new__  # a named tuple made without its Python-level __new__ (half the time)


def comm_step(raw) -> CommStep:
    """The CommStep of a CollectiveClock.take_raw() tuple; NO_COMM or UNSEEN as it is."""
    if raw.__class__ is CommStep:
        return raw
    intervals, count, enter_t = raw
    return _tuple_new(CommStep, (None if intervals is None else union_ms(intervals), count, enter_t))


def union_ms(intervals: list[tuple[int, int]]) -> float:
    """Length of the union of [start, end) ns intervals, in ms (overlapping buckets count once)."""
    if not intervals:
        return 0.0
    if len(intervals) == 1:  # one bucket, one call: most steps of a small model
        s, e = intervals[0]
        return (e - s) / 1e6
    total = 0
    cur_s, cur_e = None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    total += cur_e - cur_s
    return total / 1e6


class ThreadStates:
    """The threads whose Python thread state a completion callback has kept (module doc): each
    gets one PyGILState_Ensure, never released, the first time a callback runs on it. On
    a Python thread (main, when the future was done before `then`) that is a count its thread
    state's deletion does not read; a thread that exits leaves its state to the interpreter's
    end (a fork's child deletes it with every other thread's): nothing is ever deleted here, so
    no state another thread could still use is freed. Past MAX threads, kept over the process's
    life (a job that makes and ends process groups over and over), callbacks make and delete
    states as before. Without ctypes' pythonapi (not CPython) it keeps nothing."""

    # Threads kept at most over the process's life: a few per process group (gloo's run loops,
    # NCCL's watchdog). Each kept state is a thread in faulthandler's dump, which stops at 100
    # threads newest first, and the hang report reads main's (the oldest) from it
    # (monitor/health/hang.py).
    MAX = 32

    def __init__(self):
        self._kept: set[int] = set()
        try:
            self._ensure = ctypes.pythonapi.PyGILState_Ensure
        except (AttributeError, OSError):
            self._ensure = None

    def keep(self) -> None:
        """Keep the calling thread's state (the callback holds the GIL; a set's add is atomic under it)."""
        ident = threading.get_ident()
        if ident in self._kept or self._ensure is None or len(self._kept) >= self.MAX:
            return
        self._kept.add(ident)
        self._ensure()


THREAD_STATES = ThreadStates()


class CollectiveClock:
    """Counts collectives and their entry times; with `timed`, also their wall intervals.

    enter() is called on the thread issuing the collective, done() possibly on a backend
    thread (future callbacks), hence the lock.
    """

    def __init__(self, timed: bool):
        self.timed = timed
        self._lock = threading.Lock()
        self._intervals: list[tuple[int, int]] = []
        self._count = 0
        self.entered = 0  # collectives entered in all (the NCCL hook route compares it with those reported)
        self._enter_t: Optional[float] = None
        # Collectives entered and not done (timed clocks only: an untimed call returns at enqueue).
        # What a stall report says of a hung rank: a rank outside any collective is the one the
        # ranks waiting inside one wait for.
        self._open = 0
        # Set when its monitor closed: a DDP hook cannot be removed and may still call in
        # (until a re-attach points it at the new clock); nothing is kept then.
        self.closed = False

    def enter(self) -> int:
        with self._lock:
            self._count += 1
            self.entered += 1
            self._open += 1
            if self._enter_t is None:
                self._enter_t = wall_clock()
        return time.perf_counter_ns()

    def done(self, t0: int) -> None:
        if self.timed:
            t1 = time.perf_counter_ns()
            with self._lock:
                if self._open > 0:  # a DDP hook re-pointed by a re-attach may finish on the new clock
                    self._open -= 1
                if not self.closed:
                    self._intervals.append((t0, t1))

    def in_collective(self) -> Optional[bool]:
        """Whether a collective call of this rank is in progress (read from any thread); None
        when calls return at enqueue (NCCL: the CPU cannot tell)."""
        return self._open > 0 if self.timed else None

    def take_raw(self) -> tuple[Optional[list[tuple[int, int]]], int, Optional[float]]:
        """This step's collectives as the step hook keeps them, (intervals, None when untimed;
        count; first entry's wall time): the union of the intervals is taken on the monitor
        thread (comm_step), not right after the step, where every line runs cold. The hook
        calls this only when a collective ran (_count or _intervals): a step without is NO_COMM."""
        with self._lock:
            intervals, self._intervals = self._intervals, []
            count, self._count = self._count, 0
            enter_t, self._enter_t = self._enter_t, None
        return (intervals if self.timed else None, count, enter_t)


class CommTiming:
    """Base: entry times and counts from the wrappers and the DDP hook; subclasses say how
    durations are measured. A source whose durations arrive after the step (NCCL) says through
    which wall time they are settled (settled_through); the monitor builds steps up to there,
    and a step still unsettled settle_max_s after it ended is built with comm time null."""

    name = "off"
    timed_calls = True  # whether call wall time is the comm time (blocking backends)
    settle_max_s = 0.0
    null_why: Optional[str] = None  # why the last in_collective() was None, when the source can say
    # A step in which the clock saw no collective: NO_COMM, or UNSEEN where collectives run
    # unseen (DDP's buckets without a comm hook, timing.ddp_bucket_route).
    no_collective: CommStep = NO_COMM
    # Whether the source itself holds every collective of this rank, counts and entry times
    # included, so that DDP's buckets need no comm hook (the NCCL flight recorder).
    sees_all = False

    def __init__(self, warn: WarnOnce):
        self.warn = warn
        self.clock = CollectiveClock(self.timed_calls)
        self._wrappers: Optional[CollectiveWrappers] = None

    def install(self, original: "OriginalCollectives") -> None:
        self._wrappers = CollectiveWrappers(self.clock, original)
        self._wrappers.install()

    def in_collective(self) -> Optional[bool]:
        """Whether a collective call of this rank is in progress (see CollectiveClock.in_collective;
        NCCL's flight-recorder timing answers from the recorder)."""
        return self.clock.in_collective()

    def poll_if_due(self, final: bool = False) -> None:
        """Look for late durations when due (`final`: now, at exit). Monitor thread."""

    def settled_through(self) -> float:
        """Wall time through which every step's comm figures are final (inf: at its end)."""
        return math.inf

    def poll_interval_s(self) -> float:
        """How soon settled_through() may move on (for a monitor holding steps)."""
        return math.inf

    def resolve_steps(self, spans: list[tuple[float, float]], seen: list[CommStep]) -> list[CommStep]:
        """The figures of steps built with comm_ms None (durations that arrive late, collectives
        the clock does not see), given their (start, end) wall times and what the clock saw. A
        source with no late records adds nothing: comm_ms stays null."""
        return list(seen)

    def close(self) -> None:
        self.clock.closed = True
        if self._wrappers is not None:
            self._wrappers.uninstall()
            self._wrappers = None


class OriginalCollectives:
    """The torch.distributed functions as they were before any wrapping: the monitor's own
    side-group exchange and the DDP hook call these, so they are never counted twice."""

    def __init__(self):
        import torch.distributed as dist

        self.funcs: dict[str, Callable] = {}
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self.funcs[name] = getattr(fn, "__placement_wrapped__", fn)

    def __getattr__(self, name: str) -> Callable:
        try:
            return self.funcs[name]
        except KeyError:
            raise AttributeError(name) from None


def _async_index(fn: Callable) -> Optional[int]:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("async_op") if "async_op" in params else None


class CollectiveWrappers:
    """Replaces torch.distributed.<collective> by a timed wrapper; restored at uninstall."""

    def __init__(self, clock: CollectiveClock, original: OriginalCollectives):
        self.clock = clock
        self.original = original
        self._installed: dict[str, Callable] = {}

    def _wrap(self, name: str, fn: Callable) -> Callable:
        clock = self.clock
        async_at = _async_index(fn)

        def timed_collective(*args, **kwargs):
            t0 = clock.enter()
            try:
                work = fn(*args, **kwargs)
            except BaseException:
                clock.done(t0)
                raise
            is_async = kwargs.get("async_op", False) if async_at is None or len(args) <= async_at else args[async_at]
            if is_async and work is not None and clock.timed:
                try:
                    work.get_future().add_done_callback(lambda _f: (THREAD_STATES.keep(), clock.done(t0)))
                except Exception:  # a backend without futures: count the launch only
                    clock.done(t0)
            else:
                clock.done(t0)
            return work

        timed_collective.__name__ = name
        timed_collective.__doc__ = fn.__doc__
        timed_collective.__wrapped__ = fn
        timed_collective.__placement_wrapped__ = fn
        return timed_collective

    def install(self) -> None:
        import torch.distributed as dist

        for name, fn in self.original.funcs.items():
            wrapper = self._wrap(name, fn)
            setattr(dist, name, wrapper)
            self._installed[name] = wrapper

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, wrapper in self._installed.items():
            if getattr(dist, name, None) is wrapper:  # someone re-patched it: leave theirs
                setattr(dist, name, self.original.funcs[name])
        self._installed.clear()
