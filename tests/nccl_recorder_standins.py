"""Stand-ins for what only a CUDA build of torch with NCCL produces, shaped exactly as upstream
torch 2.13 makes it (include/torch/csrc/distributed/c10d/ of the installed torch, pybind11).

- fr_entry / fr_dump_json: a flight-recorder dump as FlightRecorder<EventType>::dump_json
  writes it (FlightRecorderDetail.hpp:506-597): nlohmann::json objects, keys sorted, compact;
  "entries" left out when empty (:588-590); `duration_ms` only when the entry has one (:537-539:
  timing on, retired with start and end events, :289-316); `state` from the discovery times
  (:567-573); `time_discovered_*_ns` 0 when unknown (:574-581); `time_created_ns` from
  c10::getTime(), CLOCK_REALTIME (:117, c10/util/ApproximateClock.h:66); `process_group` the
  (name, desc) tuple as a 2-array.
- WorkInfo: what ProcessGroupNCCL::runHookLoop hands the completion hook (Work.hpp:167-184):
  time_started / time_finished are steady_clock time_points, which pybind11 casts as
  datetime.timedelta since the steady clock's epoch (pybind11/chrono.h:219), active_duration
  a duration<float> (a timedelta).
- NcclGroup: the two ProcessGroup methods the hook route calls, with ProcessGroupNCCL's checks
  (ProcessGroupNCCL::registerOnCompletionHook: "already registered" and "requires ...
  TORCH_NCCL_ENABLE_TIMING" when timing is off; enableCollectivesTiming sets enableTiming_).
"""
from __future__ import annotations

import collections
import datetime
import json
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional


def fr_entry(rid: int, created_s: float, *, pg_id: int = 0, name: str = "nccl:all_reduce",
             duration_ms: Optional[float] = None, started_s: Optional[float] = None,
             completed_s: Optional[float] = None, retired: bool = False, seq: Optional[int] = None) -> dict:
    e = {"record_id": rid, "pg_id": pg_id, "process_group": [str(pg_id), "default_pg" if pg_id == 0 else "undefined"],
         "thread_name": "pt_main_thread", "thread_id": "140000000000000",
         "collective_seq_id": rid if seq is None else seq, "p2p_seq_id": 0, "op_id": rid if seq is None else seq,
         "profiling_name": name, "time_created_ns": int(created_s * 1e9),
         "input_sizes": [[1024]], "input_dtypes": ["Float"], "output_sizes": [[1024]], "output_dtypes": ["Float"],
         "state": "completed" if completed_s is not None else "started" if started_s is not None else "scheduled",
         "time_discovered_started_ns": 0 if started_s is None else int(started_s * 1e9),
         "time_discovered_completed_ns": 0 if completed_s is None else int(completed_s * 1e9),
         "retired": retired, "timeout_ms": 600000, "is_p2p": False}
    if duration_ms is not None:
        e["duration_ms"] = duration_ms
    return e


def fr_dump_json(entries: list[dict], *, nccl_version: str = "2.27.5") -> str:
    d = {"version": "2.10", "comm_lib_version": nccl_version, "pg_config": {}, "pg_status": {},
         "nccl_comm_state": {}}
    if entries:
        d["entries"] = entries
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class WorkInfo:
    op_type: int
    seq: int
    time_started: datetime.timedelta
    time_finished: datetime.timedelta
    active_duration: datetime.timedelta


def work_info(enqueued_wall_s: float, active_ms: float, seq: int = 0) -> WorkInfo:
    """A WorkInfo for a collective enqueued at wall time `enqueued_wall_s`, as pybind11 delivers
    it: steady-clock (CLOCK_MONOTONIC) times as timedeltas."""
    mono = enqueued_wall_s - (time.time() - time.monotonic())
    return WorkInfo(0, seq, datetime.timedelta(seconds=mono),
                    datetime.timedelta(seconds=mono + active_ms / 1e3 + 0.001),
                    datetime.timedelta(milliseconds=active_ms))


class NcclGroup:
    """ProcessGroup methods of the hook route, with ProcessGroupNCCL's own checks; fire()
    calls the hook from another thread, as pt_nccl_runhook does."""

    def __init__(self, timing: bool = False):
        self.timing = timing
        self.hook = None

    def _enable_collectives_timing(self) -> None:
        self.timing = True

    def _register_on_completion_hook(self, hook) -> None:
        if self.hook is not None:
            raise RuntimeError("ProcessGroupNCCL OnCompletion hook already registered")
        if not self.timing:
            raise ValueError("ProcessGroupNCCL OnCompletion hook requires recording start and end events which "
                             "require setting TORCH_NCCL_ENABLE_TIMING environment variable.")
        self.hook = hook

    def fire(self, infos: list[WorkInfo]) -> None:
        def run():
            threading.current_thread().name = "pt_nccl_runhook"
            for info in infos:
                self.hook(info)

        t = threading.Thread(target=run)
        t.start()
        t.join()


