"""NCCL communication time from PyTorch's own per-collective records.

NCCL calls return at enqueue, so their wall time says nothing; durations come from
ProcessGroupNCCL itself, by one of two routes (torch >= 2.4; sources cited in
placement/monitor/flight_recorder.py and below):

- flight recorder (monitor.comm_timing=auto or flight_recorder): the recorder ProcessGroupNCCL
  really fills, read incrementally on the monitor thread every monitor.flush_every steps (or
  every k-th time when that costs more than monitor.budget_pct of the steps in between; see
  FrCadence), through torch's control-plane worker server (its C++ thread formats the dump
  without the GIL). Adds no CUDA event and no hook; the worker server is one C++ thread. A collective's
  `duration_ms` exists only when collective timing is on (TORCH_NCCL_ENABLE_TIMING=1, which
  makes ProcessGroupNCCL record a start CUDA event per collective on the NCCL stream,
  ProcessGroupNCCL.hpp:88-94); without it comm_ms stays null and one warning says what to set.
- completion hook (monitor.comm_timing=hook): `pg._register_on_completion_hook` on each NCCL
  group. ProcessGroupNCCL::registerOnCompletionHook refuses unless timing is on, so placement
  turns it on per group (`_enable_collectives_timing`: the start CUDA event per collective);
  the hook cannot be removed and runs on ProcessGroupNCCL's `pt_nccl_runhook` thread
  (ProcessGroupNCCL::runHookLoop), which takes the GIL once per collective to call Python.
  WorkInfo (Work.hpp:167-184) carries `time_started` as a std::chrono::steady_clock
  time_point, which pybind11 hands over as a datetime.timedelta since the steady clock's
  epoch (pybind11/chrono.h:219; older torch used system_clock, a datetime), converted here
  to wall time; `active_duration` (start to end event) as a timedelta.

Both attribute a collective to the step whose wall-time span holds its CPU enqueue
(FR time_created_ns, CLOCK_REALTIME; WorkNCCL::workStartTime_, set when the work is made).
A step's comm_ms is the sum of its collectives' GPU durations (collectives of different
groups overlapping on different streams each count). A step none of whose collectives has a
duration is null, never 0.
"""
from __future__ import annotations

import bisect
import datetime
import math
import os
import statistics
import time
from typing import Optional

from placement.monitor.comm import CommTiming
from placement.monitor.comm_groups import nccl_groups
from placement.monitor.flight_recorder import (DumpSource, RingReader, dump_sources, entries_from, ring_size,
                                                settled_test)
from placement.monitor.warn import WarnOnce, first_line

# Steps a step's collectives get to finish on the GPU before its record is built.
LAG_STEPS = 2
# Hold back every pending step (the record is built at the next poll).
HOLD_ALL = 1 << 30
MAX_POLL_EVERY = 8  # at most this many flushes between polls
RING_HEADROOM = 0.5  # the ring may fill to this share between polls before a poll is forced


def timing_enabled_by_env(environ=os.environ) -> bool:
    """Whether ProcessGroupNCCL turns collective timing on by itself: TORCH_NCCL_ENABLE_TIMING
    (or NCCL_ENABLE_TIMING, ProcessGroupNCCL.hpp:92-94), or desync debug, which forces it
    (ProcessGroupNCCL.hpp:1453-1456)."""
    def on(key: str) -> bool:
        return environ.get(key, "0").strip().lower() in ("1", "true", "yes", "on", "y")

    return any(on(k) for k in ("TORCH_NCCL_ENABLE_TIMING", "NCCL_ENABLE_TIMING",
                               "TORCH_NCCL_DESYNC_DEBUG", "NCCL_DESYNC_DEBUG"))


