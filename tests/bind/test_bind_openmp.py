"""torch's OpenMP pool under placerun waits at its barriers as under torchrun (placement/bind/
openmp.py): main keeps the rank's share while torch is imported, so libgomp counts the CPUs its
two threads run on, and the pool's thread spins at a barrier rather than sleeping in the kernel
after each small op. On the code that narrowed main before the program ran, the pool's thread
slept at about every op under placerun and almost never under torchrun."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "placerun_jobs" / "omp_waits.py"
CPUS = sorted(os.sched_getaffinity(0))


def _run(launcher: list[str], env: dict, cwd: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", *launcher, "--standalone", "--nproc-per-node", "1", str(JOB)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=str(cwd))
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.slow
@pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs: main's core and the pool's")
def test_the_openmp_pool_waits_as_under_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLACEMENT_", "OMP_", "GOMP_"))}
    placed = _run(["placement.launcher", f"placement.monitor.log_dir={tmp_path}"], dict(env, OMP_WAITS_BOUND="1"),
                  tmp_path)
    plain = _run(["torch.distributed.run"], env, tmp_path)
    # The plan: main on one core, the pool's other thread on `other`'s. Main had the whole share
    # until torch's import (what libgomp counted), and was narrowed as the import returned.
    assert len(placed["before_import"]) >= 2 and placed["after_import"] == placed["main_now"], placed
    assert len(placed["main_now"]) == 1 and set(placed["main_now"]) < set(placed["before_import"]), placed
    assert placed["pool"] >= 1 and plain["pool"] >= 1
    # A throttled pool sleeps at about every op (~1 switch per op); torchrun's almost never.
    assert placed["switches_per_op"] < 0.25, (placed, plain)
    assert placed["switches_per_op"] <= max(4 * plain["switches_per_op"], 0.1), (placed, plain)
