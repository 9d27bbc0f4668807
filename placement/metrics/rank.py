"""A rank's side of the metrics: what feeds its RankMetrics, and where they go.

What
    RankPublisher is a record sink of the rank's monitor (monitor/sinks: write() per batch, on
    the monitor thread), a tap on the rank's event log (on_event), and rank 0's listener for
    judged exchange windows (judged). Under placerun with metrics on, it writes the snapshot the
    node's exporter reads (state.SnapshotFile); started without placerun (attach()), it serves
    its own figures on placement.metrics.port + local_rank and/or writes
    `placement_rank<R>.prom` into placement.metrics.textfile_dir (exporter.py).
"""
from __future__ import annotations

import os
import socket
from typing import Any, Callable, Iterable, Mapping, Optional

from placement.config import MetricsConfig
from placement.cpuset import format_cpulist
from placement.events import EventKind
from placement.metrics.exporter import EXTRA_LINE, Exporter, RankCollector, available
from placement.metrics.state import METRICS_DIR_ENV, RankMetrics, SnapshotFile


class RankPublisher:
    name = "metrics"  # as a record sink

    def __init__(self, metrics: RankMetrics, snapshot: Optional[SnapshotFile] = None,
                 exporter: Optional[Exporter] = None):
        self.metrics = metrics
        self.snapshot = snapshot
        self.exporter = exporter
        self.on_close: Optional[Callable[[], None]] = None  # set by whoever taps it into a log

    def set_binding(self, roles: Mapping[str, Iterable[int]], numa: Iterable[int]) -> None:
        nodes = format_cpulist(sorted(numa))
        self.metrics.set_binding({role: (format_cpulist(sorted(cpus)), nodes) for role, cpus in roles.items()})
        self._publish()

    def write(self, batch) -> None:
        self.metrics.add_records(batch)
        self._publish()

    def on_event(self, rec: Mapping[str, Any]) -> None:
        self.metrics.on_event(rec)
        self._publish(force=rec.get("type") == EventKind.STALL)  # a hung rank builds no batch: say it now

    def judged(self, named: Iterable[tuple[int, str, Optional[float], Optional[str]]]) -> None:
        self.metrics.judged(named)
        self._publish()

    def _publish(self, force: bool = False) -> None:
        if self.snapshot is not None:
            self.snapshot.publish(force)

    def close(self) -> None:
        if self.on_close is not None:
            self.on_close()
            self.on_close = None
        self._publish(force=True)
        if self.exporter is not None:
            self.exporter.close()


_process_metrics: Optional[RankMetrics] = None  # this process's rank's figures, across monitors


def rank_labels(run: Optional[str], rank: int, local_rank: int, gpu_uuid: Optional[str] = None) -> dict[str, str]:
    return {"run": run or "", "rank": str(rank), "local_rank": str(local_rank), "node": socket.gethostname(),
            "gpu_uuid": gpu_uuid or ""}


def start_rank_metrics(cfg: MetricsConfig, labels: Mapping[str, str], rank: int, local_rank: int, warn,
                       environ: Mapping[str, str] = os.environ) -> Optional[RankPublisher]:
    """The rank's publisher, or None when metrics are off. `warn(key, line)`: said once each. A
    monitor that takes over from another in this process (attach() after placerun's automatic
    one) goes on with its figures: counters never go back."""
    global _process_metrics
    directory = environ.get(METRICS_DIR_ENV)
    if not directory:
        if not cfg.port and not cfg.textfile_dir:
            return None
        if not available():
            warn("metrics-extra", EXTRA_LINE)
            return None
    metrics = _process_metrics
    if metrics is None or metrics.labels != dict(labels):
        metrics = _process_metrics = RankMetrics(labels)
    if directory:  # placerun's agent exports this node's ranks
        return RankPublisher(metrics, snapshot=SnapshotFile(metrics, directory, rank, cfg.publish_every_s, warn))
    textfile = os.path.join(cfg.textfile_dir, f"placement_rank{rank}.prom") if cfg.textfile_dir else None
    exporter = Exporter(RankCollector(metrics), cfg.port + local_rank if cfg.port else 0, textfile,
                        cfg.publish_every_s, say=lambda line: warn("metrics-export", line)).start()
    return RankPublisher(metrics, exporter=exporter)
