"""`placement report` over several nodes' logs written by the real monitor: the cluster summary
(who held the job back, hung ranks first, per-node figures), the heatmap PNG and the Chrome
trace-event file (validated against the format: traceEvents, ph, ts, pid, tid)."""
import json
import os
import struct
import time

import pytest

import placement
from placement.monitor.health.peers import peer_event, write_peer_hang
from placement.cli import main as cli
from placement.events import EventLog
from placement.records.step import RoleSample, StepRecord, record_steps, step_times
from placement.report.logs import read_logs
from placement.report.text import summaries

STEPS = 30


def _node_logs(tmp_path):
    """Ranks 0-1 on node 0, ranks 2-3 on node 1 (GROUP_RANK, as torch elastic sets it), each a
    real monitor run into its node's own directory; rank 3 sleeps longest in its steps. Rank 0
    names rank 3 cpu-slow in two windows and rank 2 stalled, as its exchange would."""
    for rank in range(4):
        node = rank // 2
        env = {"RANK": str(rank), "GROUP_RANK": str(node)}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            h = placement.attach(policy="none", tune={"enabled": False},
                                 monitor={"log_dir": str(tmp_path / f"node{node}"), "flush_every": 5,
                                          "summary_every": 0})
            for step in range(1, STEPS + 1):
                with h.comm():
                    time.sleep(0.0005)
                time.sleep(0.004 if rank == 3 else 0.001)
                h.step()
                if rank == 0 and step in (10, 20):
                    h.events.event("straggler", steps=[step - 9, step], waiting=[0, 1, 2], transfer_ms=0.4,
                                   stragglers=[{"kind": "cpu-slow", "ranks": [3], "lateness_ms": 3.0, "why": "test"}])
                if rank == 0 and step == 25:  # rank 2's post as rank 0's peer watch writes it
                    write_peer_hang(h.events, peer_event({
                        "phase": "stalled", "rank": 2, "last_step": 24, "stalled_s": 31.2, "threshold_s": 30.0,
                        "main": {"tid": 4242, "state": "S", "wchan": "futex_do_wait",
                                 "stack": ['File "train.py", line 7 in all_reduce']}}))
            h.close()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def test_cluster_summary_names_holders_stalled_first_and_per_node_figures(tmp_path, capsys):
    _node_logs(tmp_path)
    assert cli(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.index("hung (1):") < out.index("held the job back")
    assert "rank 2 (node 1" in out and "last step 24" in out
    assert "main thread S in futex_do_wait, Python at File \"train.py\", line 7 in all_reduce (named by rank 0)" in out
    held = [l for l in out.splitlines() if l.strip().startswith("cpu-slow")]
    assert held and "3 in 2" in held[0] and "[node 1" in held[0], held
    nodes = out.split("per node (2):")[1].splitlines()[3:5]
    rows = {l.split(")")[0] + ")": l.split(")", 1)[1].split() for l in nodes}
    assert [k.split(" (")[0] for k in rows] == ["node 0", "node 1"]
    n0, n1 = rows.values()
    assert n0[0] == n1[0] == "2" and n0[1] == n1[1] == str(2 * STEPS)
    assert float(n1[2]) > float(n0[2])  # node 1 holds the rank that slept longest
    assert n1[-3] == "3" and n1[-1] == "2" and n0[-1] == "0"  # slowest rank, straggler windows


def test_globs_and_directories_read_the_same_and_the_columns_agree_with_the_records(tmp_path, capsys):
    _node_logs(tmp_path)
    by_dir = read_logs([str(tmp_path)])
    by_glob = read_logs([str(tmp_path / "node*" / "rank*.jsonl")])
    assert by_dir.files == by_glob.files and len(by_dir.files) == 4
    assert by_dir.node == by_glob.node and by_dir.node[0] == by_dir.node[1] != by_dir.node[3]
    assert len(by_dir) == 4 * STEPS
    log = by_dir  # one reading holds both: the columns and, for a few ranks, the StepRecords
    for s in summaries(log):
        sl = by_dir.rank_slices()[s.rank]
        recs = log.records[s.rank]
        # a row per step, a record of several steps (records/step.py) a row each
        assert list(by_dir.step[sl]) == [s for r in recs for s in record_steps(r)]
        assert list(by_dir.step_ms[sl]) == [t for r in recs for t in step_times(r)]
    assert cli(["report", str(tmp_path / "nowhere*" / "*.jsonl")]) == 2
    assert "matches no file" in capsys.readouterr().err


def test_heatmap_and_trace_are_written_and_parse(tmp_path, capsys):
    _node_logs(tmp_path)
    png, trace = tmp_path / "heat.png", tmp_path / "trace.json"
    assert cli(["report", str(tmp_path), "--heatmap", str(png), "--trace", str(trace)]) == 0
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    import matplotlib.image

    assert matplotlib.image.imread(str(png)).shape[:2] == (height, width) and width > 1000

    doc = json.loads(trace.read_text())
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert e["ph"] in {"X", "i", "C", "M"}, e
        assert isinstance(e["ts"], (int, float)) and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert isinstance(e["name"], str)
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] == "i":
            assert e["s"] in {"t", "p", "g"}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["rank 0", "rank 1", "rank 2", "rank 3"]
    pid = {tid: p for p, tid in names}
    assert pid[0] == pid[1] != pid[2] == pid[3]  # one process per node, one track per rank
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs[pid[0]].startswith("node 0") and procs[pid[2]].startswith("node 1")
    steps = [e for e in events if e["ph"] == "X" and e["cat"] == "step"]
    assert len(steps) == 4 * STEPS
    # Every part of a step lies inside its step slice on the same track (so viewers nest them).
    by_track = {}
    for e in steps:
        by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    for e in events:
        if e["ph"] == "X" and e["cat"] != "step":
            # (epoch microseconds as doubles resolve to 0.25 us: compare with 1 us to spare)
            outer = [s for s in by_track[(e["pid"], e["tid"])] if s["ts"] - 1 <= e["ts"] < s["ts"] + s["dur"] - 1]
            assert len(outer) == 1 and e["ts"] + e["dur"] <= outer[0]["ts"] + outer[0]["dur"] + 1, e
    comm = [e for e in events if e["ph"] == "X" and e["name"] == "comm"]
    # a slice per step whose comm wait is not 0: every step timed one collective block, in which
    # main slept (on a busy host a reading of its counters may leave one step none)
    waited = [json.loads(l) for f in sorted(tmp_path.glob("node*/rank*.jsonl")) for l in f.read_text().splitlines()]
    waited = [d for d in waited if d["type"] == "step" and d["comm_ms"]]
    assert all(d["comm_count"] == d.get("steps", 1) and d["comm_inflight_ms"] > 0 for d in waited)
    assert len(comm) == sum(d.get("steps", 1) for d in waited) >= 0.9 * 4 * STEPS
    straggler = [e for e in events if e["ph"] == "i" and e["name"].startswith("straggler")]
    assert {e["tid"] for e in straggler} == {3} and len(straggler) == 2
    stall = [e for e in events if e["ph"] == "i" and e["name"] == "stall"]
    assert [e["tid"] for e in stall] == [2]


