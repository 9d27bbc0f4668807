"""What a straggler costs, on a real gloo job whose answer is known: 3 ranks, each step a short
sleep then an all_reduce; in SLOW_STEPS rank 1 sleeps EXTRA_MS more, so every rank's step grows
by EXTRA_MS (they wait for it in the all_reduce) and fixing rank 1 would give exactly that back.
Rank 0's `straggler` events must say so, from the second window (monitor defaults: named once it
costs in 2 windows in a row), and `placement report` must give the job's time lost to it.

The file is also the worker: `python tests/monitor/stragglers/test_straggler_cost.py LOG_DIR` with
RANK/WORLD_SIZE/MASTER_* in the environment runs one rank.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import pytest

from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: its helpers, when this file runs as a rank's script

from placerun_helpers import close_and_exit, run_gloo_ranks

WORLD = 3
STEPS = 100
SLOW_STEPS = range(41, 81)  # four exchange windows of EVERY steps
EVERY = 10
STEP_MS = 4.0
EXTRA_MS = 8.0


@pytest.mark.slow
def test_an_injected_slow_rank_costs_the_job_what_was_injected(tmp_path, capsys):
    from placement.cli import main as cli

    run_gloo_ranks(WORLD, [__file__, str(tmp_path)], timeout=180)
    logs = {r: [json.loads(line) for line in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()]
            for r in range(WORLD)}
    # One run, one id on every record of every rank: rank 0's, through the job's c10d store (no
    # launcher here to name the run).
    run_ids = {rec.get("run") for r in range(WORLD) for rec in logs[r]}
    assert len(run_ids) == 1 and None not in run_ids, run_ids
    log = logs[0]
    events = [e for e in log if e["type"] == "straggler"]
    inside = [e for e in events if SLOW_STEPS.start <= e["steps"][0] and e["steps"][1] < SLOW_STEPS.stop]
    named = [s for e in inside for s in e["stragglers"] if s["ranks"] == [1]]
    # Four windows of it: named from the second at the latest (the first may be named too when
    # the window before happened to cost as much), and in most of the rest.
    assert len(named) >= 2, [e["steps"] for e in events]
    for s in named:
        # The cost is what was injected (the job's step grew by EXTRA_MS): within this busy
        # machine's noise, as a ratio.
        assert 0.6 * EXTRA_MS < s["cost_ms_per_step"] < 1.4 * EXTRA_MS, s
        assert s["kind"] == "compute-slow", s  # a sleep: neither its data wait nor its runqueue
        assert s["cost_by_cause"]["compute"] >= 0.7 * s["cost_ms_per_step"], s
        # Its streak covers the slow steps from their first window on; on a host busy with other
        # work it may begin earlier, with windows of real lateness held back as noise (never
        # named: asserted below). Seen under two outside spinners: since step 22.
        assert 1 <= s["since_step"] <= SLOW_STEPS.start + EVERY, s
    steps = [r for r in log if r["type"] == "step"]
    step_in = statistics.median(r["step_ms"] for r in steps if r["step"] in SLOW_STEPS)
    for e in inside:
        for s in e["stragglers"]:
            if s["ranks"] == [1]:
                assert abs(s["cost_pct"] - 100 * s["cost_ms_per_step"] / e["step_ms"]) < 0.01
                assert 0.5 * step_in < e["step_ms"] < 1.5 * step_in
    # Nobody is named where nothing was injected (a window of real noise on this busy machine
    # may cost, never two in a row... except real load: then it is named with its cause).
    assert all(not any(s["ranks"] == [1] for s in e["stragglers"])
               for e in events if e["steps"][1] < SLOW_STEPS.start - EVERY), events

    # The report: the job's time lost to what was named, about the injected share of rank 0's
    # time (the windows named: at least 2 of the 4).
    assert cli(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    line = next(l for l in out if "named causes cost the job" in l)
    # Each named window says how steady the lateness was. The first was named on steadiness (4
    # windows: never persist_windows): late at 90% of the steps of it and the window before,
    # so at 80% of its own at least.
    first = named[0]
    assert first["steps_late"] >= 0.8 * first["steps_judged"] and first["steps_judged"] >= 3, first
    for s in named:
        assert any(f"at {s['steps_late']} of {s['steps_judged']} steps" in l for l in out if "rank(s) [1]" in l), out
    lost_pct = float(line.split("named causes cost the job ")[1].split("%")[0])
    job_ms = sum(r["step_ms"] * r.get("steps", 1) for r in steps)  # (a record of several steps: per-step means)
    named_ms = sum(s["cost_ms_per_step"] * (e["steps"][1] - e["steps"][0] + 1)
                   for e in events for s in e["stragglers"])
    assert abs(lost_pct - 100 * named_ms / job_ms) < 0.2 * lost_pct + 0.1, (line, named_ms, job_ms)
    injected_pct = 100 * EXTRA_MS * len(SLOW_STEPS) / job_ms
    assert 0.3 * injected_pct < lost_pct < 1.5 * injected_pct, (line, injected_pct)
    assert "compute" in line


def worker(log_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import placement

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    handle = placement.attach(policy="none", tune={"enabled": False},
                              monitor={"log_dir": log_dir, "exchange_every": EVERY, "flush_every": EVERY,
                                       "summary_every": 0})
    x = torch.ones(256)
    for step in range(1, STEPS + 1):
        extra = EXTRA_MS if rank == 1 and step in SLOW_STEPS else 0.0
        time.sleep((STEP_MS + extra) / 1e3)
        dist.all_reduce(x)
        handle.step()
    close_and_exit(handle)


if __name__ == "__main__":
    worker(sys.argv[1])
