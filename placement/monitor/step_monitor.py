"""The per-rank step monitor: the step hook on the training thread, and the monitor thread
that turns its raw readings into records and delivers them.

What
    StepMonitor coordinates the objects that own each part of a rank's monitoring; each owns its
    state, and this module owns only the hand-over between them and the monitor's lifecycle
    (MonitorState):
      hook.py StepHook           the training thread's side: on_step() measures a step with no
        and HandOvers            system call and hands the steps over at the next due step (a
                                 span reading, a flush, an exchange, an observer's window end);
                                 at short steps only every `stride` flushes (pace():
                                 monitor.handover_min_s of steps at least), and at the end of an
                                 observer's window that ran slower (SlowerWindows)
      probes/sampled.py          the hot threads' kernel counters, read on the monitor thread
        SampledReads             every few steps (the budget's cadence) and at each hand-over,
                                 each reading tagged with the last step ended; a reading due
                                 within half the budget's steps of a hand-over is left to it
      probes/cost.py CostKeeper  what placement costs the rank (the monitor thread's CPU
                                 too), and the budget that judges it
      exitflush.py FlushGate     the monitor's lock, and whether an exit path may write now
      build.py RecordBuilder     raw steps into records once their comm figures settle, judged
                                 (records/verdict.py), a record per group of steps at short
                                 steps (pace(): monitor.record_min_s); span readings at least
                                 SPAN_FLOORS hand-over floors apart while no observer judges windows
      sinks/base.py Delivery     the records to the observers (the tuner) and the sinks, in
                                 order, encoded and written in one batch a flush
      crossrank/duty.py          this rank's windows to rank 0 through the job's c10d store at
        ExchangeDuty             the grid's exchange steps (crossrank/schedule.py), the same
                                 absolute steps on every rank; rank 0 publishes the judgements
      health/rank.py RankHealth  between hand-overs: the hang watch (a rank that completes no
                                 step for max(monitor.hang_factor x its median step,
                                 monitor.hang_min_s) gets a `stall` event), rank 0's peer
                                 watch, the residence watch
    Data crosses from the training thread as tuples and dataclasses (RawStep, HandOver, and the
    counters in them: probes.counters.MainRead, probes.threads.HotRead) addressed by step and
    ThreadRole.

Cost
    The hook and every thread of placement's (roles.OWN_THREADS: this monitor thread, the
    binder's watcher, the peer watch, the posts) together may take monitor.budget_pct of the
    step (0.3% is 30 us of a 10 ms step; benchmarks/job_cost.py measures it in a real job): the
    counters are read every step unless that costs more (probes/budget.py), judged per batch and,
    by CostRate, per second. budget_pct = 0 reads them in the
    hook itself, at every step, exact at each step boundary whatever it costs. Nothing here
    synchronises a GPU. No figure is guessed: what a probe cannot read is None.

Threads
    The monitor thread's work runs under the monitor's lock (FlushGate.holding); the exit paths (close, SIGTERM, an exception in
    training code, interpreter exit) take it and finish that work on their own thread, so every
    measured step is written whichever thread gets there (docs/design.md, threads and locks).
"""
from __future__ import annotations

import enum
import math
import statistics
import threading
import time
from typing import Callable, Optional

from placement.config import PlacementConfig
from placement.events import EventKind
from placement.monitor import exitflush
from placement.monitor.build import Grouping, RecordBuilder, RecordTags
from placement.monitor.comm.base import CommTiming
from placement.monitor.crossrank.duty import MAX_EXCHANGES_DUE, ExchangeDuty
from placement.monitor.crossrank.exchange import Exchange
from placement.monitor.crossrank.schedule import ExchangeGrid
from placement.monitor.health.rank import RankHealth
from placement.monitor.hook import NEVER, HandOver, HandOvers, ReadAt, StepHook
from placement.monitor.probes.cost import CostKeeper
from placement.monitor.probes.sampled import SampledReads
from placement.monitor.probes.threads import RoleSampler
from placement.monitor.sinks.base import Delivery
from placement.monitor.warn import WarnOnce, first_line
from placement.roles import OWN_THREADS

