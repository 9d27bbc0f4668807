"""The live metrics without a server: a rank's figures from real step records and events, their
Prometheus text by the conventions (units in names, `_total` counters, no `job`/`instance`/step
labels), a series count that stays bounded as a job runs, the per-node sum, and every failure
one line with the job running on."""
from __future__ import annotations

import json
import os
import socket
import time
import urllib.request

import pytest

prometheus_client = pytest.importorskip("prometheus_client", reason="the optional extra [metrics]")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import placement  # noqa: E402
from placement.config import load_config  # noqa: E402
from placement.errors import ConfigError  # noqa: E402
from placement.events import EventKind  # noqa: E402
from placement.metrics import names  # noqa: E402
from placement.metrics.exporter import Exporter, RankCollector, SnapshotCollector  # noqa: E402
from placement.metrics.rank import RankPublisher  # noqa: E402
from placement.metrics.state import RankMetrics, SnapshotFile, read_snapshot  # noqa: E402
from placement.records.step import RoleSample, StepRecord  # noqa: E402
from placement.roles import ThreadRole  # noqa: E402

LABELS = {"run": "r1", "rank": "0", "local_rank": "0", "node": "h0", "gpu_uuid": ""}


def _records(first: int, n: int, step_ms: float = 10.0) -> list[StepRecord]:
    return [StepRecord(0, s, 1000.0 + s, step_ms + (s % 7), data_ms=1.0, comm_ms=2.0 if s % 3 else None,
                       roles={ThreadRole.MAIN: RoleSample(threads=1, cpu_ms=5.0, runq_ms=0.5 * (s % 4))})
            for s in range(first, first + n)]


def _text(snapshots, per_rank: bool = True) -> str:
    registry = prometheus_client.CollectorRegistry(auto_describe=False)

    class C:
        def collect(self):
            from placement.metrics.render import families
            yield from families(snapshots, per_rank)

    registry.register(C())
    return prometheus_client.generate_latest(registry).decode()


def _samples(text: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def _busy_metrics() -> RankMetrics:
    m = RankMetrics(LABELS)
    m.add_records(_records(1, 50))
    m.on_event({"type": EventKind.STALL, "rank": 0, "phase": "stalled"})
    m.on_event({"type": EventKind.STALL, "rank": 3, "phase": "stalled"})  # rank 0 naming a peer: not its own
    m.on_event({"type": EventKind.BIND, "rank": 0, "drift": {"found": [1], "set": [0]}})
    m.on_event({"type": EventKind.TUNE, "rank": 0, "phase": "applied"})
    m.on_event({"type": EventKind.ROLLBACK, "rank": 0, "message": "runqueue rolled back: ...", "judged_steps": [41, 60]})
    m.on_event({"type": EventKind.ROLLBACK, "rank": 0, "message": "runqueue not applied: binding refused"})
    m.on_event({"type": EventKind.RESIDENCE, "rank": 0, "looks": [{"what": "process", "share_pct": 97.5}]})
    m.set_binding({"main": ("0", "0"), "other": ("2-5", "0")})
    m.judged([(1, "cpu-slow", 8.0, "h1")])
    return m


def test_the_parts_add_up_to_the_step_seconds_and_the_histogram_counts_every_step():
    recs = _records(1, 200)
    m = RankMetrics(LABELS)
    for i in range(0, 200, 20):
        m.add_records(recs[i:i + 20])
    snap = m.snapshot()
    s = snap["seconds"]
    assert snap["steps"] == 200 and snap["last_step"] == 200 and snap["last_step_t"] == recs[-1].t
    assert s["step"] == pytest.approx(sum(r.step_ms for r in recs) / 1e3)
    assert s["data"] + s["comm"] + s["cpu_stall"] + s["compute"] == pytest.approx(s["step"])
    assert s["comm"] == pytest.approx(sum(r.comm_ms or 0 for r in recs) / 1e3)  # a null comm counts none
    got = {(x.name, x.labels.get("le")): x.value for x in _samples(_text([snap]))}
    assert got[("placement_step_duration_seconds_count", None)] == 200
    assert got[("placement_step_duration_seconds_bucket", "+Inf")] == 200
    assert got[("placement_step_duration_seconds_bucket", "0.01")] == sum(1 for r in recs if r.step_ms <= 10.0)
    assert got[("placement_steps_total", None)] == 200


def test_names_and_labels_follow_prometheus_conventions():
    text = _text([_busy_metrics().snapshot()])
    fams = list(text_string_to_metric_families(text))
    assert {f.name for f in fams} >= {f.name for f in names.FAMILIES}
    for fam in fams:
        assert fam.name.startswith("placement_")
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam.name
        for s in fam.samples:
            assert not set(s.labels) & names.FORBIDDEN_LABELS, (s.name, s.labels)
    for f in names.FAMILIES:  # a unit or a plain count in every name
        assert f.name.endswith(("_seconds", "_ratio", "_info", "_step", "_hung", "_stalled")) or f.kind is names.Kind.COUNTER, f
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in _samples(text)}
    rank0 = tuple(sorted(LABELS.items()))
    assert values[("placement_hangs_total", rank0)] == 1 and values[("placement_hung", rank0)] == 1
    # the names before "hang" was one word, the same values for a release
    assert values[("placement_stalls_total", rank0)] == 1 and values[("placement_stalled", rank0)] == 1
    assert values[("placement_binding_drift_repaired_total", rank0)] == 1
    assert values[("placement_tuner_actions_total", tuple(sorted({**LABELS, "outcome": "applied"}.items())))] == 1
    assert values[("placement_tuner_actions_total", tuple(sorted({**LABELS, "outcome": "rolled_back"}.items())))] == 1
    assert values[("placement_tuner_actions_total", tuple(sorted({**LABELS, "outcome": "not_applied"}.items())))] == 1
    assert values[("placement_memory_residence_ratio", rank0)] == pytest.approx(0.975)
    straggler = tuple(sorted({"run": "r1", "rank": "1", "node": "h1", "cause": "cpu-slow"}.items()))
    assert values[("placement_straggler_windows_total", straggler)] == 1
    assert values[("placement_straggler_cost_ratio", straggler)] == pytest.approx(0.08)
    main = tuple(sorted({**LABELS, "role": "main", "cpus": "0", "numa": "0"}.items()))
    assert values[("placement_binding_info", main)] == 1