def settle_steps_late(handle, lag: int) -> None:
    """Make an attach() handle's comm source settle each step's figures `lag` steps after the
    step, as NCCL durations come after it (the monitor then holds those steps:
    build.py RecordBuilder.build): settled through the step `lag` steps back, read as handle.step() is
    called for it (so just before that step's end stamp: the step `lag` + 1 back is settled
    whole), before the hook hands steps over, as a poll of NCCL's records would have seen it."""
    ends: collections.deque = collections.deque(maxlen=lag + 1)
    step = handle.monitor.on_step  # what handle.step() becomes at its first call (no optimizer hooked)

    def step_and_stamp():
        ends.append(time.time())
        step()

    handle.step = step_and_stamp
    comm = handle.monitor.comm
    comm.settled_through = lambda: ends[0] if len(ends) > lag else 0.0
    comm.poll_interval_s = lambda: 0.05
    comm.settle_max_s = 3600.0


class StandInRecorder:
    """ProcessGroupNCCL's flight recorder and its watchdog, with upstream's timing (torch 2.13,
    include/torch/csrc/distributed/c10d/), for a job whose GPU runs its collectives:

    - record() on the calling thread at enqueue (ProcessGroupNCCL::collective -> FlightRecorder::
      record, FlightRecorderDetail.hpp:60-140): `time_created_ns` = now; the collective runs on
      one NCCL stream in order, starting `gpu_lag_s` after its enqueue at the earliest (a GPU
      queue behind the CPU) and when the stream is free, for `gpu_ms`.
    - the watchdog thread (Watchdog::runLoop, ProcessGroupNCCL.cpp; kWatchdogThreadSleepMillis
      = 100 ms, ProcessGroupNCCL.hpp) wakes every `watchdog_s`, and for each work whose end event
      has occurred calls retire_id (FlightRecorderDetail.hpp:270-317): `retired_` set under the
      lock, then the duration computed with the lock released and written after. Only then
      does the entry carry `duration_ms`.
    - dump_json() copies the ring under the lock and queries the events on the copies
      (dump_entries, :204-231), so `state` is "completed" as soon as the end event occurred,
      before any retire; JSON as FlightRecorder::dump_json writes it (fr_dump_json).
    - the ring keeps the last `ring` records (FlightRecorder.hpp:110-111), ids ascending.
    timing=False: no start event, so retire_id writes no duration (:300-304)."""

    def __init__(self, *, gpu_lag_s: float = 0.0, watchdog_s: float = 0.1, ring: int = 2000, timing: bool = True):
        self.gpu_lag_s, self.watchdog_s, self.timing = gpu_lag_s, watchdog_s, timing
        self._lock = threading.Lock()
        self._ring: collections.deque = collections.deque(maxlen=ring)
        self._next_id = 0
        self._stream_free_at = 0.0
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._run_watchdog, name="pt_nccl_watchdg", daemon=True)
        self._watchdog.start()

    def record(self, gpu_ms: float, name: str = "nccl:all_reduce", pg_id: int = 0) -> None:
        now = time.time()
        with self._lock:
            start = max(now + self.gpu_lag_s, self._stream_free_at)
            end = start + gpu_ms / 1e3
            self._stream_free_at = end
            self._ring.append({"id": self._next_id, "created": now, "start": start, "end": end, "ms": gpu_ms, "pg": pg_id,
                               "name": name, "retired": False, "duration_ms": None})
            self._next_id += 1

    def enqueue(self, name: str = "nccl:all_reduce", pg_id: int = 0) -> dict:
        """A collective whose end is known only when every rank's part is in (complete()): the
        multi-rank case, where a rank's recorded duration includes its wait for a late peer
        (NCCL's kernel spins on the GPU until the last rank's data arrives)."""
        now = time.time()
        with self._lock:
            e = {"id": self._next_id, "created": now, "start": max(now + self.gpu_lag_s, self._stream_free_at),
                 "end": math.inf, "ms": None, "pg": pg_id, "name": name, "retired": False, "duration_ms": None}
            self._ring.append(e)
            self._next_id += 1
        return e

    def complete(self, e: dict, end_s: float) -> None:
        """The collective `e` ended at `end_s` on this rank's GPU (its end event occurred)."""
        with self._lock:
            e["end"] = max(end_s, e["start"])
            e["ms"] = (e["end"] - e["start"]) * 1e3
            self._stream_free_at = max(self._stream_free_at, e["end"])

    def _run_watchdog(self) -> None:
        while not self._stop.wait(self.watchdog_s):
            now = time.time()
            with self._lock:
                done = [e for e in self._ring if not e["retired"] and e["end"] <= now]
                for e in done:
                    e["retired"] = True  # retire_id: under the lock
            for e in done:  # the duration, computed with the lock released, then written
                if self.timing:
                    with self._lock:
                        e["duration_ms"] = e["ms"]  # getDurationFromEvent: start to end event

    def dump_json(self) -> str:
        with self._lock:
            copies = [dict(e) for e in self._ring]
        now = time.time()  # update_state on the copies: the events queried now
        return fr_dump_json([fr_entry(e["id"], e["created"], pg_id=e["pg"], name=e["name"],
                                      duration_ms=e["duration_ms"],
                                      started_s=e["start"] if e["start"] <= now else None,
                                      completed_s=e["end"] if e["end"] <= now else None, retired=e["retired"])
                             for e in copies])

    def close(self) -> None:
        self._stop.set()
        self._watchdog.join(timeout=5)