# Batches waiting for the monitor thread beyond which the training thread builds them
# itself: a main thread that never releases the GIL (pure Python, no I/O, no GPU waits)
# lets the monitor thread run only one switch interval (5 ms) per system call it makes.
MAX_BACKLOG = 4
# While no observer judges windows, span readings (every thread read in full, the thread list
# rescanned) are at least this many monitor.handover_min_s apart (2 s at the defaults), whatever
# rescan_every says: at short steps each costs hundreds of us on the monitor thread
# (benchmarks/monitor_thread.py), and their figures (faults, switches, MHz, DataLoader and
# `other`) are per-step means over the span anyway.
SPAN_FLOORS = 4
# How long an exit path waits for the monitor thread to finish what it is doing (it can
# be waiting up to Exchange.WAIT_S for a late peer's exchange) before writing anyway.
EXIT_WAIT_S = 15.0
HELD_RETRY_MIN_S = 0.05  # the monitor thread's shortest wait while steps are held for comm figures


class MonitorState(enum.Enum):
    """The monitor's life, as torch's elastic agent has WorkerState."""

    CREATED = "created"  # built; its thread not started yet
    RUNNING = "running"  # its thread runs; the hook takes steps
    STOPPING = "stopping"  # close() began: no step is taken any more, the thread is asked to end
    CLOSED = "closed"  # every record written, the end event out