class Ledger:
    """(enqueue wall time s, duration ms or None) of settled collectives, sorted by time,
    plus the wall-time spans in which records were lost (the ring wrapped)."""

    def __init__(self):
        self._times: list[float] = []
        self._durs: list[Optional[float]] = []
        self._gaps: list[tuple[float, float]] = []

    def add(self, t: float, dur_ms: Optional[float]) -> None:
        i = bisect.bisect_right(self._times, t)
        self._times.insert(i, t)
        self._durs.insert(i, dur_ms)

    def lost_between(self, t0: float, t1: float) -> None:
        self._gaps.append((t0, t1))

    def take(self, spans: list[tuple[float, float]]) -> list[Optional[float]]:
        """Per [start, end) span: the sum of the durations inside, None when no entry inside
        has one or when records of the span were lost. Entries before the last span's end
        are consumed."""
        out: list[Optional[float]] = []
        for s, e in spans:
            lo, hi = bisect.bisect_left(self._times, s), bisect.bisect_left(self._times, e)
            durs = [d for d in self._durs[lo:hi] if d is not None]
            lost = any(g0 < e and g1 > s for g0, g1 in self._gaps)
            out.append(None if lost or not durs else sum(durs))
        if spans:
            cut = bisect.bisect_left(self._times, spans[-1][1])
            del self._times[:cut], self._durs[:cut]
            self._gaps = [g for g in self._gaps if g[1] > spans[-1][1]]
        return out


class NcclTiming(CommTiming):
    """What both NCCL routes share: the ledger, and one warning when NCCL groups exist but
    comm time stays null past the first exchange window."""

    timed_calls = False
    lag_steps = LAG_STEPS

    def __init__(self, warn: WarnOnce, window: int):
        super().__init__(warn)
        self.ledger = Ledger()
        self.window = window
        self.steps_resolved = 0
        self.steps_measured = 0

    def why_null(self) -> str:
        raise NotImplementedError

    def _judge_nulls(self, got: list[Optional[float]]) -> list[Optional[float]]:
        self.steps_resolved += len(got)
        self.steps_measured += sum(1 for g in got if g is not None)
        if self.steps_measured == 0 and self.steps_resolved >= self.window:
            self.warn("nccl-comm-null", f"NCCL comm time is null for all {self.steps_resolved} steps so far "
                                        f"(monitor.comm_timing={self.name}): {self.why_null()}")
        return got