@dataclass
class StandInJob:
    """What run_standin_job measured: per step, the true GPU time of its collectives and the
    comm_ms the monitor wrote (None: null)."""

    truth: list
    got: list
    stats: dict

    def short(self, tol_ms: float = 1e-3) -> list[int]:
        return [i + 1 for i, (t, g) in enumerate(zip(self.truth, self.got)) if g is not None and g < t - tol_ms]

    def wrong(self, tol_ms: float = 1e-3) -> list[int]:
        return [i + 1 for i, (t, g) in enumerate(zip(self.truth, self.got)) if g is not None and abs(g - t) > tol_ms]

    def nulls(self, last: Optional[int] = None) -> list[int]:
        steps = range(len(self.got)) if last is None else range(min(last, len(self.got)))
        return [i + 1 for i in steps if self.got[i] is None]


def run_standin_job(log_dir: str, *, step_ms: float, steps: int, per_step: int = 4, gpu_ms: float = 0.2,
                    gpu_lag_steps: int = 0, ring: int = 2000, flush_every: int = 20, budget_pct: float = 0.3,
                    recorder_cls=None) -> StandInJob:
    """A training loop under placement.attach() whose NCCL comm source is the flight recorder
    read through StandInRecorder's dump (the monitor's own code from the dump on): each step
    enqueues `per_step` collectives of `gpu_ms` on the GPU, which runs `gpu_lag_steps` steps
    behind the CPU, then the rest of the step passes (sleeping: a step's kernels release the GIL)."""
    import placement
    import placement.monitor.comm.timing as comm_mod
    from placement.monitor.comm.nccl import NcclFlightRecorderComm
    from placement.monitor.comm.flight_recorder import DumpSource

    rec = (recorder_cls or StandInRecorder)(gpu_lag_s=gpu_lag_steps * step_ms / 1e3, ring=ring)
    made = []
    original = comm_mod.make_comm_timing

    def make(mode, backend, warn, **kw):
        made.append(NcclFlightRecorderComm(warn, window=kw.get("window", 20), budget_pct=budget_pct,
                                           sources=[DumpSource("nccl", "server", "dump_nccl_trace_json",
                                                               rec.dump_json)],
                                           timing_on=True, environ={"TORCH_FR_BUFFER_SIZE": str(ring)}))
        return made[-1]

    comm_mod.make_comm_timing = make
    try:
        handle = placement.attach(policy="none", tune={"enabled": False},
                                  monitor={"log_dir": log_dir, "flush_every": flush_every, "summary_every": 0})
    finally:
        comm_mod.make_comm_timing = original
    truth = []
    clock = handle.monitor.comm.clock  # what the collective wrappers call at each enqueue (comm.CollectiveWrappers)
    try:
        for _ in range(steps):
            end = time.perf_counter() + step_ms / 1e3
            for _ in range(per_step):
                clock.enter()
                rec.record(gpu_ms)
            truth.append(per_step * gpu_ms)
            while (left := end - time.perf_counter()) > 0:
                time.sleep(left)
            handle.step()
    finally:
        handle.close()
        rec.close()
    records = [json.loads(line) for line in open(os.path.join(log_dir, "rank0.jsonl"))]
    # each step's comm: a record of several steps (records/step.py) says their per-step mean
    got = {s: r["comm_ms"] for r in records if r["type"] == "step"
           for s in range(r["step"] - r.get("steps", 1) + 1, r["step"] + 1)}
    return StandInJob(truth, [got.get(i + 1) for i in range(steps)], made[0].stats() if made else {})
