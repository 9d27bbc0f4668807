"""`placement report --compare BASE NEW` and `--json` on real runs: a training loop under
placement.attach (one process, policy none), once with 2 ms steps and once with 4 ms steps, in
directories of their own and appended to one log; and the parts of a step adding up to it.

The file is also the worker: `python tests/report/test_report_compare.py LOG_DIR STEP_MS STEPS`.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from placement.cli import main as cli
from placement.report.compare import mann_whitney_p

STEPS = 200


def _run(log_dir, step_ms: float, steps: int = STEPS) -> None:
    out = subprocess.run([sys.executable, __file__, str(log_dir), str(step_ms), str(steps)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("compare")
    _run(base / "fast", 2.0)
    _run(base / "slow", 4.0)
    _run(base / "both", 2.0)  # two runs appended to one log
    _run(base / "both", 4.0)
    return base


@pytest.mark.slow
def test_a_slower_run_is_beyond_the_noise_and_a_run_against_itself_is_not(runs, capsys):
    assert cli(["report", "--compare", str(runs / "fast"), str(runs / "slow")]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("median step"))
    change = float(line.split("median step ")[1].split("%")[0])
    # 2 ms of sleep more on a step of ~2.x ms: +90% on a quiet machine; a busy one wakes the
    # sleeps late and makes it more (no upper bound: it measures the host, not the report)
    assert change > 40.0, line
    assert "beyond the runs' noise" in line and "10 vs 10" in line, line
    assert cli(["report", "--compare", str(runs / "fast"), str(runs / "fast")]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("median step"))
    assert "within the runs' noise" in line and "p = 1" in line, line


@pytest.mark.slow
def test_two_runs_of_one_log_are_compared_by_number_and_as_json(runs, capsys):
    both = runs / "both"
    assert cli(["report", "--compare", f"{both}@1", f"{both}@2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "placement.compare/1"
    assert doc["base"]["run"] != doc["new"]["run"] and doc["base"]["steps"] == doc["new"]["steps"] == STEPS
    assert doc["beyond_noise"] is True and doc["p50_change_pct"] > 40.0
    assert doc["throughput_change_pct"] < -25.0


@pytest.mark.slow
def test_report_json_holds_the_run_and_parts_that_add_up(runs, capsys):
    assert cli(["report", str(runs / "both"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "placement.report/1"
    assert doc["run"]["number"] == 2 and len(doc["runs"]) == 2 and doc["run"]["records"] == STEPS
    parts = doc["job"]["parts_pct"]
    assert set(parts) == {"data", "comm", "cpu_stall", "compute"}
    assert math.isclose(sum(v for v in parts.values() if v is not None), 100.0, abs_tol=0.01), parts
    (rank,) = doc["ranks"]
    assert math.isclose(rank["data_pct"] + (rank["comm_pct"] or 0) + (rank["stall_pct"] or 0) + rank["compute_pct"],
                        100.0, abs_tol=0.01), rank


@pytest.mark.slow
def test_compare_refuses_what_it_cannot_do_in_one_line(runs, tmp_path, capsys):
    for argv in (["report", "--compare", str(tmp_path / "nope"), str(runs / "fast")],
                 ["report", "--compare", str(runs / "fast"), f"{runs / 'both'}@3"],
                 ["report", str(runs / "fast"), "--compare", str(runs / "fast"), str(runs / "slow")],
                 ["report"]):
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err


def test_mann_whitney_matches_the_normal_approximation():
    # U = 0 for 5 vs 5: z = (12.5 - 0.5) / sqrt(25 / 12 * 11), two-sided p = 0.0122 (scipy's
    # mannwhitneyu(method="asymptotic") gives the same)
    assert math.isclose(mann_whitney_p([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]), 0.01219, abs_tol=1e-4)
    assert mann_whitney_p([1.0] * 6, [1.0] * 6) == 1.0


def worker(log_dir: str, step_ms: float, steps: int) -> None:
    import placement

    handle = placement.attach(policy="none", tune={"enabled": False},
                              monitor={"log_dir": log_dir, "summary_every": 0})
    for _ in range(steps):
        time.sleep(step_ms / 1e3)
        handle.step()
    handle.close()


if __name__ == "__main__":
    worker(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
