"""NCCL communication time from PyTorch's own per-collective records.

What
    Durations come from ProcessGroupNCCL itself, by one of two routes:
    - flight recorder (monitor.comm_timing=auto or flight_recorder): the recorder ProcessGroupNCCL
      really fills, read incrementally on the monitor thread every monitor.flush_every steps (or
      every k-th time when that costs more than monitor.budget_pct of the steps in between; see
      FrCadence), through torch's control-plane worker server (its C++ thread formats the dump
      without the GIL). A collective's `duration_ms` exists only when collective timing is on
      (TORCH_NCCL_ENABLE_TIMING=1, which makes ProcessGroupNCCL record a start CUDA event per
      collective on the NCCL stream, ProcessGroupNCCL.hpp:88-94); without it comm_ms stays null
      and one warning says what to set.
    - completion hook (monitor.comm_timing=hook): `pg._register_on_completion_hook` on each NCCL
      group. ProcessGroupNCCL::registerOnCompletionHook refuses unless timing is on, so placement
      turns it on per group (`_enable_collectives_timing`: the start CUDA event per collective);
      the hook cannot be removed and runs on ProcessGroupNCCL's `pt_nccl_runhook` thread
      (ProcessGroupNCCL::runHookLoop). WorkInfo (Work.hpp:167-184) carries `time_started` as a
      std::chrono::steady_clock time_point, which pybind11 hands over as a datetime.timedelta
      since the steady clock's epoch (pybind11/chrono.h:219; older torch used system_clock, a
      datetime), converted here to wall time; `active_duration` (start to end event) as a
      timedelta.

    Both attribute a collective to the step whose wall-time span holds its CPU enqueue
    (FR time_created_ns, CLOCK_REALTIME; WorkNCCL::workStartTime_, set when the work is made).
    A step's comm_ms is the sum of its collectives' GPU durations (collectives of different
    groups overlapping on different streams each count). A step none of whose collectives has a
    duration is null, never 0. The flight recorder holds every collective, so its entries also
    give a step's collective count and first enqueue time where no Python call saw them: DDP's
    bucket all-reduces, which then need no comm hook (timing.ddp_bucket_route).

Why
    NCCL calls return at enqueue, so their wall time says nothing.

Upstream
    torch >= 2.11, checked by reading 2.11 (docs/torch211.md); sources cited above and in
    placement/monitor/comm/flight_recorder.py.

Cost
    - flight recorder: adds no CUDA event and no hook; the worker server is one C++ thread.
    - completion hook: the start CUDA event per collective, and the `pt_nccl_runhook` thread
      takes the GIL once per collective to call Python.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import datetime
import enum
import math
import os
import threading
import time
from typing import Optional

from placement.config import BUDGET_PCT, CommTimingMode
from placement.events import EventKind
from placement.monitor.comm.base import THREAD_STATES, CommStep, CommTiming
from placement.monitor.comm.groups import nccl_groups
from placement.monitor.comm.flight_recorder import (NCCL, DumpSource, RingReader, Settled, dump_sources, entries_from,
                                                ring_setting, settled_test)
from placement.bind.nccl_env import TIMING_VAR, timing_enabled_by_env
from placement.monitor.warn import WarnOnce, first_line
from placement.roles import OWN_THREADS

# How long a step may wait for its collectives to settle before it is built with comm time
# null (counted as comm_unsettled). Far above the watchdog's 100 ms retire period and a GPU
# queue several steps behind; a collective that takes longer is a hang, which the stall
# watch names.
SETTLE_MAX_S = 10.0
# Flight-recorder poll interval bounds: no faster than the watchdog retires (kWatchdogThreadSleepMillis,
# 100 ms, ProcessGroupNCCL.hpp: durations appear no more often), no slower than MAX_POLL_S so that a
# step's record is built within a few seconds of its settling. A full ring of 10,000 records costs
# ~430 ms of the worker server's own thread and ~12.5 ms of GIL per dump here
# (benchmarks/comm_flight_recorder.py --ring 10000): 5 s apart that is 0.25% of the time.
MIN_POLL_S = 0.1
MAX_POLL_S = 5.0
EXIT_SETTLE_S = 0.5  # at exit, how long the last collectives may take to settle
RING_HEADROOM = 0.5  # the ring may fill to this share between polls before the interval is shortened
RATE_SPAN_S = 10.0  # the record rate is also averaged over this much of the past: bursty steps leave polls with none
# How long a stall report waits for its flight-recorder dump: the dump queries CUDA events
# (FlightRecorderDetail.hpp:184-202), and cudaEventQuery can hang while another thread holds
# the context in cudaStreamSynchronize (the warning in ProcessGroupNCCL.cpp's watchdog), which
# is where a rank hung at loss.item() sits.
STALL_DUMP_WAIT_S = 2.0


class NullCause(enum.Enum):
    """Why a step's NCCL comm time is null."""

    UNTIMED = "untimed"  # no collective of the step carries a duration (timing off, or no collective)
    UNSETTLED = "unsettled"  # a collective had not settled within SETTLE_MAX_S (or at exit)
    LOST = "lost"  # the ring wrapped over records of the step
    MISSING = "missing"  # timing on, and a collective's duration never came


