"""`placement report` on logs written by the real monitor (two ranks' files), with bind,
tune and straggler events added, truncated and corrupt lines mixed in."""
import struct

import placement
from placement.cli import main as cli
from placement.records.step import StepRecord
from placement.events import EventLog


def _write_run(tmp_path):
    """Two ranks' logs from real monitor runs (one after the other, ranks set by env)."""
    import os
    import time

    for rank in (0, 1):
        os.environ["RANK"] = str(rank)
        try:
            h = placement.attach(policy="none", tune={"enabled": False},
                                 monitor={"log_dir": str(tmp_path), "flush_every": 5, "summary_every": 0})
            for step in range(1, 41):
                with h.comm():
                    time.sleep(0.001 if rank == 0 else 0.0002)
                time.sleep(0.002)
                h.step()
                if step == 10:
                    h.events.event("bind", pid=1, tid=1, name="python", role="main", planned=[rank],
                                   applied=[rank], ok=True, error=None, reason="test")
                    h.events.event("bind", pid=1, tid=2, name="pt_autograd_0", role="other", planned=[0, 1],
                                   applied=[], ok=False, error="EINVAL", reason="test")
                if step == 25 and rank == 0:
                    h.events.event("tune", rule="runqueue", action="move main to 1", evidence={"runq_pct": 14.2})
                    h.events.event("straggler", steps=[21, 40], waiting=[0], transfer_ms=0.2, stragglers=[
                        {"kind": "cpu-slow", "ranks": [1], "lateness_ms": 3.2, "why": "test"}])
            h.close()
        finally:
            del os.environ["RANK"]


