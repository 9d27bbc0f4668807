"""One rank's figures as Prometheus exports them, kept on the rank's monitor thread and published
as a small JSON snapshot (or served / written by the rank itself without placerun).

What
    RankMetrics adds up what the monitor already has: each batch of step records (the parts of a
    step, records/parts.py, as counters; the step-time histogram; the last step), the events the
    rank's log receives (stalls, drift repaired, tuner actions, memory residence: on_event, a tap
    on events.EventLog), each window rank 0 judged (judged: who is named a straggler, why, what
    it costs, and who no longer is), and the rank's binding (set_binding). snapshot() is a plain
    dict; render.py turns snapshots into Prometheus families.

Why a snapshot file under placerun
    The node's exporter lives in the placerun agent (one endpoint per node, as DCGM's exporter),
    and a rank hands it its figures by writing `rank<R>.json` into a directory the agent named
    (PLACEMENT_METRICS_DIR), atomically (temp file + rename), at most every publish_every_s and
    only when something changed: no socket to keep, nothing on the training thread, and a rank
    that dies leaves its last figures readable. The agent reads the files at each scrape.

Cost
    On the monitor thread: a few float additions per step record, and one file of ~3 KB written
    at most once a second.
"""
from __future__ import annotations

import bisect
import json
import os
import threading
import time
from typing import Any, Iterable, Mapping, Optional, Sequence

from placement.cpuset import format_cpulist
from placement.events import EventKind
from placement.metrics.names import STEP_BUCKETS, TunerOutcome
from placement.records.parts import record_parts
from placement.records.step import step_times
from placement.roles import OWN_THREADS

SNAPSHOT_VERSION = 1
SNAPSHOT_MAX = 1 << 20  # bytes of one snapshot the exporter reads at most
METRICS_DIR_ENV = "PLACEMENT_METRICS_DIR"  # set by placerun: where its ranks publish their snapshots


def snapshot_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.json")


def write_atomically(path: str, text: str) -> None:
    """Write `text` to `path` through a temp file and a rename: a reader sees the old file or the
    new one, never half of one (node_exporter's textfile collector asks the same)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class RankMetrics:
    """The counters, gauges and histogram of one rank; thread-safe (events arrive from the
    binder's watcher and rank 0's peer watch as well as the monitor thread)."""

    def __init__(self, labels: Mapping[str, str]):
        self.labels = dict(labels)
        self._lock = threading.Lock()
        self.changes = 0  # bumped by every update: a publisher writes only when it moved
        self.steps = 0
        # own_cpu: placement's own threads' CPU in this process (roles.OWN_THREADS), as of the last batch
        self.seconds = {"step": 0.0, "data": 0.0, "comm": 0.0, "cpu_stall": 0.0, "compute": 0.0, "own_cpu": 0.0}
        self.buckets = [0] * len(STEP_BUCKETS)  # steps per bucket (not cumulative); the rest are +Inf
        self.last_step = 0
        self.last_step_t: Optional[float] = None
        self.stalls = 0
        self.stalled = 0
        self.drift = 0
        self.tuner = {o.value: 0 for o in TunerOutcome}
        self.residence: Optional[float] = None
        self.binding: dict[str, tuple[str, str]] = {}  # role -> (cpu list, numa list)
        # rank 0 only: rank -> {"node": host, "windows": {cause: n}, "cost": {cause: ratio}}
        self.stragglers: dict[int, dict[str, Any]] = {}

    # ---- fed by the monitor -------------------------------------------------------------
    def add_records(self, batch: Sequence) -> None:
        """A batch of StepRecords (a RecordSink's write)."""
        if not batch:
            return
        with self._lock:
            s = self.seconds
            for rec in batch:
                parts = record_parts(rec)
                n = rec.steps  # a record of n steps: its parts are per-step means (records/step.py)
                self.steps += n
                s["data"] += parts.data_ms * n / 1e3
                s["comm"] += parts.comm_ms * n / 1e3
                s["cpu_stall"] += (parts.cpu_stall_ms or 0.0) * n / 1e3
                s["compute"] += parts.compute_ms * n / 1e3
                for ms in step_times(rec):
                    step_s = max(ms, 0.0) / 1e3 if ms == ms else 0.0
                    s["step"] += step_s
                    i = bisect.bisect_left(STEP_BUCKETS, step_s)  # the first edge >= the step
                    if i < len(STEP_BUCKETS):
                        self.buckets[i] += 1
            s["own_cpu"] = OWN_THREADS.cpu_ns() / 1e9
            last = batch[-1]
            self.last_step, self.last_step_t = last.step, last.t
            self.changes += 1

    def on_event(self, rec: Mapping[str, Any]) -> None:
        """An event of this rank's log (events.EventLog's tap): what the metrics count of it."""
        kind = rec.get("type")
        with self._lock:
            if kind == EventKind.STALL:
                if str(rec.get("rank")) != self.labels.get("rank"):
                    return  # rank 0 naming a peer: the peer's own exporter counts its stall
                if rec.get("phase") == "resumed":
                    self.stalled = 0
                else:
                    self.stalls += 1
                    self.stalled = 1
            elif kind == EventKind.BIND and rec.get("drift"):
                self.drift += 1
            elif kind == EventKind.TUNE and rec.get("phase") in ("applied", "kept"):
                self.tuner[TunerOutcome.APPLIED.value if rec["phase"] == "applied" else TunerOutcome.KEPT.value] += 1
                if rec["phase"] == "applied":
                    self._moved(rec)
            elif kind == EventKind.ROLLBACK:  # judged and undone, or refused by the binder before it took force
                outcome = TunerOutcome.ROLLED_BACK if "judged_steps" in rec else TunerOutcome.NOT_APPLIED
                self.tuner[outcome.value] += 1
                self._moved(rec)
            elif kind == EventKind.RESIDENCE:
                looks = [lk for lk in rec.get("looks") or () if lk.get("what") == "process"]
                share = looks[0].get("share_pct") if looks else None
                if share is None:
                    return
                self.residence = share / 100.0
            else:
                return
            self.changes += 1

    def _moved(self, rec: Mapping[str, Any]) -> None:
        """A tuner event that set a role's CPUs (applied, or put back): its binding series follows
        (the caller holds the lock)."""
        role, change = rec.get("role"), rec.get("change")
        if role in self.binding and change:
            self.binding[role] = (format_cpulist(sorted(change["to"])), self.binding[role][1])

    def judged(self, named: Iterable[tuple[int, str, Optional[float], Optional[str]]]) -> None:
        """Rank 0: one judged exchange window, as (rank, cause, cost % of step, host) per rank
        named a straggler; every rank not named in it has its cost gauge back at 0."""
        with self._lock:
            seen = set()
            for rank, cause, cost_pct, host in named:
                s = self.stragglers.setdefault(rank, {"node": host or "", "windows": {}, "cost": {}})
                s["windows"][cause] = s["windows"].get(cause, 0) + 1
                s["cost"] = {cause: 0.0 if cost_pct is None else cost_pct / 100.0}
                seen.add(rank)
            for rank, s in self.stragglers.items():
                if rank not in seen:
                    s["cost"] = {c: 0.0 for c in s["cost"]}
            self.changes += 1

    def set_binding(self, roles: Mapping[str, tuple[str, str]]) -> None:
        """role -> (CPU list, NUMA node list), as the kernel's list format writes them."""
        with self._lock:
            self.binding = dict(roles)
            self.changes += 1

    # ---- read by a publisher ------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"version": SNAPSHOT_VERSION, "labels": dict(self.labels), "steps": self.steps,
                    "seconds": dict(self.seconds), "buckets": list(self.buckets), "last_step": self.last_step,
                    "last_step_t": self.last_step_t, "stalls": self.stalls, "stalled": self.stalled,
                    "drift": self.drift, "tuner": dict(self.tuner), "residence": self.residence,
                    "binding": {r: list(v) for r, v in self.binding.items()},
                    "stragglers": {str(r): {"node": s["node"], "windows": dict(s["windows"]), "cost": dict(s["cost"])}
                                   for r, s in self.stragglers.items()}}