class NcclHookComm(NcclTiming):
    """ProcessGroupNCCL's completion hook on every NCCL group (timing turned on for each)."""

    name = "hook"

    def __init__(self, warn: WarnOnce, window: int = 20, groups: Optional[list] = None):
        super().__init__(warn, window)
        self._infos: list = []  # appended on pt_nccl_runhook (a list append is atomic under the GIL)
        self.active = True
        self.groups = 0
        self.errors = 0
        for pg in nccl_groups() if groups is None else groups:
            try:
                pg._enable_collectives_timing()  # ProcessGroupNCCL::enableCollectivesTiming: enableTiming_ = true
                pg._register_on_completion_hook(self._on_completion)
                self.groups += 1
            except Exception as e:  # e.g. "OnCompletion hook already registered"
                warn("nccl-hook", f"cannot register the NCCL completion hook: {first_line(e)}")

    def _on_completion(self, info) -> None:
        # Runs on pt_nccl_runhook holding the GIL: keep it to one append.
        if self.active:
            self._infos.append(info)

    def _drain(self) -> None:
        infos, self._infos = self._infos, []
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

    def resolve(self, spans: list[tuple[float, float]]) -> list[Optional[float]]:
        if not spans:
            return []
        self._drain()
        return self._judge_nulls(self.ledger.take(spans))

    def why_null(self) -> str:
        if not self.groups:
            return "no NCCL group took the completion hook (see the warning before)"
        return ("the completion hook never reported a collective; is TORCH_NCCL_ENABLE_TIMING refused by this "
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
    """How often to poll the flight recorder: every k-th flush, k the smallest that keeps the
    GIL time of a poll within monitor.budget_pct of the steps between polls, unless the ring
    would fill past RING_HEADROOM in that time (lost records would cost more than the time:
    k stays lower and over_budget says so)."""

    def __init__(self, budget_pct: float, ring: int):
        self.budget_pct = budget_pct
        self.ring = ring
        self.every = 1
        self.over_budget = False

    def update(self, gil_ms: float, steps: int, step_ms: float, records: int) -> int:
        """One poll: its GIL time, the steps it covered, their median time, the records it read."""
        if steps <= 0 or step_ms <= 0 or self.budget_pct <= 0:
            return self.every
        per_flush = steps / self.every  # steps between two flushes
        budget_ms = self.budget_pct / 100.0 * step_ms  # GIL time allowed per step
        want = math.ceil(gil_ms / (budget_ms * per_flush))
        records_per_flush = records / self.every
        cap = (math.floor(RING_HEADROOM * self.ring / records_per_flush) if records_per_flush and self.ring > 0
               else MAX_POLL_EVERY)
        self.every = max(1, min(MAX_POLL_EVERY, want, cap))
        self.over_budget = gil_ms / (self.every * per_flush) > budget_ms
        return self.every


class NcclFlightRecorderComm(NcclTiming):
    """The recorder ProcessGroupNCCL fills, read incrementally (flight_recorder.RingReader)."""

    name = "flight_recorder"

    def __init__(self, warn: WarnOnce, window: int = 20, budget_pct: float = 0.3,
                 sources: Optional[list[DumpSource]] = None, timing_on: Optional[bool] = None,
                 environ=os.environ, since: Optional[float] = None):
        super().__init__(warn, window)
        self.sources = dump_sources() if sources is None else sources
        self.source: Optional[DumpSource] = self.sources[0] if self.sources else None
        # Collectives from before the monitor started are not its steps' (`since`: wall time).
        self.since = time.time() if since is None else since
        self.reader = RingReader(not_before=self.since)
        self.ring = ring_size(environ)
        self.timing_on = timing_enabled_by_env(environ) if timing_on is None else timing_on
        self.cadence = FrCadence(budget_pct, self.ring)
        self._skip = 0  # flushes to skip before the next poll
        self._probed_other = False
        self._records = 0  # records the last poll read
        self.polls = 0
        self.gil_ns = 0  # time holding the GIL in polls (the whole dump on a GIL-holding route)
        self.dump_ns = 0  # wall time of the dumps themselves
        self.entries = 0  # NCCL entries read
        self.timed_entries = 0  # of which with duration_ms
        if self.source is None:
            warn("fr-missing", "this torch has no flight-recorder dump; NCCL comm time is not measured")
        elif self.source.recorder != "nccl":
            warn("fr-generic", f"no NCCL flight-recorder dump in this torch build; reading the generic one "
                               f"({self.source}), which holds NCCL records only where upstream merged the two")

    final_after_steps = LAG_STEPS  # lag_steps below also counts the polls skipped

    # -- cadence: step_monitor reads lag_steps once per build, then calls resolve() --
    @property
    def lag_steps(self) -> int:  # type: ignore[override]
        if self._skip > 0:
            self._skip -= 1
            return HOLD_ALL  # no poll this flush: every pending step waits for the next one
        return LAG_STEPS

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
        occurred), not settled as the reader judges it (flight_recorder.settled_test). Called
        by the stall watch on the monitor thread, the one that polls, once per stall. None,
        with one warning, when no dump can be had."""
        if self.source is None:
            return None
        try:
            raw, _ = entries_from(self.source.dump(), self.reader.low)
        except Exception as e:
            self.warn("fr-stall", f"flight-recorder dump at a stall failed ({self.source}: {first_line(e)}); "
                                  "whether this rank waits inside a collective is null")
            return None
        settled, prefix = settled_test(raw), self.reader.prefix
        return any(str(e.get("profiling_name", "")).startswith(prefix) and not settled(e) for e in raw)

    def poll(self) -> None:
        if self.source is None:
            return
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
            return
        self.polls += 1
        self._records = got.settled + got.lost
        for entry in got.entries:
            self.ledger.add(entry.created_s, entry.duration_ms)
        self.entries += len(got.entries)
        self.timed_entries += sum(1 for e in got.entries if e.duration_ms is not None)
        if got.lost:
            self.ledger.lost_between(*got.lost_span)
            self.warn("fr-overflow", f"the flight recorder's ring ({self.ring} records) wrapped between two polls: "
                                     f"{got.lost} records lost, their steps' comm time is null (counted as "
                                     "overflow in the monitor's flight_recorder event); set TORCH_NCCL_TRACE_BUFFER_SIZE larger or "
                                     "placement.monitor.flush_every smaller")
        self.gil_ns += gil + time.perf_counter_ns() - t0
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
                    self.source, self.reader = other, RingReader(not_before=self.since)
                return
            except Exception:
                continue

    def resolve(self, spans: list[tuple[float, float]]) -> list[Optional[float]]:
        if not spans:
            return []
        gil0, polls0 = self.gil_ns, self.polls
        self.poll()  # a flush with no poll due never gets here: lag_steps held every step back
        got = self._judge_nulls(self.ledger.take(spans))
        if self.polls > polls0:
            step_ms = statistics.median((e - s) * 1e3 for s, e in spans)
            every = self.cadence.update((self.gil_ns - gil0) / 1e6, len(spans), step_ms, self._records)
            self._skip = every - 1
            if self.cadence.over_budget:
                self.warn("fr-budget", f"reading the flight recorder holds the GIL {(self.gil_ns - gil0) / 1e6:.2f} ms "
                                       f"per poll, over placement.monitor.budget_pct={self.cadence.budget_pct}% of "
                                       f"{len(spans)} steps of {step_ms:.1f} ms, although polled every {every} "
                                       f"flush(es) (the ring of {self.ring} records allows no fewer)")
        return got

    def why_null(self) -> str:
        if self.source is None:
            return "this torch has no flight-recorder dump"
        if self.ring <= 0:
            return "the flight recorder is off (TORCH_NCCL_TRACE_BUFFER_SIZE=0); set it to 2000"
        if self.entries and not self.timed_entries:
            unset = "" if self.timing_on else " (TORCH_NCCL_ENABLE_TIMING is not set)"
            return (f"PyTorch records no duration without collective timing{unset}: set TORCH_NCCL_ENABLE_TIMING=1 "
                    "(one start CUDA event per collective on the NCCL stream) or placement.monitor.comm_timing=hook")
        if not self.entries:
            return f"the flight recorder ({self.source}) holds no NCCL record"
        return "no step's NCCL records carried a duration"

    def stats(self) -> dict:
        return {"source": str(self.source) if self.source else None, "ring": self.ring, "polls": self.polls,
                "gil_ms_per_poll": round(self.gil_ns / 1e6 / self.polls, 3) if self.polls else None,
                "dump_ms_per_poll": round(self.dump_ns / 1e6 / self.polls, 3) if self.polls else None,
                "poll_every_flushes": self.cadence.every, "entries": self.entries,
                "timed_entries": self.timed_entries, "overflow": self.reader.overflow}

    def close(self) -> None:
        for source in self.sources:
            try:
                source.close()  # the worker server, when one was started
            except Exception as e:
                self.warn("fr-close", f"flight-recorder worker server did not shut down ({first_line(e)})")
        events = getattr(self.warn, "events", None)
        if events is not None and self.polls:
            try:
                events.event("monitor", source="comm", comm_timing=self.name, flight_recorder=self.stats(),
                             message=f"flight recorder: {self.polls} polls, {self.stats()['gil_ms_per_poll']} ms "
                                     f"GIL each, {self.reader.overflow} records lost to the ring")
            except Exception:
                pass
        super().close()


def choose_nccl_timing(mode: str, warn: WarnOnce, *, window: int = 20, budget_pct: float = 0.3) -> CommTiming:
    """hook -> the completion hook (adds CUDA events and a GIL hop per collective); auto and
    flight_recorder -> the flight recorder, which adds nothing (auto never registers the
    hook: it could not be removed again)."""
    if mode == "hook":
        return NcclHookComm(warn, window)
    return NcclFlightRecorderComm(warn, window, budget_pct)