@dataclasses.dataclass(frozen=True)
class CommFigure:
    ms: Optional[float]
    null: Optional[NullCause] = None
    count: int = 0  # collectives enqueued in the span
    first_t: Optional[float] = None  # the first one's enqueue wall time


class Ledger:
    """Settled collectives (enqueue wall time s, duration ms or None, owed) sorted by time, the
    wall-time spans in which records were lost (the ring wrapped), and the enqueue times of the
    collectives not settled at the last look (a span holding one is null if built now)."""

    def __init__(self):
        self._times: list[float] = []
        self._durs: list[Optional[float]] = []
        self._owed: list[bool] = []  # timing on and the duration never came: the span is null
        self._gaps: list[tuple[float, float]] = []
        self.unsettled: list[float] = []  # sorted

    def add(self, t: float, dur_ms: Optional[float], owed: bool = False) -> None:
        i = bisect.bisect_right(self._times, t)
        self._times.insert(i, t)
        self._durs.insert(i, dur_ms)
        self._owed.insert(i, owed)

    def lost_between(self, t0: float, t1: float) -> None:
        self._gaps.append((t0, t1))

    def take(self, spans: list[tuple[float, float]]) -> list[CommFigure]:
        """Per [start, end) span: the sum of the durations inside; None when no entry inside has
        one, when one inside is owed its duration or not settled, or when records of the span
        were lost. Never a partial sum. Entries before the last span's end are consumed."""
        out: list[CommFigure] = []
        for s, e in spans:
            lo, hi = bisect.bisect_left(self._times, s), bisect.bisect_left(self._times, e)
            u0, u1 = bisect.bisect_left(self.unsettled, s), bisect.bisect_left(self.unsettled, e)
            durs = [d for d in self._durs[lo:hi] if d is not None]
            n, first = hi - lo, (self._times[lo] if hi > lo else None)
            if u1 > u0:
                out.append(CommFigure(None, NullCause.UNSETTLED, n, first))
            elif any(g0 < e and g1 > s for g0, g1 in self._gaps):
                out.append(CommFigure(None, NullCause.LOST, n, first))
            elif any(self._owed[lo:hi]):
                out.append(CommFigure(None, NullCause.MISSING, n, first))
            else:
                out.append(CommFigure(sum(durs) if durs else None, None if durs else NullCause.UNTIMED, n, first))
        if spans:
            cut = bisect.bisect_left(self._times, spans[-1][1])
            del self._times[:cut], self._durs[:cut], self._owed[:cut]
            self._gaps = [g for g in self._gaps if g[1] > spans[-1][1]]
        return out


