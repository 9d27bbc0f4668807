"""The per-rank step monitor: the step hook on the training thread, and the monitor thread
that turns its raw readings into records and delivers them.

What
    on_step(), training thread: a perf_counter stamp, the step's data wait and comm
    counters, and an append; no system call. At the next due step (a span reading, a flush or
    an exchange) the raw steps are handed over: a deque append and one wake-up. At short steps
    with no observer judging windows, only every `stride` flushes: at least
    monitor.handover_min_s of steps per hand-over (_pace).
    The monitor thread (`placement_mon`, role `other`, so never on a hot core): every few steps
    (the budget's cadence) and at each hand-over, the hot threads' kernel counters (main's
    thread clock and schedstat, one pread per backward/nccl/pin_memory thread), each reading
    tagged with the last step ended (probes/sampled.py), a reading due within half the budget's
    steps of a hand-over left to it (one wake-up for both); every monitor.rescan_every steps the
    span reading of every thread and a refresh of the thread list (while no observer judges
    windows, at least SPAN_FLOORS hand-over floors apart); every monitor.flush_every
    steps records are built, judged (records/verdict.py), handed to the observers (the tuner),
    encoded and written in one batch (sinks/); as soon as a window of an observer that judges
    whole windows (add_observer's window_end) is complete with its
    comm figures settled, its records are built and handed over too. Steps are built only once
    their comm figures are settled (comm.settled_through: NCCL durations arrive after the step)
    or have waited comm.settle_max_s. At each exchange step (windows of monitor.exchange_every
    steps, at short steps every 2^k-th only: crossrank/schedule.py ExchangeGrid) this rank's
    window figures go to rank 0 through the job's c10d store (crossrank/), for the same
    absolute steps on every rank; and, between hand-overs, the hang watch (health/hang.py): a
    rank that completes no step for max(monitor.stall_factor x its median step,
    monitor.stall_min_s) gets a `stall` event naming where its main thread is.
    Data crosses from the training thread as dataclasses (RawStep, HandOver, and the counters in
    them: probes.counters.MainRead, probes.threads.HotRead) addressed by step and ThreadRole.

Cost
    The hook and every thread of placement's (roles.OWN_THREADS: this monitor thread, the
    binder's watcher, the peer watch, the posts) together may take monitor.budget_pct of the
    step (0.3% is 30 us of a 10 ms step; benchmarks/job_cost.py measures it in a real job): the
    counters are read every step unless that costs more (probes/budget.py), judged per batch and,
    by CostRate, per second. budget_pct = 0 reads them in the
    hook itself, at every step, exact at each step boundary whatever it costs. Nothing here
    synchronises a GPU. No figure is guessed: what a probe cannot read is None.

Threads
    The monitor thread's work runs under `_lock`; the exit paths (close, SIGTERM, an exception in
    training code, interpreter exit) take it and finish that work on their own thread, so every
    measured step is written whichever thread gets there (docs/design.md, threads and locks).
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import enum
import math
import queue
import statistics
import threading
import time
from time import perf_counter_ns
from typing import Callable, Optional

from placement.config import PlacementConfig
from placement.events import EventKind
from placement.monitor import exitflush
from placement.monitor.clock import wall as wall_clock
from placement.monitor.probes.cost import CostKeeper
from placement.monitor.comm.base import CommStep, CommTiming, comm_step
from placement.monitor.crossrank.exchange import Exchange
from placement.monitor.crossrank.schedule import ExchangeGrid
from placement.monitor.stragglers.event import WindowJudgement, straggler_event, straggler_lines
from placement.records.step import StepRecord
from placement.monitor.health.residence import ResidenceWatch
from placement.monitor.health.hang import HangWatch
from placement.monitor.health.peers import PeerWatch, write_peer_hang
from placement.monitor.sinks.base import (DigestSink, ExchangeWindow, JsonlSink, ObserverSink, RecordSink, SummarySink,
                                     TensorBoardSink, close_sinks, write_to_sinks)
from placement.records.parts import comm_wait_ms, split_step
from placement.monitor.probes.counters import MainRead
from placement.monitor.probes.sampled import SampledReads
from placement.monitor.probes.threads import MAIN, HotRead, RoleSampler, merge_span
from placement.records.verdict import step_verdict
from placement.monitor.warn import WarnOnce, first_line, log
from placement.roles import OWN_THREADS

# Batches waiting for the monitor thread beyond which the training thread builds them
# itself: a main thread that never releases the GIL (pure Python, no I/O, no GPU waits)
# lets the monitor thread run only one switch interval (5 ms) per system call it makes.
MAX_BACKLOG = 4
MAX_EXCHANGES_DUE = 64  # exchanges waiting for their steps to be built (see _send_due_exchanges)
# The most flush_every strides one hand-over may hold (a power of two; see _pace): it also
# holds at most MAX_EXCHANGES_DUE / 2 exchange windows.
MAX_STRIDE = 32
# While no observer judges windows, span readings (every thread read in full, the thread list
# rescanned) are at least this many monitor.handover_min_s apart (2 s at the defaults), whatever
# rescan_every says: at short steps each costs hundreds of us on the monitor thread
# (benchmarks/monitor_thread.py), and their figures (faults, switches, MHz, DataLoader and
# `other`) are per-step means over the span anyway.
SPAN_FLOORS = 4
# How long an exit path waits for the monitor thread to finish what it is doing (it can
# be waiting up to Exchange.WAIT_S for a late peer's exchange) before writing anyway.
EXIT_WAIT_S = 15.0
# How long rank 0's close waits in all for the rows of the last windows (its peers close too).
EXCHANGE_CLOSE_S = 2.0
NEVER = 1 << 62  # a due step that never comes
HELD_RETRY_MIN_S = 0.05  # the monitor thread's shortest wait while steps are held for comm figures



class MonitorState(enum.Enum):
    """The monitor's life, as torch's elastic agent has WorkerState."""

    CREATED = "created"  # built; its thread not started yet
    RUNNING = "running"  # its thread runs; the hook takes steps
    STOPPING = "stopping"  # close() began: no step is taken any more, the thread is asked to end
    CLOSED = "closed"  # every record written, the end event out


_STOPPING, _CLOSED = MonitorState.STOPPING, MonitorState.CLOSED  # compared by identity in the step hook


@dataclasses.dataclass(slots=True)
class RawStep:
    """One step as the hook measured it (its number is its place in the hand-over)."""

    end_ns: int  # perf_counter_ns at the end of the step
    data_ns: int  # time blocked waiting for data
    comm: CommStep  # (the hook keeps the clock's take_raw() tuple; _raw_steps makes it this)
    main: Optional[MainRead] = None  # main's counters; None on the steps between readings
    hot: Optional[tuple[HotRead, ...]] = None  # the backward/nccl/pin_memory threads' counters (same steps)
    span: Optional[dict] = None  # every thread's span reading, set by the monitor thread


@dataclasses.dataclass(slots=True)
class HandOver:
    """What the training thread hands to the monitor thread at a due step."""

    last_step: int  # the step number of raw[-1]
    raw: list[tuple]  # RawStep's fields, one tuple per step
    span: bool  # a span reading is due at last_step
    hook_ns: int  # time spent in the hook so far
    hook_steps: int  # steps the hook timed so far


class StepMonitor:
    def __init__(self, cfg: PlacementConfig, events, *, rank: int, local_rank: int, world_size: int,
                 sampler: RoleSampler, comm: CommTiming, warn: WarnOnce,
                 exchange: Optional[Exchange] = None, planned_nodes: tuple[int, ...] = (), first_step: int = 1):
        self.cfg = cfg.monitor
        self._tune = cfg.tune
        self.events = events
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.sampler = sampler
        self.comm = comm
        # The step hook reads the comm clock itself: two attribute reads on a step without a
        # collective, where the call it replaced cost ~2 us cold (benchmarks/hook_profile.py).
        self._clock = comm.clock
        self._no_comm = comm.no_collective
        self.warn = warn
        self.exchange = exchange
        # Of the observers that judge whole windows of steps: step -> the last step of their
        # first window that ends after it (None: none wanted). See add_observer.
        self._window_ends: list[Callable[[int], Optional[int]]] = []
        self.state = MonitorState.CREATED

        # -- training thread ------------------------------------------------------------
        # The first step this monitor records: 1, or the step after those of the monitor it
        # replaces (placerun's automatic one, when the program calls attach() mid-run).
        self.step = first_step - 1
        self.data_ns = 0  # data wait of the current step, added to by handle.watch() (watch.py)
        self.last_batch = None  # the last batch handle.watch() handed out (the residence watch reads it)
        self._raw: list[tuple] = []  # steps measured since the last hand-over (RawStep's fields)
        # flush_every strides per hand-over, a power of two the monitor thread sets from the step
        # time (_pace): 1 hands over at every due step (flush, span, exchange, an observer's window).
        self.stride = 1
        self._span_due = self.step + self.cfg.rescan_every
        # The next step with work for the monitor thread: one comparison per step.
        self._next_due = min(self._span_due, _next_multiple(self.step, self.cfg.flush_every),
                             _next_multiple(self.step, self.cfg.exchange_every))
        self.self_ns = 0  # time spent inside the hook on the training thread (steps_timed: how many)
        self._step_zero = self.step
        self._gate = exitflush.FlushGate()  # an exit path's flush, now or at the step's end

        # -- hand-over --------------------------------------------------------------------
        # HandOver items; deque appends and pops are atomic, and only the holder of _lock pops.
        self._handed: collections.deque = collections.deque()
        self._wake: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self.thread_cpu_ns: Optional[int] = None  # the monitor thread's CPU, set as it ends

        # -- monitor thread (or whoever holds _lock) --------------------------------------
        self._pending: list[RawStep] = []  # raw steps handed over, not yet built into records
        self._pending_first_step = first_step  # step number of _pending[0]
        # Step boundaries are perf_counter_ns stamps; their wall time is derived when records
        # are built, from an anchor pair re-taken then (one clock read per step, not two).
        self._anchor = (time.perf_counter_ns(), wall_clock())
        self._t_last = self._anchor[0]
        self._wall_last = self._anchor[1]
        self._last_span_step = self.step
        self._span_ns = -math.inf  # the end (perf_counter_ns) of the last step with a span reading
        # Where the hot threads' counters are read: by the monitor thread, each reading tagged with
        # a step (probes/sampled.py), or with budget_pct = 0 (None here) by the hook itself at every step.
        self._sampled = SampledReads(sampler, lambda: self.step) if self.cfg.budget_pct > 0 else None
        # what placement costs the rank, and the budget that k is chosen by (probes/cost.py)
        self.cost = CostKeeper(self.cfg.budget_pct, events, warn, self._sampled)
        # which steps are exchange steps, and those this rank has not sent yet (crossrank/schedule.py)
        self.grid = ExchangeGrid(self.cfg.exchange_every, self.cfg.exchange_min_s, exchange, rank, self.step)
        # Where built records go, in this order (sinks/).
        self._observers = ObserverSink(warn)
        # rank 0: called with every window judged (WindowJudgement), on the monitor thread
        self.judgement_observers: list[Callable[[WindowJudgement], None]] = []
        self._exchange_window = ExchangeWindow(rank, lambda: self.exchange is not None and self.exchange.enabled)
        self.sinks: list[RecordSink] = [JsonlSink(events), self._observers, self._exchange_window,
                                        SummarySink(rank, self.cfg.summary_every),
                                        DigestSink(events, rank, self.cfg.digest_every)]
        if self.cfg.tensorboard:
            self.sinks.append(TensorBoardSink(self.cfg.log_dir, rank, warn))
        self.hang = HangWatch(self.cfg.stall_factor, self.cfg.stall_min_s, self.cfg.stall_pause_s)
        self._peers: Optional[PeerWatch] = None  # rank 0: its peers' liveness (health/peers.py)
        # where the rank's pages are against `planned_nodes` (health/residence.py)
        self.residence: Optional[ResidenceWatch] = None
        if planned_nodes and self.cfg.residence_every_s > 0:
            self.residence = ResidenceWatch(tuple(planned_nodes), self.cfg.residence_every_s,
                                            self.cfg.residence_min_pct, events, rank, lambda: self.last_batch)

    def start(self) -> None:
        """Step 1 begins now: called as attach() returns, so that its own set-up (comm hooks,
        the tuner, the first events) is neither step time nor the first step's CPU."""
        self.sampler.rebase()
        self._anchor = (time.perf_counter_ns(), wall_clock())
        self.cost.start(self.self_ns, self.steps_timed, self._anchor[0])
        self._t_last, self._wall_last = self._anchor
        self.hang.progress(self.step, self._anchor[0])
        self._start_thread()  # the stall watch runs from step 1 on
        if self.exchange is not None and self.rank == 0 and self._peers is None:
            self._peers = PeerWatch(self.exchange, self.hang.threshold_s,
                                    lambda fields: write_peer_hang(self.events, fields), self.hang.poll_s,
                                    own=lambda: self.hang.post).start()

    def add_observer(self, observe: Callable[[StepRecord], None],
                     window_end: Optional[Callable[[int], Optional[int]]] = None) -> None:
        """Call observe(record) for every step record, in step order. With `window_end` (step
        -> the last step of the observer's first window ending after that step, or None), the
        records of each such window are handed over as soon as its steps' comm timing is
        final, not only at flush steps. Called on the training thread."""
        self._observers.observers.append(observe)
        if window_end is not None:
            self._window_ends.append(window_end)
            self._next_due = min(self._next_due, self._window_due(self.step))

    @property
    def budget(self):
        """How often the hot threads' counters are read (probes/budget.py ProbeBudget: `every`)."""
        return self.cost.budget

    @property
    def steps_timed(self) -> int:
        """Steps the hook took (and timed itself over, in self_ns)."""
        return self.step - self._step_zero

    @property
    def closed(self) -> bool:
        return self.state in (MonitorState.STOPPING, MonitorState.CLOSED)

    def _start_thread(self) -> None:
        if self._thread is None and self.state is MonitorState.CREATED:
            self.state = MonitorState.RUNNING
            self._thread = OWN_THREADS.start(self._run, "placement_mon")

    # ---- fed by the training loop --------------------------------------------------------
    def on_step(self, _optimizer=None, _args=None, _kwargs=None, at: Optional[int] = None) -> None:
        """Mark the end of one training step, now, or at perf_counter_ns `at` (the automatic
        monitor ends a step at the start of a fetch it has just seen return). Never raises.
        Registered as the optimizer's post-step hook itself: one frame, its own cost counted
        from its first line."""
        h0 = perf_counter_ns()
        t0 = h0 if at is None else at
        # Right after a training step every code path runs cold (caches and TLB hold the step's
        # data): each call, property or object built here costs microseconds (benchmarks/
        # hook_profile.py), so the state is compared by identity, a step is a tuple (RawStep's
        # fields, made a RawStep on the monitor thread), and the kernel counters are read by the
        # monitor thread (probes/sampled.py), here only when the budget is 0 (exact at every step).
        state = self.state
        if state is _STOPPING or state is _CLOSED:
            return
        gate = self._gate
        gate.in_step = True
        try:
            clock = self._clock
            comm = clock.take_raw() if clock._count or clock._intervals else self._no_comm
            if self._sampled is None:
                sampler = self.sampler
                self._raw.append((t0, self.data_ns, comm, sampler.main.step_read(),
                                  sampler.read_hot() if sampler.has_hot else ()))
            else:
                self._raw.append((t0, self.data_ns, comm))
            self.data_ns = 0
            step = self.step = self.step + 1
            if step >= self._next_due:
                self._hand_over(step)
        except Exception as e:
            self.warn("on_step", f"monitor step failed ({type(e).__name__}: {first_line(e)}); continuing")
        finally:
            gate.in_step = False
            self.self_ns += perf_counter_ns() - h0
            if gate.deferred and gate.due():
                self.emergency_flush("deferred")
                exitflush.resume_deferred()

    def _hand_over(self, step: int) -> None:
        cfg = self.cfg
        raw, self._raw = self._raw, []
        span = step >= self._span_due
        if span:
            self._span_due = step + cfg.rescan_every
        self._handed.append(HandOver(step, raw, span, self.self_ns, self.steps_timed))
        exchange = self.exchange
        if self.stride > 1:  # short steps: spans, exchanges and windows come with the next flush
            self._next_due = _next_multiple(step, cfg.flush_every * self.stride)
        else:
            self._next_due = min(self._span_due, _next_multiple(step, cfg.flush_every),
                                 self.grid.next_after(step) if exchange is not None and exchange.enabled else NEVER,
                                 self._window_due(step) if self._window_ends else NEVER)
        self._start_thread()
        self._wake.put(step)
        if len(self._handed) > MAX_BACKLOG:
            with self._holding():
                if self._sampled is not None:  # the monitor thread is starved of the GIL: read here
                    self._sampled.take(at_most=step)
                self._drain(exchange=True)

    def _window_due(self, step: int) -> int:
        """The next step after `step` that ends an observer's window: a hand-over there (a
        step whose counters are read then, where records can be cut) builds the window as soon as its comm figures
        are settled, and the monitor thread builds it on its own when they settle later.
        Windows are predicted on the observer's current grid; one it moves (a tuner action
        re-starts it) is caught at the next hand-over."""
        due = NEVER
        for window_end in self._window_ends:
            end = window_end(step)
            if end is not None:
                due = min(due, end)
        return due

    def _window_complete(self, step: int) -> bool:
        """An observer's window ends among the pending steps (up to `step`)."""
        first = self._pending_first_step
        for window_end in self._window_ends:
            end = window_end(first - 1)
            if end is not None and end <= step:
                return True
        return False

    # ---- the monitor thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self.thread_cpu_ns = time.thread_time_ns()  # its whole life: the end event's figure

    def _loop(self) -> None:
        sampled = self._sampled
        # A comm source read by polling (NCCL's flight recorder) is polled on its own cadence,
        # hand-over or not (a ring of thousands of collectives per step wraps long before a
        # flush step), and steps held for their comm figures are built as soon as they settle
        # (a 500 ms step's next flush is 10 s away): the watch, at most hang.poll_s apart.
        # Between watches the thread wakes only to read the counters.
        watched = time.monotonic()  # the last watch
        while True:
            next_watch = watched + min(self.hang.poll_s, max(HELD_RETRY_MIN_S, self.comm.poll_interval_s()))
            wait_s = max(0.0, next_watch - time.monotonic())
            if sampled is not None:
                read_in = sampled.wait_s()
                if not self._read_at_hand_over(read_in):
                    wait_s = min(wait_s, read_in)
            c0 = time.thread_time_ns()
            try:
                handed = self._wake.get(timeout=wait_s)  # a hand-over's last step (None: close)
                woken = True
            except queue.Empty:
                handed, woken = None, False
            if self.state is not MonitorState.RUNNING:
                return
            if sampled is not None:  # at a hand-over at once: its last step is then read near its end
                try:
                    if woken:
                        sampled.take(at_most=handed)
                    elif sampled.due():
                        # Woken to read. A hand-over due within half a reading's steps reads then:
                        # one wake-up for both (a wake-up costs about what a reading does).
                        if self._read_at_hand_over(0.0):
                            sampled.postpone()
                        else:
                            # The reading's cost, which the budget judges while a tuner judges
                            # windows, includes the wake-up it took (benchmarks/monitor_thread.py:
                            # tens of us on a VM). It is put no later than a hand-over waiting
                            # here, whose steps are then built at it (a reading past it would
                            # leave them to the next one).
                            handed_over = self._handed
                            try:
                                waiting = handed_over[0].last_step if handed_over else None
                            except IndexError:  # emptied meanwhile by the training thread (MAX_BACKLOG)
                                waiting = None
                            sampled.take(at_most=waiting, woke_ns=time.thread_time_ns() - c0)
                except Exception as e:
                    self.warn(f"probe:{type(e).__name__}", f"counter reading failed ({type(e).__name__}: "
                                                           f"{first_line(e)}); the figures it misses are spread over the next")
                if not woken and time.monotonic() < next_watch:
                    continue  # woken only to read
            watched = time.monotonic()
            self._watch_hang()
            self._watch_residence()
            self.cost.tick(time.monotonic(), self.self_ns, self.step)
            if woken:
                with self._holding():
                    self._drain(exchange=True)
            elif self._pending or self.comm.poll_interval_s() != math.inf:  # steps held for their comm figures
                with self._holding():
                    self._build_held()

    def _read_at_hand_over(self, read_in_s: float) -> bool:
        """Whether the reading due in `read_in_s` would come within half a reading's steps of
        the next hand-over, which takes one anyway: the thread then wakes once for both (a
        wake-up costs about what a reading does). Steps are counted at the readings' pace."""
        every = self.budget.every
        step_s = self._sampled.period_s / every
        return 2 * (self._next_due - self.step - read_in_s / step_s) <= every

    def _build_held(self) -> None:
        """Between hand-overs (the caller holds _lock): build the steps that were waiting for
        their comm figures, and send the exchanges that waited for them."""
        try:
            self._finalize(final=False)
            ex = self.exchange
            if ex is not None and ex.enabled and self.grid.due:
                self._send_due_exchanges()
        except Exception as e:
            self._batch_failed(e)

    def _watch_hang(self) -> None:
        """Between hand-overs: has the training thread completed a step lately? (Read without
        _lock: a hung main thread may hold it.)"""
        try:
            now = perf_counter_ns()
            hung = self.hang.check(self.step, now)
            post = None
            if hung is not None:
                # in a collective or not: what tells the hung rank from the peers it holds (none alone)
                inside = self.comm.in_collective() if self.world_size > 1 else None
                # outside any collective with peers to judge it: hung, or a job-wide pause (health/peers.py)
                hold = inside is False and self.exchange is not None and self.exchange.enabled
                post = self.hang.report(hung, self.events, self.rank, inside,
                                        self.comm.null_why if inside is None else None, hold=hold)
            elif self.hang.write_held(self.events, self.rank, now):
                pass
            elif self.hang.resumed is not None:
                post = self.hang.report_resumed(self.events, self.rank)
            if post is not None and self.exchange is not None:
                self.exchange.post_hang(post)  # rank 0 names it in its log too
        except Exception as e:
            self.warn(f"stall:{type(e).__name__}", f"stall watch failed ({type(e).__name__}: {first_line(e)})")

    def _watch_residence(self) -> None:
        """Between hand-overs, at its own low rate: where the rank's pages are."""
        if self.residence is None:
            return
        try:
            self.residence.tick()
        except Exception as e:
            self.warn(f"residence:{type(e).__name__}", f"residence watch failed ({type(e).__name__}: {first_line(e)})")

    @contextlib.contextmanager
    def _holding(self, timeout: float = -1):
        """Hold _lock (yields False when it was not had within `timeout`). A SIGTERM that lands
        while the main thread holds it is deferred to the release, as one mid-step is."""
        if not self._lock.acquire(timeout=timeout):
            yield False
            return
        self._gate.holder = threading.get_ident()
        try:
            yield True
        finally:
            self._gate.holder = None
            self._lock.release()
            if self._gate.due():
                self.emergency_flush("deferred")
                exitflush.resume_deferred()

    def _drain(self, exchange: bool) -> None:
        """Work through what was handed over (the caller holds _lock). `exchange`: take part
        in due cross-rank exchanges (not on the way out: peers may be gone)."""
        while self._handed:
            item = self._handed.popleft()
            try:
                self._process(item, exchange=exchange)
            except Exception as e:  # the monitor never breaks training, nor stops for one bad batch
                self._batch_failed(e)

    def _batch_failed(self, e: Exception) -> None:
        self.warn(f"batch:{type(e).__name__}", f"monitor batch failed ({type(e).__name__}: {first_line(e)}); continuing")

    def _process(self, item: HandOver, exchange: bool) -> None:
        cfg = self.cfg
        step, raw = item.last_step, _raw_steps(item.raw)
        windowed = bool(self._window_ends) and self._window_due(self.grid.handed) != NEVER
        if item.span and (windowed or raw[-1].end_ns - self._span_ns >= SPAN_FLOORS * cfg.handover_min_s * 1e9):
            raw[-1].span = self.sampler.read_span(step - self._last_span_step)
            self._last_span_step, self._span_ns = step, raw[-1].end_ns
            self.sampler.refresh()
        self._pending.extend(raw)
        step_ms = statistics.median((b.end_ns - a.end_ns) / 1e6 for a, b in zip(raw, raw[1:])) if len(raw) >= 4 else None
        self.cost.judge_batch(step_ms, item.hook_ns, item.hook_steps, item.last_step)
        self._pace(step_ms, windowed)
        ex = self.exchange if exchange else None
        # every exchange step this hand-over holds (several when it holds several strides)
        exchange_now = self.grid.hand(step, step_ms) and ex is not None
        flush_now = exchange_now or step % cfg.flush_every == 0
        if flush_now or (self._window_ends and self._window_complete(step)):
            self._finalize(final=False)
        if flush_now:
            self.events.flush()
        sent = ex is not None and bool(self.grid.due) and self._send_due_exchanges()
        if not sent and ex is not None and ex.pending:
            self._publish(ex.collect())

    def _pace(self, step_ms: Optional[float], windowed: bool) -> None:
        """The hand-overs' stride: the fewest flush_every strides (a power of two, so that ranks
        whose step times differ a little still meet at the larger one's exchange steps) that
        last monitor.handover_min_s at this step time. A hand-over's fixed cost (a wake-up, the
        span reading of every thread, the flush's write, the exchanges' round trips) is then
        paid a few times a second whatever the step time (benchmarks/monitor_thread.py).
        While an observer judges windows (`windowed`), 1."""
        floor_s = self.cfg.handover_min_s
        if step_ms is None or step_ms <= 0:
            return
        if windowed:
            # An observer judges whole windows (the tuner): each is handed over as it ends, as
            # its moves are judged, and its rules answer, in steps (benchmarks/contention.py).
            self.stride = 1
            return
        cap = MAX_STRIDE
        if self.exchange is not None and self.exchange.enabled:
            cap = min(cap, max(1, MAX_EXCHANGES_DUE // 2 * self.cfg.exchange_every // self.cfg.flush_every))
        stride = 1
        while stride * 2 <= cap and stride * self.cfg.flush_every * step_ms < floor_s * 1e3:
            stride *= 2
        self.stride = stride

    # ---- records ----------------------------------------------------------------------
    def _finalize(self, final: bool) -> None:
        """Build, write and deliver the records of the pending steps whose comm figures are
        settled (comm.settled_through: NCCL durations arrive after the step, when the source
        has seen them), or that waited comm.settle_max_s for them (their comm time is then
        null, and counted); with `final` (exit), every step. The cut is made at a step with a
        reading of the counters (a probe step) so that every step built has its counters."""
        comm = self.comm
        comm.poll_if_due(final)
        raw = self._pending
        if not raw:
            return
        if self._sampled is not None:
            self._sampled.attach(raw, self._pending_first_step)
        cut = len(raw)
        if not final:
            through = max(comm.settled_through(), wall_clock() - comm.settle_max_s)
            if through != math.inf:
                anchor_ns, anchor_wall = self._anchor
                through_ns = anchor_ns + int((through - anchor_wall) * 1e9)
                cut = bisect.bisect_right([r.end_ns for r in raw], through_ns)
            while cut > 0 and raw[cut - 1].main is None:
                cut -= 1
        if cut <= 0:
            return
        ready, self._pending = raw[:cut], raw[cut:]
        first_step = self._pending_first_step
        self._pending_first_step += cut
        # Wall times of the step ends, from the perf_counter stamps and the anchor (re-taken
        # here so that a drift between the two clocks cannot build up).
        anchor_ns, anchor_wall = self._anchor
        ends = [anchor_wall + (r.end_ns - anchor_ns) / 1e9 for r in ready]
        starts = [self._wall_last] + ends[:-1]
        pending = [i for i, r in enumerate(ready) if r.comm.comm_ms is None]
        late_comm = dict(zip(pending, self.comm.resolve_steps([(starts[i], ends[i]) for i in pending],
                                                              [ready[i].comm for i in pending]))) if pending else {}
        roles_of, probe_steps = self._role_samples(ready)
        tune = self._tune
        runq_pct, comm_pct, data_pct, run = tune.runq_wait_pct, tune.comm_share_pct, tune.data_share_pct, self.events.run
        rank, local_rank = self.rank, self.local_rank
        # Written out for the monitor thread, which builds every step's record (its cost per
        # record: benchmarks/monitor_thread.py): the steps of one reading share their roles,
        # and main's runqueue wait (the CPU stall) is looked up once for them.
        batch = []
        append = batch.append
        t_last, shared, runq = self._t_last, None, None
        # Calls that block (gloo) leave main off-CPU while it waits: its schedstat tells the
        # wait from the time in flight (records/parts.py). NCCL's return at enqueue: the
        # GPU-side time is all there is.
        comms = [late_comm.get(i, r.comm) for i, r in enumerate(ready)] if late_comm else [r.comm for r in ready]
        waits = self._comm_waits(ready, comms, roles_of, probe_steps) if self.comm.timed_calls else None
        for i, r in enumerate(ready):
            comm = comms[i]
            end_ns = r.end_ns
            step_ms, data_ms, t_last = (end_ns - t_last) / 1e6, r.data_ns / 1e6, end_ns
            roles = roles_of[i]
            if r.span is not None:  # its own copy: the other steps of its reading share theirs
                roles = {name: dataclasses.replace(s) for name, s in roles.items()}
                merge_span(roles, r.span)
            if roles is not shared:
                shared, main = roles, roles.get(MAIN)
                runq = None if main is None else main.runq_ms
            inflight = comm.comm_ms
            c = inflight if waits is None else waits[i]
            # split once here and kept on the record: the digest, summary and metrics read them too
            parts = split_step(step_ms, data_ms, c, runq)
            append(StepRecord(rank, first_step + i, ends[i], step_ms, data_ms, c, comm.count, roles,
                              step_verdict(step_ms, data_ms, c, parts.cpu_stall_ms, runq_pct, comm_pct, data_pct),
                              local_rank, comm.enter_t, probe_steps[i], run, inflight, parts))
        self._t_last, self._wall_last = t_last, ends[-1]
        self._anchor = (time.perf_counter_ns(), wall_clock())
        self.hang.step_times(rec.step_ms for rec in batch)
        write_to_sinks(self.sinks, batch, self.warn)

    def _comm_waits(self, ready: list[RawStep], comms: list[CommStep], roles_of: list[dict],
                    probe_steps: list[int]) -> list[Optional[float]]:
        """Each step's comm wait where calls block (gloo): main is off-CPU while it waits, and its
        schedstat tells the wait from the time in flight, a reading of its counters at a time
        (records/parts.py comm_wait_ms; the steps of one reading are the probe_steps before its
        probe step). NCCL's calls return at enqueue: there the GPU-side time is all there is."""
        waits: list[Optional[float]] = []
        t_last, i = self._t_last, 0
        ends = [r.end_ns for r in ready]
        while i < len(ready):
            n = max(1, probe_steps[i])
            main = roles_of[i].get(MAIN) if probe_steps[i] else None
            step_ms = [(e - s) / 1e6 for s, e in zip([t_last] + ends[i:i + n - 1], ends[i:i + n])]
            waits.extend(comm_wait_ms(step_ms, [r.data_ns / 1e6 for r in ready[i:i + n]],
                                      [c.comm_ms for c in comms[i:i + n]],
                                      None if main is None else main.cpu_ms, None if main is None else main.runq_ms))
            t_last, i = ends[i + n - 1], i + n
        return waits

    def _role_samples(self, ready: list[RawStep]) -> tuple[list[dict], list[int]]:
        """Per-step role samples: a probe step's counter deltas are spread evenly over it and
        the steps since the probe step before it, which share its samples (records are not
        changed once built; a step with a span reading, which need not be a probe step, gets
        its own copy in _finalize). Steps after the last probe step, only at exit, have none."""
        roles_of: list[dict] = []
        probe_steps: list[int] = []
        run = 0  # steps waiting for the next probe step
        for r in ready:
            run += 1
            if r.main is None:
                continue
            roles_of.extend([self.sampler.samples(r.main, r.hot, run)] * run)
            probe_steps.extend([run] * run)
            run = 0
        for _ in range(run):
            roles_of.append(self.sampler.unread())
            probe_steps.append(0)
        return roles_of, probe_steps

    # ---- cross-rank ------------------------------------------------------------------
    def _send_due_exchanges(self) -> bool:
        """Send the due exchanges whose steps are all built, oldest first (True: one was sent).
        An exchange waits for its steps: with NCCL durations read from the flight recorder, a
        build without a poll (FrCadence spaces them out to keep the GIL budget) builds no step,
        and sending then would send an empty window; the next build with a poll, at most
        comm/nccl.py MAX_POLL_S later, builds them. Rank 0 keys exchanges by their
        last step, so a late row is still judged with its peers' (it waits Exchange.WAIT_S).
        More than MAX_EXCHANGES_DUE waiting (steps never built): the oldest goes as it is."""
        built = self._pending_first_step - 1
        grid = self.grid
        sent = False
        while grid.due:
            step = grid.due[0]
            if grid.windows(step)[-1][1] > built and len(grid.due) <= MAX_EXCHANGES_DUE:
                break
            grid.settle(step)  # (it may drop `step`: a window the grid leaves out)
            if grid.due and grid.due[0] == step:
                grid.due.popleft()
                self._submit_exchange(step)
                sent = True
        return sent

    def _submit_exchange(self, step: int, wait_s: Optional[float] = None) -> None:
        """Send the figures of the same absolute steps as every other rank (built here whatever
        this rank's probe cadence), a row per window the exchange carries; later steps wait for
        the next exchange."""
        figs = [self._exchange_window.take(first, last) for first, last in self.grid.windows(step)]
        self.grid.sent = step
        self._publish(self.exchange.submit(figs, wait_s=wait_s))

    def _exchange_the_rest(self) -> None:
        """At close, every record built: the windows not exchanged yet (an exchange step whose
        hand-over the exit path drained, then the steps after the last exchange window, which
        end at this rank's last step), so that the last steps are judged too. Rank 0 waits
        for their rows at most EXCHANGE_CLOSE_S in all."""
        ex, grid = self.exchange, self.grid
        if ex is None or not ex.enabled or self.step == 0:
            return
        deadline = time.monotonic() + EXCHANGE_CLOSE_S
        grid.due.clear()
        for step in grid.between(grid.sent + 1, self.step):
            self._submit_exchange(step, wait_s=max(0.0, deadline - time.monotonic()))
        done = grid.windows(grid.sent)[-1][1] if grid.sent else 0  # the last step sent
        if done < self.step:
            # windows like the others (exchange_every steps, the first cut at `done`), counted
            # back from this rank's last step, as decode_rows reads an exchange's windows
            ends = range(self.step, done, -grid.every)
            figs = [self._exchange_window.take(max(done + 1, last - grid.every + 1), last) for last in reversed(ends)]
            self._publish(ex.submit(figs, wait_s=max(0.0, deadline - time.monotonic()), at_exit=True))
        self._publish(ex.close(timeout_s=max(0.0, deadline - time.monotonic())))

    def _publish(self, verdicts: list[WindowJudgement]) -> None:
        """Rank 0: every judged window to the judgement observers (the live metrics: who is named
        and who no longer is); one `straggler` event, and its log lines, per window that names
        someone (or starts a job-wide slowdown)."""
        for verdict in verdicts:
            self._publish_one(verdict)

    def _publish_one(self, verdict: WindowJudgement) -> None:
        for observe in self.judgement_observers:
            try:
                observe(verdict)
            except Exception as e:
                self.warn(f"judged:{type(e).__name__}", f"a judged window's observer failed ({first_line(e)})")
        if not (verdict.report.stragglers or verdict.report.job_wide):
            return
        fields = straggler_event(verdict)
        self.events.event(EventKind.STRAGGLER, **fields)
        for line in straggler_lines(verdict.report, fields["steps"], verdict.hosts):
            log.warning("%s", line)

    # ---- ends --------------------------------------------------------------------------
    def _write_everything(self, exchange: bool) -> bool:
        """Every measured step into records now, on this thread. False when the monitor
        thread did not let go within EXIT_WAIT_S (it then writes what it holds itself)."""
        with self._holding(EXIT_WAIT_S) as held:
            if not held:
                self.warn("exit-wait", f"the monitor thread was busy for {EXIT_WAIT_S:.0f} s at exit; "
                                       "steps it had not built are not written")
                return False
            if self._sampled is not None and self._handed:
                # A hand-over the monitor thread had not read for (close() stopped it first):
                # read for its last step, as the thread would have, so that its batch is cut
                # there and not at the reading before (a flush of steps 11-14, then 15 alone).
                self._sampled.take(at_most=self._handed[-1].last_step)
            self._drain(exchange=exchange)
            pending = self._pending
            pending.extend(_raw_steps(self._raw))
            self._raw = []
            if self._sampled is not None:
                self._sampled.attach(pending, self._pending_first_step)
            if pending and pending[-1].main is None:
                # Steps since the last reading: read the counters now, so that they have their
                # figures (the reading includes the moments since the last step ended).
                sampler = self.sampler
                pending[-1].main, pending[-1].hot = sampler.main.step_read(), sampler.read_hot()
            self._finalize(final=True)
            return True

    def _resume_at_close(self) -> None:
        """A hang that ended after the monitor thread's last watch (the steps after it can
        take less than one watch poll) is reported resumed now, and its post is in the store
        before this rank's last exchange rows: rank 0's last look, after those rows, reads it."""
        if self.hang.hung is None:
            return
        self.hang.check(self.step, perf_counter_ns())  # a hang reported: only notes a resume
        if self.hang.resumed is None:
            return
        post = self.hang.report_resumed(self.events, self.rank)
        if self.exchange is not None:
            self.exchange.post_hang(post, wait_s=EXCHANGE_CLOSE_S)

    def emergency_flush(self, reason: str) -> bool:
        """Write every measured step now (exit, SIGTERM, exception). False when mid-step:
        then it happens at the end of that step."""
        if self._gate.defer(self.events.held_here()):
            return False  # interrupted mid-step, mid-batch or mid-write of the event log
        if self.closed:
            return True
        try:
            self._write_everything(exchange=False)
        finally:
            self.events.flush()
        return True

    def close(self) -> None:
        if self.closed:
            return
        c0 = time.thread_time_ns()  # close's own work on this thread is placement's cost too
        self.state = MonitorState.STOPPING
        thread = self._thread
        if thread is not None:
            self._wake.put(None)
            thread.join(timeout=EXIT_WAIT_S)
        idle = thread is None or not thread.is_alive()
        if idle:
            self._resume_at_close()
        self._write_everything(exchange=False)
        exitflush.unregister(self)
        if self.exchange is not None and idle:
            try:
                self._exchange_the_rest()
            except Exception as e:  # the last windows unjudged, but the end event is still written
                self._batch_failed(e)
        if self._peers is not None:
            self._peers.close(wait_s=EXCHANGE_CLOSE_S)
        self.comm.close()
        self.sampler.close()
        close_sinks(self.sinks, self.warn)
        per_step = self.self_ns / 1e3 / self.steps_timed if self.steps_timed else None
        judged = {} if self.exchange is None or self.rank != 0 else \
            {"straggler_candidates_held_back": self.exchange.naming.held_back,  # naming.py: not costly, or not yet confirmed
             "exchange_rows_dropped": self.exchange.rows_dropped}
        if self.exchange is not None:
            judged.update(self.grid.figures())
        self.events.event(EventKind.END, source="monitor", steps=self.step,
                          monitor_us_per_step=None if per_step is None else round(per_step, 2),
                          **self._thread_cost(thread),
                          **self.cost.whole(self.steps_timed, self.self_ns, time.thread_time_ns() - c0, self._t_last),
                          probe_every=self.budget.every, **judged)
        self.events.flush()
        self.state = MonitorState.CLOSED

    def _thread_cost(self, thread: Optional[threading.Thread]) -> dict:
        """The end event's `monitor_thread_us_per_step`: the monitor thread's CPU over its life
        per step monitored (what a Python-bound step pays for it through the GIL, beside the
        hook's own figure), or null and `monitor_thread_null` saying why."""
        steps = self.steps_timed
        why = ("the monitor thread never started" if thread is None else
               f"the monitor thread was still busy at close (after {EXIT_WAIT_S:.0f} s)" if self.thread_cpu_ns is None
               else "no step was monitored" if steps <= 0 else None)
        if why is not None:
            return {"monitor_thread_us_per_step": None, "monitor_thread_null": why}
        return {"monitor_thread_us_per_step": round(self.thread_cpu_ns / 1e3 / steps, 2)}


def _raw_steps(kept: list[tuple]) -> list[RawStep]:
    """The steps as the hook kept them (tuples of RawStep's fields, each comm as the clock gave
    it: most often a shared CommStep already)."""
    steps = [RawStep(*fields) for fields in kept]
    for r in steps:
        if r.comm.__class__ is not CommStep:
            r.comm = comm_step(r.comm)
    return steps


def _next_multiple(step: int, every: int) -> int:
    """The first multiple of `every` after `step`."""
    return (step // every + 1) * every