class StepMonitor:
    """The coordinator of one rank's monitor: the step hook and its hand-overs (here), the
    monitor thread's loop, and the objects that own each job: the probe budget and what
    placement costs (probes/cost.py), record building (build.py), delivery (sinks/), the
    exchange (crossrank/duty.py), the health checks (health/rank.py)."""

    def __init__(self, cfg: PlacementConfig, events, *, rank: int, local_rank: int, world_size: int,
                 sampler: RoleSampler, comm: CommTiming, warn: WarnOnce,
                 exchange: Optional[Exchange] = None, planned_nodes: tuple[int, ...] = (), first_step: int = 1):
        mon = cfg.monitor
        self.events = events
        self.sampler = sampler
        self.comm = comm
        self.warn = warn
        self.state = MonitorState.CREATED
        # the training thread's side: steps measured, when the next hand-over is due
        self._gate = exitflush.FlushGate(self._flush_deferred)  # the lock; an exit path's flush, now or at the step's end
        self.handed = HandOvers()  # the hand-overs the monitor thread has not taken yet
        self.hook = StepHook(comm, first_step - 1, mon, self._hand_over, self._next_exchange,
                             self._read_counters if mon.budget_pct <= 0 else None, self._gate, warn,
                             self._ask_read if mon.budget_pct > 0 else None)
        self._thread: Optional[threading.Thread] = None
        # Where the hot threads' counters are read: by the monitor thread, each reading tagged with
        # a step (probes/sampled.py), or with budget_pct = 0 (None here) by the hook itself at every step.
        self._sampled = SampledReads(sampler, lambda: self.hook.step) if mon.budget_pct > 0 else None
        # what placement costs the rank, and the budget that k is chosen by (probes/cost.py)
        self.cost = CostKeeper(mon.budget_pct, events, warn, self._sampled, (mon.handover_min_s, mon.handover_max_s))
        self.delivery = Delivery(mon, events, rank, warn, lambda: self.crossrank.on)
        self.crossrank = ExchangeDuty(exchange, ExchangeGrid(mon.exchange_every, mon.exchange_min_s, exchange, rank,
                                                             first_step - 1, lambda: self.cost.floor.scale),
                                      self.delivery.window, events, warn)
        self.health = RankHealth(mon, events, rank, world_size, comm, self.crossrank, warn, planned_nodes,
                                 lambda: self.hook.last_batch, lambda: self.cost.floor.scale > 1)
        tune = cfg.tune
        self.builder = RecordBuilder(RecordTags(rank, local_rank, lambda: events.run,
                                                (tune.runq_wait_pct, tune.comm_share_pct, tune.data_share_pct)),
                                     sampler, self._sampled, comm, self.delivery, self.health.step_times,
                                     first_step, SPAN_FLOORS * mon.handover_min_s,
                                     # budget_pct = 0: every figure exact at each step, a record each
                                     Grouping(mon.exchange_every, mon.record_min_s * 1e3 if mon.budget_pct > 0 else 0.0,
                                              self.hook.window_due))

    def start(self) -> None:
        """Step 1 begins now: called as attach() returns, so that its own set-up (comm hooks,
        the tuner, the first events) is neither step time nor the first step's CPU."""
        self.sampler.rebase()
        hook = self.hook
        anchor_ns = self.builder.start()
        self.cost.start(hook.self_ns, hook.steps_timed, anchor_ns)
        self.health.start(hook.step, anchor_ns)
        self._start_thread()  # the stall watch runs from step 1 on

    def add_observer(self, observe: Callable,
                     window_end: Optional[Callable[[int], Optional[int]]] = None, batch: bool = False) -> None:
        """Call observe(record) for every step record, in step order (with `batch`:
        observe(records) a batch at a time, a call per batch). With `window_end` (step -> the
        last step of the observer's first window ending after that step, or None), the records
        of each such window are handed over as soon as its steps' comm timing is final, not
        only at flush steps. Called on the training thread."""
        self.delivery.add_observer(observe, batch)
        if window_end is not None:
            self.hook.add_window_end(window_end)

    @property
    def on_step(self) -> Callable:
        """The step hook (hook.py StepHook.on_step): what the optimizer's post-step hook calls."""
        return self.hook.on_step

    @property
    def step(self) -> int:
        """Steps ended so far (the last one's number)."""
        return self.hook.step

    @property
    def floor_scale(self) -> int:
        """How many times its floor (monitor.handover_min_s, tune.window_min_s) what is paced in
        time is apart now: the budget's (probes/budget.py PacedFloor)."""
        return self.cost.floor.scale

    @property
    def budget(self):
        """How often the hot threads' counters are read (probes/budget.py ProbeBudget: `every`)."""
        return self.cost.budget

    @property
    def thread(self) -> Optional[threading.Thread]:
        """The monitor thread (`placement_mon`; None until it starts)."""
        return self._thread

    @property
    def closed(self) -> bool:
        return self.state in (MonitorState.STOPPING, MonitorState.CLOSED)

    def _start_thread(self) -> None:
        if self._thread is None and self.state is MonitorState.CREATED:
            self.state = MonitorState.RUNNING
            self._thread = OWN_THREADS.start(self._run, "placement_mon")

    # ---- the hand-over (training thread) -------------------------------------------------
    def _hand_over(self, item: HandOver) -> None:
        self._start_thread()
        if self.handed.put(item) > MAX_BACKLOG:
            with self.holding():
                if self._sampled is not None:  # the monitor thread is starved of the GIL: read here
                    self._sampled.take(at_most=item.last_step)
                self._drain(exchange=True)

    def _ask_read(self, step: int) -> None:
        self._start_thread()
        self.handed.ask_read(step)

    def _next_exchange(self, step: int) -> int:
        crossrank = self.crossrank
        return crossrank.grid.next_after(step) if crossrank.on else NEVER

    def _read_counters(self) -> tuple:
        sampler = self.sampler
        return sampler.main.step_read(), sampler.read_hot() if sampler.has_hot else ()

    def _flush_deferred(self) -> None:
        self.emergency_flush("deferred")
        exitflush.resume_deferred()

    # ---- the monitor thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self.cost.thread_ended(time.thread_time_ns())  # its whole life: the end event's figure

    def _loop(self) -> None:
        sampled, hook = self._sampled, self.hook
        # A comm source read by polling (NCCL's flight recorder) is polled on its own cadence,
        # hand-over or not (a ring of thousands of collectives per step wraps long before a
        # flush step), and steps held for their comm figures are built as soon as they settle
        # (a 500 ms step's next flush is 10 s away): the watch, at most health.poll_s apart.
        # Between watches the thread wakes only to read the counters.
        watched = time.monotonic()  # the last watch
        while True:
            next_watch = watched + min(self.health.poll_s, max(HELD_RETRY_MIN_S, self.comm.poll_interval_s()))
            wait_s = max(0.0, next_watch - time.monotonic())
            if sampled is not None:
                read_in = sampled.wait_s()
                if not self._read_at_hand_over(read_in):
                    wait_s = min(wait_s, read_in)
            c0 = time.thread_time_ns()
            woken, handed = self.handed.wait(wait_s)  # handed: a hand-over's last step (None: close)
            if self.state is not MonitorState.RUNNING:
                return
            read_only = handed.__class__ is ReadAt  # an observer's window ended; its steps come later
            if sampled is not None:  # at a hand-over at once: its last step is then read near its end
                try:
                    if read_only:  # its wake-up was for this reading alone: counted in its cost
                        sampled.take(at_most=handed, woke_ns=time.thread_time_ns() - c0)
                    elif woken:
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
                            sampled.take(at_most=self.handed.oldest_step(), woke_ns=time.thread_time_ns() - c0)
                except Exception as e:
                    self.warn(f"probe:{type(e).__name__}", f"counter reading failed ({type(e).__name__}: "
                                                           f"{first_line(e)}); the figures it misses are spread over the next")
                if (not woken or read_only) and time.monotonic() < next_watch:
                    continue  # woken only to read
            watched = time.monotonic()
            self.health.watch(hook.step)  # (without the monitor's lock: a hung main thread may hold it)
            self.cost.tick(time.monotonic(), hook.self_ns, hook.step)
            if woken and not read_only:
                with self.holding():
                    self._drain(exchange=True)
            elif self.builder.pending or self.comm.poll_interval_s() != math.inf:  # steps held for their comm figures
                with self.holding():
                    self._build_held()
            elif self.cost.floor.scale > 1 and self.crossrank.awaiting:
                # Rank 0, its hand-overs stretched apart by the budget: the rows of the exchange in
                # flight are judged as they come (a round trip a watch), not at its next hand-over,
                # so that a straggler is named one floor after its window, not two.
                with self.holding():
                    self._collect()

    def _read_at_hand_over(self, read_in_s: float) -> bool:
        hook = self.hook
        return read_at_hand_over(read_in_s, hook.step, hook.next_due, self.budget.every, self._sampled.period_s)

    def _build_held(self) -> None:
        """Between hand-overs (the caller holds the monitor's lock): build the steps that were waiting for
        their comm figures, and send the exchanges that waited for them."""
        try:
            self.builder.build(final=False)
            if self.crossrank.on and self.crossrank.grid.due:
                self.crossrank.send_due(self.builder.built_through)
        except Exception as e:
            self._batch_failed(e)

    def _collect(self) -> None:
        try:
            self.crossrank.collect()
        except Exception as e:
            self._batch_failed(e)

    def holding(self, timeout: float = -1):
        """The monitor's lock, as a context manager (exitflush.FlushGate.holding)."""
        return self._gate.holding(timeout)

    def _drain(self, exchange: bool) -> None:
        """Work through what was handed over (the caller holds the monitor's lock). `exchange`:
        take part in due cross-rank exchanges (not on the way out: peers may be gone)."""
        while (item := self.handed.pop()) is not None:
            try:
                self._process(item, exchange=exchange)
            except Exception as e:  # the monitor never breaks training, nor stops for one bad batch
                self._batch_failed(e)

    def _batch_failed(self, e: Exception) -> None:
        self.warn(f"batch:{type(e).__name__}", f"monitor batch failed ({type(e).__name__}: {first_line(e)}); continuing")

    def _process(self, item: HandOver, exchange: bool) -> None:
        hook, builder, crossrank = self.hook, self.builder, self.crossrank
        step = item.last_step
        windowed = hook.windowed and hook.window_due(crossrank.grid.handed) != NEVER
        raw = builder.add(step, item.raw, item.span, windowed)
        step_ms = statistics.median((b.end_ns - a.end_ns) / 1e6 for a, b in zip(raw, raw[1:])) if len(raw) >= 4 else None
        self.cost.judge_batch(step_ms, item.hook_ns, item.hook_steps, item.last_step)
        scale = self.cost.floor.scale
        builder.pace(step_ms, scale)
        hook.pace(step_ms, MAX_EXCHANGES_DUE // 2 if crossrank.on else None, scale)
        on = exchange and crossrank.exchange is not None
        # every exchange step this hand-over holds (several when it holds several strides)
        exchange_now = crossrank.grid.hand(step, step_ms) and on
        flush_now = exchange_now or hook.flushes_at(step)
        if flush_now or (hook.windowed and hook.window_ends_by(builder.first_pending, step)):
            builder.build(final=False)
        if flush_now:
            self.events.flush()
        sent = on and bool(crossrank.grid.due) and crossrank.send_due(builder.built_through)
        if not sent and on:
            crossrank.collect()

    # ---- ends --------------------------------------------------------------------------
    def _write_everything(self, exchange: bool) -> bool:
        """Every measured step into records now, on this thread. False when the monitor
        thread did not let go within EXIT_WAIT_S (it then writes what it holds itself)."""
        with self.holding(EXIT_WAIT_S) as held:
            if not held:
                self.warn("exit-wait", f"the monitor thread was busy for {EXIT_WAIT_S:.0f} s at exit; "
                                       "steps it had not built are not written")
                return False
            newest = self.handed.newest_step()
            if self._sampled is not None and newest is not None:
                # A hand-over the monitor thread had not read for (close() stopped it first):
                # read for its last step, as the thread would have, so that its batch is cut
                # there and not at the reading before (a flush of steps 11-14, then 15 alone).
                self._sampled.take(at_most=newest)
            self._drain(exchange=exchange)
            self.builder.add_at_exit(self.hook.take_raw())
            return True

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
        hook = self.hook
        hook.stopped = True
        thread = self._thread
        if thread is not None:
            self.handed.wake_to_end()
            thread.join(timeout=EXIT_WAIT_S)
        idle = thread is None or not thread.is_alive()
        if idle:
            self.health.resume_at_close(hook.step)
        self._write_everything(exchange=False)
        exitflush.unregister(self)
        if idle:
            try:
                self.crossrank.send_the_rest(hook.step)
            except Exception as e:  # the last windows unjudged, but the end event is still written
                self._batch_failed(e)
        self.health.close()
        self.comm.close()
        self.sampler.close()
        self.delivery.close()
        steps = hook.steps_timed
        per_step = hook.self_ns / 1e3 / steps if steps else None
        self.events.event(EventKind.END, source="monitor", steps=hook.step,
                          monitor_us_per_step=None if per_step is None else round(per_step, 2),
                          **self.cost.thread(steps, thread is not None, EXIT_WAIT_S),
                          **self.cost.whole(steps, hook.self_ns, time.thread_time_ns() - c0, self.builder.last_end_ns),
                          probe_every=self.budget.every, **self.cost.floor_figures(), **self.crossrank.figures())
        self.events.flush()
        self.state = MonitorState.CLOSED


def read_at_hand_over(read_in_s: float, step: int, next_due: int, every: int, period_s: float) -> bool:
    """Whether the reading due in `read_in_s` would come within half a reading's steps (`every`
    steps a reading, one each `period_s`) of the next hand-over (at `next_due`; `step`: the
    last step ended), which takes one anyway: the thread then wakes once for both (a wake-up
    costs about what a reading does). Steps are counted at the readings' pace."""
    step_s = period_s / every
    return 2 * (next_due - step - read_in_s / step_s) <= every