class NcclTiming(CommTiming):
    """What both NCCL routes share: the ledger, counts of null steps by cause, and one warning
    when NCCL groups exist but comm time stays null past the first exchange window."""

    timed_calls = False
    settle_max_s = SETTLE_MAX_S

    def __init__(self, warn: WarnOnce, window: int):
        super().__init__(warn)
        self.ledger = Ledger()
        self.window = window
        self.steps_resolved = 0
        self.steps_measured = 0
        self.null_steps: collections.Counter = collections.Counter()  # NullCause -> steps

    def why_null(self) -> str:
        raise NotImplementedError

    def _take(self, spans: list[tuple[float, float]]) -> list[CommFigure]:
        return self.ledger.take(spans)

    def resolve_steps(self, spans: list[tuple[float, float]], seen: list[CommStep]) -> list[CommStep]:
        """The ledger's figures joined with the clock's: its count and first enqueue time count
        too (DDP's buckets reach only the ledger when no hook is installed), and where the
        source sees every collective (sees_all), a span it holds none of had none: 0.0."""
        if not spans:
            return []
        got = self._take(spans)
        if self.sees_all:
            got = [CommFigure(0.0, None) if g.null is NullCause.UNTIMED and g.count == 0 and s.count == 0 else g
                   for g, s in zip(got, seen)]
        out = []
        for g, s in zip(self._judge_nulls(got), seen):
            enter = g.first_t if s.enter_t is None else s.enter_t if g.first_t is None else min(s.enter_t, g.first_t)
            out.append(CommStep(g.ms, max(s.count, g.count), enter))
        return out

    def _judge_nulls(self, got: list[CommFigure]) -> list[CommFigure]:
        self.steps_resolved += len(got)
        self.steps_measured += sum(1 for g in got if g.ms is not None)
        for g in got:
            if g.null is not None and g.null is not NullCause.UNTIMED:
                self.null_steps[g.null] += 1
        unsettled = self.null_steps[NullCause.UNSETTLED]
        if unsettled:
            self.warn("nccl-comm-unsettled", f"NCCL comm time is null on {unsettled} step(s) so far: a collective of "
                                             f"each had no duration yet {self.settle_max_s:.0f} s after the step (or "
                                             "at exit); counted as comm_unsettled in the monitor's flight_recorder event")
        if self.steps_measured == 0 and self.steps_resolved >= self.window:
            self.warn("nccl-comm-null", f"NCCL comm time is null for all {self.steps_resolved} steps so far "
                                        f"(monitor.comm_timing={self.name}): {self.why_null()}")
        return got

    def null_counts(self) -> dict:
        return {f"comm_{cause.value}": n for cause, n in self.null_steps.items()}


class NcclHookComm(NcclTiming):
    """ProcessGroupNCCL's completion hook on every NCCL group (timing turned on for each).
    Settled through the last look at which every collective entered through the wrappers or
    the DDP hook had been reported by the hook (runHookLoop reports each once it completed)."""

    name = "hook"

    def __init__(self, warn: WarnOnce, window: int = 20, groups: Optional[list] = None):
        super().__init__(warn, window)
        self._infos: list = []  # appended on pt_nccl_runhook (a list append is atomic under the GIL)
        self.active = True
        self.groups = 0
        self.errors = 0
        self.reported = 0
        self._through = time.time()
        for pg in nccl_groups() if groups is None else groups:
            try:
                pg._enable_collectives_timing()  # ProcessGroupNCCL::enableCollectivesTiming: enableTiming_ = true
                pg._register_on_completion_hook(self._on_completion)
                self.groups += 1
            except Exception as e:  # e.g. "OnCompletion hook already registered"
                warn("nccl-hook", f"cannot register the NCCL completion hook: {first_line(e)}")

    def _on_completion(self, info) -> None:
        # Runs on pt_nccl_runhook holding the GIL: keep it to one append (and the thread's state, base.py).
        THREAD_STATES.keep()
        if self.active:
            self._infos.append(info)

    def poll_if_due(self, final: bool = False) -> None:
        now, entered = time.time(), self.clock.entered
        infos, self._infos = self._infos, []
        self.reported += len(infos)
        if self.reported >= entered:
            self._through = now
        if not infos:
            return
        offset = time.time() - time.monotonic()  # steady_clock is CLOCK_MONOTONIC on Linux
        for info in infos:
            try:
                self.ledger.add(workinfo_start_wall(info, offset), info.active_duration.total_seconds() * 1e3)
            except Exception as e:
                self.errors += 1
                self.warn("nccl-hook-info", f"unreadable NCCL WorkInfo ({type(e).__name__}: {first_line(e)}); "
                                            "those collectives are not timed")

    def settled_through(self) -> float:
        return self._through if self.groups else math.inf

    def _take(self, spans: list[tuple[float, float]]) -> list[CommFigure]:
        # Spans after the settled point are built only past SETTLE_MAX_S: their collectives
        # may still be reported, so they are null rather than short.
        self.ledger.unsettled = [] if spans[-1][1] <= self._through else [max(self._through, spans[0][0])]
        return self.ledger.take(spans)

    def why_null(self) -> str:
        if not self.groups:
            return "no NCCL group took the completion hook (see the warning before)"
        return (f"the completion hook never reported a collective; is {TIMING_VAR} refused by this "
                "NCCL (< 2.4)?")

    def close(self) -> None:
        self.active = False  # a registered hook cannot be removed; it goes quiet
        super().close()


