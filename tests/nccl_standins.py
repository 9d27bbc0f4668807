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


def settle_steps_late(comm, lag: int) -> None:
    """Make a monitor's comm source settle each step's figures `lag` steps after the step, as
    NCCL durations come after it (the monitor then holds those steps: StepMonitor._finalize):
    settled through the end of the step `lag` steps back. The step hook calls take_step right
    after stamping the step's end, so the wall time read there is at or after that end."""
    ends: collections.deque = collections.deque(maxlen=lag + 1)
    take = comm.take_step

    def take_step():
        ends.append(time.time())
        return take()

    comm.take_step = take_step
    comm.settled_through = lambda: ends[0] if len(ends) > lag else 0.0
    comm.poll_interval_s = lambda: 0.05
    comm.settle_max_s = 3600.0