def test_trace_keeps_the_steps_and_ranks_asked_for(tmp_path, capsys):
    _node_logs(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    for d in ("node0", "node1"):
        (tmp_path / d).rename(logs / d)

    def trace(*opts):
        out = tmp_path / "t.json"
        assert cli(["report", str(logs), "--trace", str(out), *opts]) == 0
        return json.loads(out.read_text())["traceEvents"]

    events = trace("--ranks", "2-3")
    assert sorted(e["args"]["name"] for e in events if e["name"] == "thread_name") == ["rank 2", "rank 3"]
    assert len([e for e in events if e["ph"] == "X" and e["cat"] == "step"]) == 2 * STEPS
    assert {e["tid"] for e in events if e["ph"] != "M"} == {2, 3}
    assert len([e for e in events if e["ph"] == "i" and e["name"].startswith("straggler")]) == 2  # on rank 3
    assert [e["tid"] for e in events if e["ph"] == "i" and e["name"] == "stall"] == [2]

    events = trace("--steps", "11:20", "--ranks", "0,1")
    steps = [e for e in events if e["ph"] == "X" and e["cat"] == "step"]
    assert len(steps) == 2 * 10 and {e["args"]["step"] for e in steps} == set(range(11, 21))
    assert {e["tid"] for e in events if e["ph"] != "M"} == {0, 1}
    events = trace("--steps", "25:")
    assert {e["args"]["step"] for e in events if e["ph"] == "X" and e["cat"] == "step"} == set(range(25, STEPS + 1))
    capsys.readouterr()
    assert cli(["report", str(logs), "--trace", str(tmp_path / "t.json"), "--steps", "1000:2000"]) == 2
    said = capsys.readouterr()
    err = said.err.strip()
    assert len(err.splitlines()) == 1 and "no step records in steps 1000:2000" in err and f"1-{STEPS}" in err, err
    assert said.out == "", "an empty selection is refused before the report prints anything"


def _synthetic_job(tmp_path, ranks: int, steps: int, slow: int):
    """`ranks` ranks on nodes of 8, StepRecords written as the monitor writes them; rank `slow`
    runs each step 3x longer and rank 0 names it in straggler events listing it under `more`."""
    for rank in range(ranks):
        node = rank // 8
        ev = EventLog(str(tmp_path / f"n{node}" / f"rank{rank}.jsonl"), rank)
        ev.event("start", source="monitor", host=f"h{node}", node_rank=node)
        t = 1_800_000_000.0
        for step in range(1, steps + 1):
            ms = 30.0 if rank == slow else 10.0
            t += ms / 1e3
            ev.write_lines([StepRecord(rank, step, t, ms, 0.1, 2.0, 1,
                                       {"main": RoleSample(1, 5.0, 20.0 if rank == slow else 0.1)},
                                       comm_enter_t=t - 0.003).to_json()])
        if rank == 0:
            ev.event("straggler", steps=[1, steps], stragglers=[], more={"cpu-slow": {"count": 1, "ranks": str(slow)}})
        ev.close()


def test_many_ranks_give_per_node_figures_not_a_row_per_rank(tmp_path, capsys):
    _synthetic_job(tmp_path, ranks=40, steps=20, slow=37)
    assert cli(["report", str(tmp_path), "--heatmap", str(tmp_path / "h.png")]) == 0
    out = capsys.readouterr().out
    assert "5 node(s), 40 ranks, 800 step records" in out
    assert "rank  steps" not in out  # no per-rank table
    assert "per node (5):" in out
    assert "slowest ranks by median step (job median 10.00 ms): 37 30.00 ms [node 4 (h4)]" in out
    held = [l for l in out.splitlines() if l.strip().startswith("cpu-slow")]
    assert held and "37 in 1" in held[0]
    assert (tmp_path / "h.png").stat().st_size > 10_000
    assert cli(["report", str(tmp_path), "--plot", str(tmp_path / "p.png")]) == 2
    assert "use --heatmap" in capsys.readouterr().err


def test_heat_grid_colours_a_slow_rank_against_the_window_median(tmp_path):
    pytest.importorskip("numpy")
    from placement.report.heatmap import heat_grid

    _synthetic_job(tmp_path, ranks=16, steps=40, slow=5)
    order, first, width, ratio, stall = heat_grid(read_logs([str(tmp_path)]), max_columns=10)
    assert order == list(range(16)) and first == 1 and width == 4 and ratio.shape == (16, 10)
    assert abs(ratio[5].min() - 3.0) < 1e-6 and abs(ratio[4].max() - 1.0) < 1e-6
    assert stall[5].min() > 50 and stall[4].max() < 2