def workinfo_start_wall(info, offset: float) -> float:
    """WorkInfo.time_started as wall time: a timedelta since the steady clock's epoch (torch
    2.13, Work.hpp:171, pybind11/chrono.h:219) plus `offset` (time.time() - time.monotonic());
    or, from torch versions whose WorkInfo held a system_clock time_point, a datetime."""
    ts = info.time_started
    if isinstance(ts, datetime.timedelta):
        return ts.total_seconds() + offset
    if isinstance(ts, datetime.datetime):
        return ts.timestamp()
    raise TypeError(f"WorkInfo.time_started is a {type(ts).__name__}")


class FrCadence:
    """How often to poll the flight recorder, in wall time: the interval that keeps a poll's GIL
    time within monitor.budget_pct of the time between polls, within [MIN_POLL_S, MAX_POLL_S],
    and shorter when the ring would fill past RING_HEADROOM in that time (lost records would
    cost more than the time: over_budget says so). The record rate is the higher of the last
    poll's and the one over the last RATE_SPAN_S: a step's collectives come in a burst (3,000
    in 15 ms for TP=8 with sequence parallelism), so a poll between bursts reads none, and
    that alone would let the next interval span several bursts and wrap the ring."""

    def __init__(self, budget_pct: float, ring: int):
        self.budget_pct = budget_pct
        self.ring = ring
        self.interval_s = MIN_POLL_S
        self.over_budget = False
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (seconds, records) per poll

    def update(self, gil_s: float, records: int, since_last_s: float) -> float:
        """One poll: its GIL time, the records it read (settled and lost), the time since the
        poll before it."""
        want = gil_s / (self.budget_pct / 100.0) if self.budget_pct > 0 else MIN_POLL_S
        self._recent.append((max(since_last_s, 0.0), records))
        while len(self._recent) > 1 and sum(s for s, _ in self._recent) - self._recent[0][0] >= RATE_SPAN_S:
            self._recent.popleft()
        span = sum(s for s, _ in self._recent)
        rate = max(records / since_last_s if since_last_s > 0 else 0.0,
                   sum(n for _, n in self._recent) / span if span > 0 else 0.0)
        cap = RING_HEADROOM * self.ring / rate if rate > 0 and self.ring > 0 else MAX_POLL_S
        self.interval_s = max(MIN_POLL_S, min(MAX_POLL_S, want, cap))
        self.over_budget = self.budget_pct > 0 and gil_s / self.interval_s > self.budget_pct / 100.0
        return self.interval_s