def test_a_straggler_no_longer_named_keeps_its_count_and_its_cost_goes_to_zero():
    m = _busy_metrics()
    m.judged([])
    (s,) = [x for x in _samples(_text([m.snapshot()])) if x.name == "placement_straggler_cost_ratio"]
    assert s.value == 0.0
    (w,) = [x for x in _samples(_text([m.snapshot()])) if x.name == "placement_straggler_windows_total"]
    assert w.value == 1


def test_the_series_count_stays_bounded_as_a_job_runs_for_weeks():
    m = _busy_metrics()
    early = len(_samples(_text([m.snapshot()])))
    for k in range(200):  # 200 batches of 50 steps, stalls, tuner actions and windows all along
        m.add_records(_records(51 + 50 * k, 50, step_ms=1.0 + k))
        m.on_event({"type": EventKind.STALL, "rank": 0, "phase": "stalled" if k % 2 else "resumed"})
        m.on_event({"type": EventKind.TUNE, "rank": 0, "phase": "kept"})
        m.judged([(1, "cpu-slow", 5.0, "h1")] if k % 3 else [])
    late = _samples(_text([m.snapshot()]))
    assert len(late) == early  # every outcome is a series from the start; no step, no time in a label
    assert {s.labels.get("step") for s in late} == {None}


def test_a_node_aggregate_sums_its_ranks_under_run_and_node_labels_only():
    a, b = RankMetrics(LABELS), RankMetrics({**LABELS, "rank": "1", "local_rank": "1"})
    a.add_records(_records(1, 30))
    b.add_records(_records(1, 20, step_ms=20.0))
    b.on_event({"type": EventKind.STALL, "rank": 1, "phase": "stalled"})
    samples = _samples(_text([a.snapshot(), b.snapshot()], per_rank=False))
    for s in samples:
        if s.name.startswith(("placement_steps", "placement_hung")):
            assert set(s.labels) == {"run", "node"}
    got = {s.name: s.value for s in samples if not s.labels.get("le") and not s.labels.get("outcome")}
    assert got["placement_steps_total"] == 50 and got["placement_hung"] == 1
    assert got["placement_step_seconds_total"] == pytest.approx(
        (sum(r.step_ms for r in _records(1, 30)) + sum(r.step_ms for r in _records(1, 20, 20.0))) / 1e3)
    assert got["placement_last_step"] == 20  # the node's lagging rank


def test_snapshots_are_written_whole_and_a_bad_one_is_counted_and_said_once(tmp_path):
    said = []
    m = _busy_metrics()
    f = SnapshotFile(m, str(tmp_path), 0, every_s=3600.0, warn=lambda k, line: said.append(line))
    f.publish()
    assert read_snapshot(str(tmp_path / "rank0.json"))["steps"] == 50
    m.add_records(_records(51, 5))
    f.publish()  # within every_s: not written
    assert read_snapshot(str(tmp_path / "rank0.json"))["steps"] == 50
    f.publish(force=True)
    assert read_snapshot(str(tmp_path / "rank0.json"))["steps"] == 55
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    (tmp_path / "rank1.json").write_text("{not json")
    (tmp_path / "rank2.json").write_text(json.dumps({"version": 99}))
    c = SnapshotCollector(str(tmp_path), True, said.append)
    registry = _registry(c)
    prometheus_client.generate_latest(registry)
    text = prometheus_client.generate_latest(registry).decode()  # two scrapes, two bad files each
    assert c.lost == 4 and len(said) == 1 and "rank1.json" in said[0]
    assert [s.value for s in _samples(text) if s.name == "placement_metrics_lost_total"] == [4]
    assert [s.value for s in _samples(text) if s.name == "placement_steps_total"] == [55]