def test_report_table_events_and_skipped_lines(tmp_path, capsys):
    _write_run(tmp_path)
    with open(tmp_path / "rank1.jsonl", "a") as f:
        f.write('{"type":"step","rank":1,"step":41,"t":17\n')  # truncated by a kill
        f.write("garbage\n")
        f.write('{"type": "step", "rank": "x"}\n')  # not a record
    assert cli(["report", str(tmp_path / "rank0.jsonl"), str(tmp_path / "rank1.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "skipped 3 truncated or corrupt line(s)" in out
    table = out.split("rank  steps")[1].split("\n\n")[0].splitlines()
    rows = [l.split() for l in table[2:4]]
    assert [r[0] for r in rows] == ["0", "1"] and [r[1] for r in rows] == ["40", "40"]
    comm0, comm1 = float(rows[0][5]), float(rows[1][5])
    assert comm0 > comm1 > 0  # rank 0 slept longer inside its comm blocks
    events = out.split("events (")[1].split("\n\n")[0].splitlines()[1:]  # the cluster summary follows
    kinds = [e.split(": ", 1)[1].split()[0] for e in events]
    assert kinds.count("bind") == 2  # one folded line per rank
    assert any("FAILED 1: pt_autograd_0/2: EINVAL" in e for e in events)
    assert any("tune" in e and "runqueue" in e for e in events)
    straggler = [e for e in events if "straggler" in e][0]
    assert "[1] cpu-slow" in straggler and "waiting for them: [0]" in straggler
    times = [float(e.split("s rank")[0]) for e in events]
    assert times == sorted(times)


def test_report_plot_is_a_png_with_a_panel_per_rank(tmp_path, capsys):
    _write_run(tmp_path)
    png = tmp_path / "report.png"
    assert cli(["report", str(tmp_path), "--plot", str(png)]) == 0
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    assert width > 800 and height > 500
    import matplotlib.image

    assert matplotlib.image.imread(str(png)).shape[:2] == (height, width)


def test_report_on_missing_or_empty_input_is_one_line_exit_2(tmp_path, capsys):
    assert cli(["report", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "nope.jsonl" in err and len(err.strip().splitlines()) == 1
    assert cli(["report", str(tmp_path)]) == 2  # a directory without logs
    (tmp_path / "empty.jsonl").write_text("")
    assert cli(["report", str(tmp_path / "empty.jsonl"), "--plot", str(tmp_path / "x.png")]) == 2
    assert "no step records" in capsys.readouterr().err


def test_a_log_holding_two_runs_reports_the_last(tmp_path, capsys):
    ev = EventLog(str(tmp_path / "rank0.jsonl"), 0)
    for run_ms in (50.0, 10.0):
        for step in (1, 2, 3):
            ev.write({"type": "step", "rank": 0, "step": step, "t": 1.0 + step, "step_ms": run_ms, "data_ms": 0.0,
                      "comm_ms": 0.0, "comm_count": 0, "roles": {}, "verdict": "balanced"})
    ev.close()
    assert cli(["report", str(tmp_path / "rank0.jsonl")]) == 0
    out = capsys.readouterr().out
    # written before runs had ids: told apart by the step numbers starting over
    assert "rank 0: its steps started over 1 time(s) in this run; the last start is reported" in out
    assert "10.00" in out and "50.00" not in out


def _run(tmp_path, run: str, step_ms: float, t0: float, job: str, ranks=(0, 1), steps=3, log_dir=None):
    """A run as the monitor writes it: a start event and step records carrying its id, per rank."""
    for rank in ranks:
        ev = EventLog(str((log_dir or tmp_path) / f"rank{rank}.jsonl"), rank, run)
        rec = ev.event("start", source="monitor", job=job, host="h")
        rec["t"] = t0
        ev._buf.clear(), ev.write(rec)
        ev.write_lines([StepRecord(rank, s, t0 + s, step_ms, run=run).to_json() for s in range(1, steps + 1)])
        ev.event("straggler", steps=[1, steps], stragglers=[{"kind": "cpu-slow", "ranks": [1], "lateness_ms": 1.0,
                                                           "why": f"in run {run}"}], waiting=[0])
        ev.close()


def test_a_log_holding_two_runs_reports_one_and_says_so(tmp_path, capsys):
    _run(tmp_path, "aaaa11112222", 50.0, 1000.0, "job-1")
    _run(tmp_path, "bbbb33334444", 10.0, 2000.0, "job-1", steps=4)
    assert cli(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "these logs hold 2 runs: reporting run 2 bbbb33334444 job job-1" in out, out
    assert "10.00" in out and "50.00" not in out  # the last run's steps only ...
    assert "in run bbbb33334444" in out and "in run aaaa11112222" not in out  # ... and its events only
    assert "  run 1 aaaa11112222 job job-1" in out
    # --run by number and by an id's beginning; anything else is one line, exit 2
    assert cli(["report", str(tmp_path), "--run", "1"]) == 0
    out = capsys.readouterr().out
    assert "reporting run 1 aaaa11112222" in out and "50.00" in out and "10.00" not in out
    assert cli(["report", str(tmp_path), "--run", "bbbb"]) == 0
    assert "reporting run 2 bbbb33334444" in capsys.readouterr().out
    for bad in ("3", "0", "cccc", ""):
        assert cli(["report", str(tmp_path), "--run", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "1 aaaa11112222; 2 bbbb33334444" in err, err


def test_two_jobs_named_together_are_not_merged(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    _run(tmp_path, "aaaa11112222", 50.0, 1000.0, "job-1", log_dir=a)
    _run(tmp_path, "bbbb33334444", 10.0, 2000.0, "job-2", steps=4, log_dir=b)
    assert cli(["report", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "these logs hold 2 runs of 2 jobs: reporting run 2 bbbb33334444 job job-2" in out
    assert "placement report: 4 file(s), 8 step records, 4 events" in out, out  # job-2's alone, not 6 + 8


def test_a_run_number_is_never_read_as_an_id_beginning(tmp_path, capsys):
    # ids are hex: one may begin with a digit; --run 3 of 2 runs is a bad number, not that id
    _run(tmp_path, "3aaa11112222", 50.0, 1000.0, "job-1")
    _run(tmp_path, "bbbb33334444", 10.0, 2000.0, "job-1")
    assert cli(["report", str(tmp_path), "--run", "3"]) == 2
    assert "--run '3' is not valid" in capsys.readouterr().err
    assert cli(["report", str(tmp_path), "--run", "3aaa"]) == 0
    assert "reporting run 1 3aaa11112222" in capsys.readouterr().out
