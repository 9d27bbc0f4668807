"""`placement report` on logs written by the real monitor (two ranks' files), with bind,
tune and straggler events added, truncated and corrupt lines mixed in."""
import struct

import placement
from placement.cli import main as cli
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
    assert "holds 2 runs; the last one is reported" in out
    assert "10.00" in out and "50.00" not in out