def _registry(collector):
    r = prometheus_client.CollectorRegistry(auto_describe=False)
    r.register(collector)
    return r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_port_in_use_is_one_line_and_nothing_stops(tmp_path):
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    said = []
    try:
        e = Exporter(RankCollector(_busy_metrics()), taken.getsockname()[1], None, 1.0, said.append).start()
        assert not e.serving and len(said) == 1 and "cannot be served" in said[0] and "\n" not in said[0]
        e.close()
    finally:
        taken.close()


def test_an_unwritable_textfile_directory_is_one_line(tmp_path):
    said = []
    e = Exporter(RankCollector(_busy_metrics()), 0, "/proc/placement-no/placement.prom", 0.1, said.append).start()
    deadline = time.monotonic() + 30
    while not said and time.monotonic() < deadline:
        time.sleep(0.05)
    e.close()
    assert len(said) == 1 and "cannot be written" in said[0]


def test_bad_metrics_keys_are_one_line_naming_the_valid_values():
    for words, expect in ((["placement.metrics.port=70000"], "[0, 65535]"),
                          (["placement.metrics.publish_every_s=0"], "[0.1, 3600.0]"),
                          (["placement.metrics.per_rank=maybe"], "placement.metrics.per_rank")):
        with pytest.raises(ConfigError) as e:
            load_config(words)
        assert expect in str(e.value) and "\n" not in str(e.value)


def test_attach_without_placerun_serves_the_rank_on_port_plus_local_rank(tmp_path):
    port = _free_port()
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0, "flush_every": 10},
                         metrics={"port": port, "textfile_dir": str(tmp_path)})
    try:
        for _ in range(25):
            time.sleep(0.002)
            h.step()
        deadline, steps = time.monotonic() + 60, 0.0
        while time.monotonic() < deadline:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            steps = sum(s.value for s in _samples(text) if s.name == "placement_steps_total")
            if steps >= 20:
                break
            time.sleep(0.1)
        assert steps >= 20
        assert 'rank="0"' in text and 'local_rank="0"' in text
    finally:
        h.close()
    written = (tmp_path / "placement_rank0.prom").read_text()  # the textfile keeps the last figures
    assert sum(s.value for s in _samples(written) if s.name == "placement_steps_total") == 25


def test_a_publisher_follows_a_tuner_move_in_its_binding_series():
    m = RankMetrics(LABELS)
    p = RankPublisher(m)
    p.set_binding({"main": [0], "nccl": [1]}, [0])
    p.on_event({"type": EventKind.TUNE, "rank": 0, "phase": "applied", "role": "main", "change": {"from": [0], "to": [2, 3]}})
    assert m.snapshot()["binding"] == {"main": ["2-3", "0"], "nccl": ["1", "0"]}


def _placerun(tmp_path, keys: list[str], iters: int = 40):
    from placerun_helpers import JOBS, REPO, launcher
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLACEMENT_", "OMP_NUM_THREADS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([*launcher("placerun"), "--standalone", "--nproc-per-node", "2",
                           f"placement.monitor.log_dir={tmp_path / 'logs'}", *keys, str(JOBS / "auto_loops.py"),
                           "plain", "--iters", str(iters)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_placerun_writes_the_node_textfile_with_every_rank_and_a_taken_port_is_one_line(tmp_path):
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    try:
        p = _placerun(tmp_path, [f"placement.metrics.textfile_dir={tmp_path}",
                                 f"placement.metrics.port={taken.getsockname()[1]}"])
    finally:
        taken.close()
    assert p.returncode == 0, p.stderr[-3000:]
    said = [line for line in p.stderr.splitlines() if "metrics port" in line]
    assert len(said) == 1 and said[0].startswith("placerun: metrics port"), p.stderr[-3000:]
    samples = _samples((tmp_path / "placement.prom").read_text())
    steps = {s.labels["rank"]: s.value for s in samples if s.name == "placement_steps_total"}
    assert set(steps) == {"0", "1"} and all(v > 0 for v in steps.values()), steps
    roles = {s.labels["role"] for s in samples if s.name == "placement_binding_info" and s.labels["rank"] == "0"}
    assert "main" in roles
    logs = [json.loads(line) for line in (tmp_path / "logs" / "rank0.jsonl").read_text().splitlines()]
    recorded = sum(e.get("steps", 1) for e in logs if e["type"] == "step")  # (a record may hold several steps)
    assert steps["0"] == recorded  # the exporter shows what the log holds, every step
