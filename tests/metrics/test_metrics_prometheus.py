"""The live metrics against a real Prometheus server (Debian's `prometheus`, installed by
`./dev.sh test`): a 2-rank job under placerun with one rank slowed 30%, its node's endpoint
scraped every second; the queries return each rank's steps, the parts that add up to the step
time, the straggler while it is named, and data for every panel of the shipped Grafana dashboard.
And the textfile: what node_exporter would read, whole, after the job."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from placerun_helpers import JOBS, REPO, free_port, launcher

pytest.importorskip("prometheus_client", reason="the optional extra [metrics]")
PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (./dev.sh test installs it)")]
DASHBOARD = REPO / "launch" / "grafana" / "placement.json"
WAIT_S = 240.0


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLACEMENT_", "OMP_NUM_THREADS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


class Prometheus:
    def __init__(self, tmp: Path, target_port: int):
        self.port = free_port()
        cfg = tmp / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                       "scrape_configs:\n  - job_name: placement\n    static_configs:\n"
                       f"      - targets: ['127.0.0.1:{target_port}']\n")
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=5).status == 200:
                    return
            except OSError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, (tmp / "prometheus.log").read_text()
            time.sleep(0.2)

    def query(self, expr: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        got = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert got["status"] == "success", got
        return got["data"]["result"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=20)
        self.log.close()


def _until(what, check, job: subprocess.Popen, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        assert job.poll() is None, f"the job ended before {what}"
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout:.0f} s")


def _panel_queries() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    # Grafana's own variables, as Grafana fills them: every run, a rate window of several scrapes.
    return [t["expr"].replace("$__rate_interval", "15s").replace("$run", ".*")
            for p in d["panels"] for t in p["targets"]]


def test_a_real_prometheus_sees_each_rank_its_parts_the_straggler_and_every_dashboard_panel(tmp_path):
    port = free_port("0.0.0.0")
    prom = Prometheus(tmp_path, port)
    job = subprocess.Popen(
        [*launcher("placerun"), "--standalone", "--nproc-per-node", "2", f"placement.monitor.log_dir={tmp_path / 'logs'}",
         f"placement.metrics.port={port}", f"placement.metrics.textfile_dir={tmp_path}",
         "placement.monitor.straggler_steady_pct=75", "placement.monitor.residence_every_s=1",
         str(JOBS / "auto_loops.py"), "plain", "--iters", "3000", "--delay", "0", "--work-ms", "10",
         "--slow-rank", "1", "--slow-ms", "3"],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        named = _until("straggler named", lambda: prom.query("placement_straggler_cost_ratio > 0"), job)
        assert {r["metric"]["rank"] for r in named} == {"1"}, named
        assert named[0]["metric"]["cause"] in ("compute-slow", "cpu-slow")
        steps = prom.query("placement_steps_total")
        assert {r["metric"]["rank"] for r in steps} == {"0", "1"} and all(float(r["value"][1]) > 0 for r in steps)
        for r in steps:
            assert not {"step"} & set(r["metric"]) and r["metric"]["job"] == "placement"  # Prometheus' own job
        gaps = prom.query("abs(placement_data_wait_seconds_total + placement_comm_wait_seconds_total"
                          " + placement_cpu_stall_seconds_total + placement_compute_seconds_total"
                          " - placement_step_seconds_total)")
        assert len(gaps) == 2 and all(float(r["value"][1]) < 1e-6 for r in gaps), gaps
        empty = []
        deadline = time.monotonic() + WAIT_S
        for expr in _panel_queries():  # each panel returns data (rates need a few scrapes: waited for)
            while not prom.query(expr) and time.monotonic() < deadline and job.poll() is None:
                time.sleep(0.5)
            if not prom.query(expr):
                empty.append(expr)
        assert not empty, empty
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
        out = job.communicate(timeout=120)[0]
        prom.close()
    written = (tmp_path / "placement.prom").read_text()  # the agent's textfile, written at its close
    from prometheus_client.parser import text_string_to_metric_families

    ranks = {s.labels["rank"] for f in text_string_to_metric_families(written) for s in f.samples
             if s.name == "placement_steps_total"}
    assert ranks == {"0", "1"}, out[-3000:]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