class NcclFlightRecorderComm(NcclTiming):
    """The recorder ProcessGroupNCCL fills, read incrementally (flight_recorder.RingReader).

    Settled through: after a poll, the enqueue time of the oldest NCCL entry not settled yet
    (flight_recorder.settled_test: with timing on, one whose duration the watchdog has not
    written), or, when every entry is settled, the time the dump began. A step that ends at or
    before it has every duration it will get; the monitor builds steps up to there and no
    further, whatever their number, so 2 ms steps, 2 s steps and a GPU queue k steps behind
    the CPU are all built once, whole. With timing off nothing is owed: settled through now."""

    name = "flight_recorder"

    def __init__(self, warn: WarnOnce, window: int = 20, budget_pct: float = BUDGET_PCT,
                 sources: Optional[list[DumpSource]] = None, timing_on: Optional[bool] = None,
                 environ=os.environ, since: Optional[float] = None):
        super().__init__(warn, window)
        self.sources = dump_sources() if sources is None else sources
        self.source: Optional[DumpSource] = self.sources[0] if self.sources else None
        # Collectives from before the monitor started are not its steps' (`since`: wall time).
        self.since = time.time() if since is None else since
        self.timing_on = timing_enabled_by_env(environ) if timing_on is None else timing_on
        self.reader = RingReader(timing_on=self.timing_on, not_before=self.since)
        self.ring_setting = ring_setting(environ)
        self.ring = self.ring_setting.size
        self.cadence = FrCadence(budget_pct, self.ring)
        self._probed_other = False
        self._next_poll = 0.0  # wall time the next poll is due
        self._last_poll = self.since
        self._through = self.since  # settled through (wall time)
        self._stall_dump: Optional[threading.Thread] = None  # a stall-time dump that did not answer
        self.null_why: Optional[str] = None  # why the last in_collective() was None
        self.polls = 0
        self.gil_ns = 0  # time holding the GIL in polls (the whole dump on a GIL-holding route)
        self.dump_ns = 0  # wall time of the dumps themselves
        self.entries = 0  # NCCL entries read
        self.timed_entries = 0  # of which with duration_ms
        if self.source is None:
            warn("fr-missing", "this torch has no flight-recorder dump; NCCL comm time is not measured")
            return
        if since is None:  # starting now: mark where the ring stands, so records overwritten from here on count as lost
            try:
                self.reader.mark_start(self.source.dump())
            except Exception:
                pass  # the first poll says it
        if self.source.recorder != "nccl":
            warn("fr-generic", f"no NCCL flight-recorder dump in this torch build; reading the generic one "
                               f"({self.source}), which holds NCCL records only where upstream merged the two")

    def _dump(self, source: DumpSource):
        t0 = time.perf_counter_ns()
        dump = source.dump()
        dt = time.perf_counter_ns() - t0
        self.dump_ns += dt
        return dump, (0 if source.gil_free else dt)

    def in_collective(self) -> Optional[bool]:
        """Whether this rank has an NCCL collective enqueued and not completed, i.e. its GPU
        waits inside one (at a stall: for a peer). NCCL calls return at enqueue, so the CPU's
        clock cannot tell (comm.CollectiveClock); the recorder can: a fresh dump's entries from
        the reader's low-water mark (every older one is settled), an entry's `state` from its
        end event (FlightRecorderDetail.hpp:567-573: completed once the end event has
        occurred), not completed nor followed by a completed one of its group. Called by the
        stall watch on the monitor thread, once per stall. The dump queries every entry's CUDA
        events (dump_entries -> update_state, FlightRecorderDetail.hpp:184-231; onlyActive and
        includeStackTraces change only what is formatted, not that query), which can hang, so
        it runs on its own thread and is waited for STALL_DUMP_WAIT_S at most. None, with one
        warning saying why, when no dump can be had in that time."""
        self.null_why = None
        if self.source is None:
            self.null_why = "this torch has no flight-recorder dump"
            return None
        if self._stall_dump is not None and self._stall_dump.is_alive():
            self.null_why = "an earlier flight-recorder dump at a stall has still not answered"
            return None
        answer: dict = {}
        source = self.source

        def dump() -> None:
            try:
                answer["dump"] = source.dump()
            except Exception as e:
                answer["error"] = e

        thread = OWN_THREADS.start(dump, "placement_frdump")
        thread.join(STALL_DUMP_WAIT_S)
        if thread.is_alive():
            self._stall_dump = thread
            self.null_why = (f"the flight-recorder dump at a stall ({source}) did not answer within {STALL_DUMP_WAIT_S:.0f} s "
                             "(it queries CUDA events, which hang while another thread holds the CUDA context "
                             "in a synchronize)")
        elif "error" in answer:
            self.null_why = f"the flight-recorder dump at a stall failed ({source}: {first_line(answer['error'])})"
        if self.null_why is not None:
            self.warn("fr-stall", f"{self.null_why}; whether this rank waits inside a collective is null")
            return None
        raw, _ = entries_from(answer["dump"], self.reader.low)
        done, prefix = settled_test(raw, timing_on=False), self.reader.prefix
        return any(str(e.get("profiling_name", "")).startswith(prefix) and done(e) is Settled.PENDING for e in raw)

    def poll_if_due(self, final: bool = False) -> None:
        """Poll when the cadence says so, or now when `final` (exit: everything is built next);
        then the last collectives get up to EXIT_SETTLE_S to settle (a watchdog period or
        two), so the last steps are not null for want of one retire."""
        now = time.time()
        if self.source is None or (not final and now < self._next_poll):
            return
        self._poll(now)
        deadline = now + EXIT_SETTLE_S
        while final and self.timing_on and self.ledger.unsettled and time.time() < deadline:
            time.sleep(MIN_POLL_S)
            self._poll(time.time())

    def _poll(self, now: float) -> None:
        try:
            dump, gil = self._dump(self.source)
            t0 = time.perf_counter_ns()
            got = self.reader.read(dump)
        except Exception as e:
            fallback = next((s for s in self.sources[self.sources.index(self.source) + 1:]
                             if s.recorder == self.source.recorder), None)
            self.warn(f"fr-dump:{self.source}", f"flight-recorder dump failed ({self.source}: {first_line(e)})"
                      + (f"; reading {fallback} from now on" if fallback else ""))
            if fallback is not None:
                self.source.close()
                self.source = fallback
            self._next_poll = now + self.cadence.interval_s
            return
        self.polls += 1
        for entry in got.entries:
            self.ledger.add(entry.created_s, entry.duration_ms, entry.owed)
        self.entries += len(got.entries)
        timed = sum(1 for e in got.entries if e.duration_ms is not None)
        self.timed_entries += timed
        if timed and not self.timing_on:  # timing turned on after all (a group's own setting)
            self.timing_on = self.reader.timing_on = True
        self.ledger.unsettled = sorted(got.pending)
        self._through = min(got.pending) if got.pending and self.timing_on else now
        if got.lost:
            self.ledger.lost_between(*got.lost_span)
            self.warn("fr-overflow", f"the flight recorder's ring ({self.ring_setting}) wrapped between two polls: "
                                     f"{got.lost} records lost, their steps' comm time is null (counted as "
                                     "overflow in the monitor's flight_recorder event); set "
                                     f"{self.ring_setting.variable or 'TORCH_FR_BUFFER_SIZE'} larger")
        gil_ns = gil + time.perf_counter_ns() - t0
        self.gil_ns += gil_ns
        interval = self.cadence.update(gil_ns / 1e9, got.settled + got.lost, now - self._last_poll)
        self._last_poll, self._next_poll = now, now + interval
        if self.cadence.over_budget:
            self.warn("fr-budget", f"reading the flight recorder holds the GIL {gil_ns / 1e6:.2f} ms per poll, over "
                                   f"placement.monitor.budget_pct={self.cadence.budget_pct}% of the {interval:.2f} s "
                                   f"between polls (the ring, {self.ring_setting}, allows no longer)")
        if not got.seen and not self._probed_other:
            self._probe_other_source()

    def _probe_other_source(self) -> None:
        """The chosen recorder shows no NCCL record: look once at the other one (builds that
        merged the recorders fill the generic one)."""
        self._probed_other = True
        for other in self.sources:
            if other.recorder == self.source.recorder:
                continue
            try:
                dump, _ = self._dump(other)
                if RingReader(not_before=self.since).read(dump).seen:
                    self.warn("fr-switch", f"NCCL records are in {other}, not {self.source}: reading that one")
                    self.source = other
                    self.reader = RingReader(timing_on=self.timing_on, not_before=self.since)
                return
            except Exception:
                continue

    def settled_through(self) -> float:
        """Wall time through which every NCCL collective enqueued has settled (as of the last poll)."""
        if self.source is None or self.ring <= 0 or not self.timing_on:
            return math.inf  # no duration will ever come: nothing to wait for
        return self._through

    def poll_interval_s(self) -> float:
        return self.cadence.interval_s

    @property
    def sees_all(self) -> bool:
        """The ring holds every NCCL collective this rank enqueues, DDP's buckets included
        (ProcessGroupNCCL records each at enqueue), when the NCCL recorder itself is read and
        has a ring (a build that merged the recorders is not counted on: the DDP hook stays)."""
        return self.source is not None and self.source.recorder == NCCL and self.ring > 0

    def why_null(self) -> str:
        if self.source is None:
            return "this torch has no flight-recorder dump"
        if self.ring <= 0:
            return f"the flight recorder is off ({self.ring_setting}); unset it or set it to 2000 or more"
        if self.entries and not self.timed_entries:
            unset = "" if self.timing_on else f" ({TIMING_VAR} is not set)"
            return (f"PyTorch records no duration without collective timing{unset}: set {TIMING_VAR}=1 or "
                    "placement.monitor.nccl_timing=on (one start CUDA event per collective on the NCCL stream)")
        if not self.entries:
            return f"the flight recorder ({self.source}) holds no NCCL record"
        return "no step's NCCL records carried a duration"

    def stats(self) -> dict:
        return {"source": str(self.source) if self.source else None, "ring": self.ring,
                "ring_variable": self.ring_setting.variable, "timing_on": self.timing_on, "polls": self.polls,
                "gil_ms_per_poll": round(self.gil_ns / 1e6 / self.polls, 3) if self.polls else None,
                "dump_ms_per_poll": round(self.dump_ns / 1e6 / self.polls, 3) if self.polls else None,
                "poll_interval_s": round(self.cadence.interval_s, 3), "entries": self.entries,
                "timed_entries": self.timed_entries, "overflow": self.reader.overflow, **self.null_counts()}

    def close(self) -> None:
        for source in self.sources:
            try:
                source.close()  # the worker server, when one was started
            except Exception as e:
                self.warn("fr-close", f"flight-recorder worker server did not shut down ({first_line(e)})")
        events = getattr(self.warn, "events", None)
        if events is not None and self.polls:
            try:
                events.event(EventKind.MONITOR, source="comm", comm_timing=self.name, flight_recorder=self.stats(),
                             message=f"flight recorder: {self.polls} polls, {self.stats()['gil_ms_per_poll']} ms "
                                     f"GIL each, {self.reader.overflow} records lost to the ring, "
                                     f"{self.null_steps[NullCause.UNSETTLED]} steps null as unsettled")
            except Exception:
                pass
        super().close()


def choose_nccl_timing(mode: CommTimingMode, warn: WarnOnce, *, window: int = 20, budget_pct: float = BUDGET_PCT) -> CommTiming:
    """hook -> the completion hook (adds CUDA events and a GIL hop per collective); auto and
    flight_recorder -> the flight recorder, which adds nothing (auto never registers the
    hook: it could not be removed again)."""
    if mode == CommTimingMode.HOOK:
        return NcclHookComm(warn, window)
    return NcclFlightRecorderComm(warn, window, budget_pct)
