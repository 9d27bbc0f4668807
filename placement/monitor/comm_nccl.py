"""NCCL communication time from PyTorch's own per-collective timing.

NCCL calls return at enqueue, so their wall time says nothing; durations come from
ProcessGroupNCCL itself, by one of two routes:

- completion hook (`pg._register_on_completion_hook`): called on a PyTorch thread when a
  collective finishes, with WorkInfo.active_duration measured between CUDA start/end
  events. It needs collective timing on (TORCH_NCCL_ENABLE_TIMING=1 or
  `pg._enable_collectives_timing()`), which records an extra CUDA event per collective on
  the NCCL stream. That can break compute/comm overlap under CUDA_DEVICE_MAX_CONNECTIONS=1,
  so placement turns it on only for monitor.comm_timing=hook.
- flight recorder (`torch._C._distributed_c10d._dump_fr_trace_json`, formerly
  `_dump_nccl_trace_json`): its ring of recent collectives holds `duration_ms` when timing
  is on, and otherwise only when the watchdog discovered completion (coarse: the watchdog
  polls). A dump formats the whole ring: measured here at ~14 us per entry (2000 entries,
  the default ring, ~28 ms), so dumps are spaced out and their cost is reported.

monitor.comm_timing=auto uses the hook only when timing is already on (no event added by
placement); it then runs both routes for one calibration window, measures the CPU time
each spends, and keeps the cheaper. Without timing, auto uses the flight recorder.
Durations are attributed to the step whose wall-time span holds the collective's enqueue.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable, Optional

from placement.monitor.comm import CommTiming
from placement.monitor.warn import WarnOnce, first_line

CALIBRATION_STEPS = 20


def timing_enabled_by_env(environ=os.environ) -> bool:
    return environ.get("TORCH_NCCL_ENABLE_TIMING", "0").strip().lower() in ("1", "true", "yes", "on")


def nccl_groups() -> list:
    """Every NCCL process group created so far (groups created later are not timed)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    groups = []
    for pg in list(getattr(c10d._world, "pg_map", {}).keys()):
        try:
            if dist.get_backend(pg) == "nccl":
                groups.append(pg)
        except Exception:
            continue
    return groups


def attribute(entries: list[tuple[float, float]], spans: list[tuple[float, float]]) -> list[Optional[float]]:
    """Sum of durations (ms) of the (enqueue wall time, duration ms) entries inside each
    [start, end) span; None for a span no entry fell in."""
    out: list[Optional[float]] = [None] * len(spans)
    for t, dur in entries:
        for i, (s, e) in enumerate(spans):
            if s <= t < e:
                out[i] = (out[i] or 0.0) + dur
                break
    return out


