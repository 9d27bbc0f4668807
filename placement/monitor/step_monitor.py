"""The per-rank step monitor: the step hook, per-step records, and their delivery.

Cost design (budget: <= 30 us per step, <= 0.3% of a 10 ms step; see
benchmarks/monitor_overhead.py):
- on_step() reads only timestamps, the main thread's thread clock and one pread of its
  schedstat, one pread per nccl/pin_memory thread, and appends a tuple.
- every monitor.rescan_every steps: the span reading of every thread (faults, switches,
  migrations, MHz; dataloader/other in full) and a refresh of the thread list (the
  binder's, kept current by its watcher thread off the training thread, or ThreadScan's).
- every monitor.flush_every steps: records are built, judged, handed to observers (the
  tuner), encoded and written in one batch, and the file flushed.
- every monitor.exchange_every steps: one asynchronous all-gather on a side gloo group.
Nothing here synchronises a GPU. No figure is guessed: what a probe cannot read is None.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from placement.config import PlacementConfig
from placement.monitor import exitflush
from placement.monitor.comm import CommTiming
from placement.monitor.exchange import Exchange
from placement.monitor.jsonl import write_records
from placement.monitor.record import StepRecord
from placement.monitor.straggler import RankFigures, StragglerReport, figures_from_records
from placement.monitor.summary import one_line, stall_ms, summarize
from placement.monitor.tensorboard_sink import open_writer, write_batch
from placement.monitor.threads import RoleSampler, merge_span
from placement.monitor.verdict import step_verdict
from placement.monitor.warn import WarnOnce, first_line, log


class StepMonitor:
    def __init__(self, cfg: PlacementConfig, events, *, rank: int, local_rank: int, world_size: int,
                 sampler: RoleSampler, comm: CommTiming, warn: WarnOnce,
                 exchange: Optional[Exchange] = None):
        self.cfg = cfg.monitor
        self._tune = cfg.tune
        self.events = events
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.sampler = sampler
        self.comm = comm
        self.warn = warn
        self.exchange = exchange
        self.step = 0
        self._data_ns = 0
        self._last_span_step = 0
        # Step boundaries are perf_counter_ns stamps; their wall time is derived in the batch
        # from an anchor pair re-taken there (one clock read per step instead of two).
        self._anchor = (time.perf_counter_ns(), time.time())
        self._t_last = self._anchor[0]
        self._wall_last = self._anchor[1]
        # The next step that has batch work (a span reading, a flush, an exchange): one
        # comparison per step decides whether any is due.
        self._next_due = min(self.cfg.rescan_every, self.cfg.flush_every, self.cfg.exchange_every)
        # Steps measured but not yet built into records:
        # (end perf_counter_ns, data ns, CommStep, main read, hot read, span read or None)
        self._raw: list[tuple] = []
        self._raw_first_step = 1  # step number of _raw[0]
        self._window: list[StepRecord] = []  # since the last exchange
        self._summary: list[StepRecord] = []  # since the last summary line
        self.observers: list[Callable[[StepRecord], None]] = []
        self._tb = open_writer(self.cfg.log_dir, rank, warn) if self.cfg.tensorboard else None
        self.self_ns = 0  # time spent inside the monitor on the training thread
        self.steps_timed = 0
        self._busy = False
        self._flush_requested = False
        self.closed = False

    # ---- fed by the training loop --------------------------------------------------------
    def add_data_wait(self, ns: int) -> None:
        self._data_ns += ns

    def on_step(self) -> None:
        """Mark the end of one training step. Never raises."""
        t0 = time.perf_counter_ns()
        if self.closed:
            return
        self._busy = True
        try:
            # Right after a training step every code path runs cold (caches and TLB hold the
            # step's data), so the per-step path is the two syscalls of main's figures and an
            # append; records are built in the batch.
            sampler = self.sampler
            self._raw.append((t0, self._data_ns, self.comm.take_step(), sampler.main.step_read(),
                              sampler.read_hot() if sampler.has_hot else (), None))
            self._data_ns = 0
            self.step += 1
            if self.step >= self._next_due:
                self._batch_work()
        except Exception as e:
            self.warn("on_step", f"monitor step failed ({type(e).__name__}: {first_line(e)}); continuing")
        finally:
            self._busy = False
            self.self_ns += time.perf_counter_ns() - t0
            self.steps_timed += 1
            if self._flush_requested:
                self._flush_requested = False
                self.emergency_flush("deferred")
                exitflush.resume_deferred()

    def _batch_work(self) -> None:
        """The work due at this step: a span reading, building and writing records, an exchange."""
        cfg, step = self.cfg, self.step
        span_steps = step - self._last_span_step
        if span_steps >= cfg.rescan_every:
            self._raw[-1] = self._raw[-1][:5] + (self.sampler.read_span(span_steps),)
            self._last_span_step = step
            self.sampler.refresh()
        exchange = self.exchange
        exchange_now = exchange is not None and exchange.enabled and step % cfg.exchange_every == 0
        if exchange_now or step % cfg.flush_every == 0:
            self._finalize(keep_lag=True)
            self.events.flush()
        if exchange_now:
            self._submit_exchange()
        elif exchange is not None and exchange.pending:
            exchange.collect()
        self._next_due = step + 1 if exchange is not None and exchange.pending else \
            min(self._last_span_step + cfg.rescan_every, _next_multiple(step, cfg.flush_every),
                _next_multiple(step, cfg.exchange_every) if exchange is not None and exchange.enabled else 1 << 62)

    # ---- records ----------------------------------------------------------------------
    def _finalize(self, keep_lag: bool) -> None:
        lag = self.comm.lag_steps if keep_lag else 0
        ready = self._raw[:len(self._raw) - lag] if lag else self._raw
        if not ready:
            return
        self._raw = self._raw[len(ready):]
        first_step = self._raw_first_step
        self._raw_first_step += len(ready)
        # Wall times of the step ends, from the perf_counter stamps and the anchor (re-taken
        # here so that a drift between the two clocks cannot build up).
        anchor_ns, anchor_wall = self._anchor
        ends = [anchor_wall + (r[0] - anchor_ns) / 1e9 for r in ready]
        starts = [self._wall_last] + ends[:-1]
        pending = [i for i, r in enumerate(ready) if r[2].comm_ms is None]
        late_comm = dict(zip(pending, self.comm.resolve([(starts[i], ends[i]) for i in pending]))) if pending else {}
        tune = self._tune
        batch = []
        t_last = self._t_last
        for i, (t_end, data_ns, comm, main, hot, span) in enumerate(ready):
            step_ms, data_ms, t_last = (t_end - t_last) / 1e6, data_ns / 1e6, t_end
            roles = self.sampler.samples(main, hot)
            if span is not None:
                merge_span(roles, span)
            c = comm.comm_ms if comm.comm_ms is not None else late_comm.get(i)
            rec = StepRecord(self.rank, first_step + i, ends[i], step_ms, data_ms, c, comm.count, roles,
                             local_rank=self.local_rank, comm_enter_t=comm.enter_t)
            rec.verdict = step_verdict(step_ms, data_ms, c, stall_ms(rec), tune.runq_wait_pct,
                                       tune.comm_share_pct, tune.data_share_pct)
            batch.append(rec)
        self._t_last, self._wall_last = t_last, ends[-1]
        self._anchor = (time.perf_counter_ns(), time.time())
        write_records(self.events, batch)
        for rec in batch:
            self._deliver(rec)
        self._window.extend(batch)
        self._summary.extend(batch)
        try:
            write_batch(self._tb, batch)
        except Exception as e:
            self.warn("tensorboard-write", f"TensorBoard write failed ({first_line(e)})")
        if self.cfg.summary_every and len(self._summary) >= self.cfg.summary_every:
            s = summarize(self.rank, self._summary)
            self._summary = []
            if s is not None:
                log.info(one_line(s))

    def _deliver(self, rec: StepRecord) -> None:
        for fn in list(self.observers):
            try:
                fn(rec)
            except Exception as e:
                self.observers.remove(fn)
                self.warn(f"observer:{id(fn)}", f"step observer {getattr(fn, '__qualname__', fn)!r} raised "
                                                f"({type(e).__name__}: {first_line(e)}); it is removed")

    # ---- cross-rank ------------------------------------------------------------------
    def _submit_exchange(self) -> None:
        figs = figures_from_records(self.rank, self._window)
        self._window = []
        if figs is None:
            figs = RankFigures(self.rank, 0, 0, 0, 0.0, 0.0, None, None, None, None, None, None, ())
        self.exchange.submit(figs)

    def write_straggler_event(self, report: StragglerReport, figures: list[RankFigures]) -> None:
        """Rank 0: one `straggler` event per window that names someone."""
        if not report.stragglers:
            return
        steps = [f for f in figures if f.steps]
        first = min((f.first_step for f in steps), default=0)
        last = max((f.last_step for f in steps), default=0)
        self.events.event("straggler", steps=[first, last], **report.to_dict(),
                          figures={str(f.rank): {"step_ms": round(f.step_ms, 3), "data_ms": round(f.data_ms, 3),
                                                 "comm_ms": None if f.comm_ms is None else round(f.comm_ms, 3),
                                                 "stall_ms": None if f.stall_ms() is None else round(f.stall_ms(), 3)}
                                   for f in steps})
        for s in report.stragglers:
            log.warning("placement: straggler %s rank(s) %s steps %d-%d: %s", s.kind, s.ranks, first, last, s.why)

    # ---- ends --------------------------------------------------------------------------
    def emergency_flush(self, reason: str) -> bool:
        """Write every measured step now (exit, SIGTERM, exception). False when mid-step:
        then it happens at the end of that step."""
        if self._busy:
            self._flush_requested = True
            return False
        if self.closed:
            return True
        try:
            self._finalize(keep_lag=False)
        finally:
            self.events.flush()
        return True

    def close(self) -> None:
        if self.closed:
            return
        self._finalize(keep_lag=False)
        self.closed = True
        exitflush.unregister(self)
        if self.exchange is not None:
            self.exchange.close()
        self.comm.close()
        self.sampler.close()
        if self._tb is not None:
            try:
                self._tb.close()
            except Exception:
                pass
        per_step = self.self_ns / 1e3 / self.steps_timed if self.steps_timed else None
        self.events.event("end", source="monitor", steps=self.step,
                          monitor_us_per_step=None if per_step is None else round(per_step, 2))
        self.events.flush()


def _next_multiple(step: int, every: int) -> int:
    """The first multiple of `every` after `step`."""
    return (step // every + 1) * every
