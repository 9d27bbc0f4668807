"""Where the metrics are read: a `/metrics` endpoint, a node_exporter textfile, or both.

What
    Exporter serves one prometheus_client registry on placement.metrics.port (all interfaces, as
    DCGM's exporter on :9400) and/or writes it every publish_every_s to
    `<placement.metrics.textfile_dir>/<name>.prom` (prometheus_client's write_to_textfile: a temp
    file renamed over the old one). Its collector is either
    - SnapshotCollector, in the placerun agent: every rank's snapshot in the directory the agent
      named (state.py), read at each scrape; or
    - RankCollector, in a rank started without placerun (attach()): that rank's own figures, on
      port + local_rank, or a textfile of its own.

Never in the way
    A port in use or refused, an unwritable textfile directory, a snapshot that cannot be read:
    one line each (said once), and the job runs on. Nothing here runs on a training thread:
    the server and the textfile writer are threads of their own (role `other` under placerun).
"""
from __future__ import annotations

import os
import re
import threading
from typing import Callable, Iterator, Optional

from placement import errors
from placement.metrics import names
from placement.metrics.render import families
from placement.metrics.state import RankMetrics, read_snapshot

_SNAPSHOT = re.compile(r"^rank\d+\.json$")
EXTRA_LINE = "metrics need prometheus-client: pip install 'placement[metrics]'; the job runs without them"


def available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


class SnapshotCollector:
    """The ranks' snapshots in `directory`, read at each collect()."""

    def __init__(self, directory: str, per_rank: bool, say: Callable[[str], None]):
        self.directory = directory
        self.per_rank = per_rank
        self._say = say
        self.lost = 0  # snapshots that could not be read
        self._said = False

    def snapshots(self) -> list[dict]:
        out = []
        try:
            entries = sorted(os.listdir(self.directory))
        except OSError:
            return out
        for name in entries:
            if not _SNAPSHOT.match(name):
                continue
            try:
                out.append(read_snapshot(os.path.join(self.directory, name)))
            except FileNotFoundError:
                continue  # replaced between the listing and the read
            except (OSError, ValueError) as e:
                self.lost += 1
                if not self._said:
                    self._said = True
                    self._say(f"metrics: {name} in {self.directory} could not be read ({e}); "
                              "counted in placement_metrics_lost_total")
        return out

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily

        yield from families(self.snapshots(), self.per_rank)
        lost = CounterMetricFamily(names.LOST.name, names.LOST.help, labels=[])
        lost.add_metric([], self.lost)
        yield lost


class RankCollector:
    """One rank's own figures, from its RankMetrics in memory."""

    def __init__(self, metrics: RankMetrics, per_rank: bool = True):
        self.metrics = metrics
        self.per_rank = per_rank

    def collect(self) -> Iterator:
        yield from families([self.metrics.snapshot()], self.per_rank)


class Exporter:
    """Serve `collector` on `port` (0: no endpoint) and/or write it to `textfile` (None: none)
    every `every_s`. `say(line)` is told what goes wrong, once each."""

    def __init__(self, collector, port: int, textfile: Optional[str], every_s: float,
                 say: Callable[[str], None] = lambda line: errors.say(f"placement: {line}")):
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.port = port
        self.textfile = textfile
        self.every_s = every_s
        self._say = say
        self._server = None
        self._stop = threading.Event()
        self._writer: Optional[threading.Thread] = None
        self._text_failed = False
        self.serving = False

    def start(self) -> "Exporter":
        if self.port:
            from prometheus_client import start_http_server

            try:
                got = start_http_server(self.port, registry=self.registry)
                self._server = got[0] if isinstance(got, tuple) else None
                self.serving = True
            except (OSError, OverflowError) as e:  # in use, refused; past 65535 (port + local rank)
                self._say(f"metrics port {self.port} cannot be served ({getattr(e, 'strerror', None) or e}); no /metrics "
                          "endpoint here, the job runs on (placement.metrics.port)")
        if self.textfile:
            self._writer = threading.Thread(target=self._write_loop, name="placement_metrics", daemon=True)
            self._writer.start()
        return self

    def write_textfile(self) -> None:
        from prometheus_client import write_to_textfile

        try:
            write_to_textfile(self.textfile, self.registry)
        except OSError as e:
            if not self._text_failed:
                self._text_failed = True
                self._say(f"metrics textfile {self.textfile} cannot be written ({e.strerror or e}); "
                          "the job runs on (placement.metrics.textfile_dir)")

    def _write_loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.write_textfile()

    def close(self) -> None:
        self._stop.set()
        if self._writer is not None:
            self._writer.join(timeout=5.0)
            self.write_textfile()  # the job's last figures stay for node_exporter to read
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