class _Ledger:
    """(enqueue wall time, duration ms) of finished collectives, fed from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: list[tuple[float, float]] = []

    def add(self, t: float, dur_ms: float) -> None:
        with self._lock:
            self._items.append((t, dur_ms))

    def extend(self, items: list[tuple[float, float]]) -> None:
        with self._lock:
            self._items.extend(items)

    def take_until(self, end: float) -> list[tuple[float, float]]:
        with self._lock:
            done = [x for x in self._items if x[0] < end]
            self._items = [x for x in self._items if x[0] >= end]
        return done


class NcclHookComm(CommTiming):
    name = "hook"
    timed_calls = False
    lag_steps = 2  # collectives of a step finish on the GPU after the CPU has moved on

    def __init__(self, warn: WarnOnce, enable_timing: bool):
        super().__init__(warn)
        self.ledger = _Ledger()
        self.cpu_ns = 0  # time spent in the hook callback (for calibration and the report)
        self.active = True
        for pg in nccl_groups():
            try:
                if enable_timing:
                    pg._enable_collectives_timing()
                pg._register_on_completion_hook(self._on_completion)
            except Exception as e:
                warn("nccl-hook", f"cannot register the NCCL completion hook: {first_line(e)}")

    def _on_completion(self, info) -> None:
        if not self.active:
            return
        t0 = time.perf_counter_ns()
        try:
            self.ledger.add(info.time_started.timestamp(), info.active_duration.total_seconds() * 1e3)
        except Exception as e:
            self.warn("nccl-hook-info", f"unreadable NCCL WorkInfo: {first_line(e)}")
        self.cpu_ns += time.perf_counter_ns() - t0

    def resolve(self, spans: list[tuple[float, float]]) -> list[Optional[float]]:
        if not spans:
            return []
        return attribute(self.ledger.take_until(spans[-1][1]), spans)

    def close(self) -> None:
        self.active = False  # a registered hook cannot be removed; it goes quiet
        super().close()


def _dump_json_fn() -> Optional[Callable[..., bytes]]:
    import torch._C._distributed_c10d as c10d

    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        fn = getattr(c10d, name, None)
        if fn is not None:
            return fn
    return None


def fr_entries(dump: dict, after_id: int) -> tuple[list[tuple[float, float]], int, int]:
    """NCCL collectives finished since record `after_id`, as (enqueue wall time s, duration ms),
    plus the highest record id seen and how many durations were coarse (no timing events)."""
    out, last, coarse = [], after_id, 0
    for e in dump.get("entries", []):
        rid = int(e.get("record_id", -1))
        if rid <= after_id or not str(e.get("profiling_name", "")).startswith("nccl:"):
            continue
        if e.get("state") != "completed":
            continue
        last = max(last, rid)
        created = e.get("time_created_ns")
        dur = e.get("duration_ms")
        if dur is None:
            done = e.get("time_discovered_completed_ns")
            if created is None or done is None:
                continue
            dur, coarse = (int(done) - int(created)) / 1e6, coarse + 1
        out.append((int(created) / 1e9, float(dur)))
    return out, last, coarse


class NcclFlightRecorderComm(CommTiming):
    name = "flight_recorder"
    timed_calls = False
    lag_steps = 2

    def __init__(self, warn: WarnOnce):
        super().__init__(warn)
        self._dump = _dump_json_fn()
        self._last_id = -1
        self.cpu_ns = 0
        self.ledger = _Ledger()
        if self._dump is None:
            warn("fr-missing", "this torch has no flight-recorder dump; NCCL comm time is not measured")

    def poll(self) -> None:
        if self._dump is None:
            return
        t0 = time.perf_counter_ns()
        try:
            dump = json.loads(self._dump(True, False))
        except Exception as e:
            self.warn("fr-dump", f"flight-recorder dump failed: {first_line(e)}")
            return
        items, self._last_id, coarse = fr_entries(dump, self._last_id)
        self.ledger.extend(items)
        self.cpu_ns += time.perf_counter_ns() - t0
        if coarse:
            self.warn("fr-coarse", "NCCL durations from flight-recorder discovery times (watchdog-polled, "
                                   "coarse): set placement.monitor.comm_timing=hook for exact GPU times "
                                   "(adds CUDA timing events)")

    def resolve(self, spans: list[tuple[float, float]]) -> list[Optional[float]]:
        if not spans:
            return []
        self.poll()
        return attribute(self.ledger.take_until(spans[-1][1]), spans)


class NcclAutoComm(CommTiming):
    """Timing already on: run both routes for CALIBRATION_STEPS steps, keep the cheaper."""

    name = "auto"
    timed_calls = False
    lag_steps = 2

    def __init__(self, warn: WarnOnce):
        super().__init__(warn)
        self.hook = NcclHookComm(warn, enable_timing=False)
        self.fr = NcclFlightRecorderComm(warn)
        self._steps = 0
        self.chosen: Optional[CommTiming] = None

    def resolve(self, spans: list[tuple[float, float]]) -> list[Optional[float]]:
        if self.chosen is not None:
            return self.chosen.resolve(spans)
        self.fr.poll()
        got = self.hook.resolve(spans)
        self.fr.ledger.take_until(spans[-1][1] if spans else 0.0)
        self._steps += len(spans)
        if self._steps >= CALIBRATION_STEPS:
            cheaper = self.hook if self.hook.cpu_ns <= self.fr.cpu_ns else self.fr
            other = self.fr if cheaper is self.hook else self.hook
            if other is self.hook:
                self.hook.active = False
            self.chosen = cheaper
            self.name = cheaper.name
            self.warn("nccl-chosen", f"NCCL comm timing: {cheaper.name} kept (CPU time over {self._steps} steps: "
                                     f"hook {self.hook.cpu_ns / 1e3:.0f} us, flight recorder {self.fr.cpu_ns / 1e3:.0f} us)")
        return got

    def close(self) -> None:
        self.hook.close()
        self.fr.close()
        super().close()


def choose_nccl_timing(mode: str, warn: WarnOnce) -> CommTiming:
    if mode == "hook":
        return NcclHookComm(warn, enable_timing=True)
    if mode == "flight_recorder":
        return NcclFlightRecorderComm(warn)
    if timing_enabled_by_env():
        return NcclAutoComm(warn)
    return NcclFlightRecorderComm(warn)