class SnapshotFile:
    """Publishes a RankMetrics as `rank<R>.json` in the agent's directory, at most every
    `every_s` and only when it changed; `warn(key, line)` hears of a write that failed (said
    once: the job runs on)."""

    def __init__(self, metrics: RankMetrics, directory: str, rank: int, every_s: float, warn):
        self.metrics = metrics
        self.path = snapshot_path(directory, rank)
        self.every_s = every_s
        self._warn = warn
        self._written = -1  # metrics.changes at the last write
        self._next = 0.0
        self._lock = threading.Lock()  # the monitor thread and an event's thread may both publish
        self.failed = 0  # writes that failed

    def publish(self, force: bool = False) -> None:
        """Write the snapshot if it changed and every_s passed (`force`: whenever it changed)."""
        now = time.monotonic()
        if self.metrics.changes == self._written or (not force and now < self._next):
            return
        if not self._lock.acquire(timeout=1.0):
            return  # another thread is writing it now
        try:
            self._next = now + self.every_s
            changes = self.metrics.changes
            write_atomically(self.path, json.dumps(self.metrics.snapshot(), separators=(",", ":")))
            self._written = changes
        except OSError as e:
            self.failed += 1
            self._warn("metrics-snapshot", f"metrics snapshot not written to {self.path} ({e.strerror or e}); "
                                           "the node's exporter shows this rank's last one (counted, said once)")
        finally:
            self._lock.release()


def read_snapshot(path: str) -> dict[str, Any]:
    """One rank's snapshot; ValueError when it is not one (too large, not JSON, another version)."""
    with open(path, "rb") as f:
        raw = f.read(SNAPSHOT_MAX + 1)
    if len(raw) > SNAPSHOT_MAX:
        raise ValueError(f"larger than {SNAPSHOT_MAX} bytes")
    snap = json.loads(raw)
    if not isinstance(snap, dict) or snap.get("version") != SNAPSHOT_VERSION:
        raise ValueError("not a placement metrics snapshot of this version")
    return snap
