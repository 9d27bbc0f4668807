"""Ray Train's step time with placement's setup hook against the same loop without it.

Each run is tests/ray_jobs/ray_job.py: a local Ray cluster of 2 CPUs, Ray Train's TorchTrainer with
2 CPU workers on gloo (DDP over a small MLP, a DataLoader with one worker process, a little busy
compute each step), started with `ray.init(runtime_env={"worker_process_setup_hook": ...})` or
without it; runs alternated, the order turned each round. A run's figure is the median step time of
its two workers (each worker's median after its first 5 steps); a round's ratio is hook over no
hook; printed: the median of the rounds' ratios (1.00 = no cost, below 1 = faster placed).

    python benchmarks/ray_cost.py --quick     # 1 round of 150 steps, ~1 minute
    python benchmarks/ray_cost.py             # 3 rounds of 400 steps
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "ray_jobs" / "ray_job.py"


def run(hook: bool, iters: int, work_ms: float, scratch: str) -> float:
    out = tempfile.mkdtemp(dir=scratch)
    args = [sys.executable, str(JOB), "trainer", "--out", out, "--iters", str(iters), "--work-ms", str(work_ms)]
    args += ["--overrides", f"placement.monitor.log_dir={out}/logs"] if hook else ["--hook", "none"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=REPO,
                       env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    if p.returncode != 0:
        sys.exit(f"ray_cost: a run failed (rc {p.returncode}): {p.stderr[-2000:]}")
    medians = json.loads(p.stdout.strip().splitlines()[-1])["median_step_ms"]
    return statistics.median(medians.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--iters", type=int)
    ap.add_argument("--work-ms", type=float, default=2.0)
    a = ap.parse_args()
    rounds = a.rounds or (1 if a.quick else 3)
    iters = a.iters or (150 if a.quick else 400)
    with tempfile.TemporaryDirectory() as scratch:
        ratios, hook_ms, bare_ms = [], [], []
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {hook: run(hook, iters, a.work_ms, scratch) for hook in order}
            bare_ms.append(got[False])
            hook_ms.append(got[True])
            ratios.append(got[True] / got[False])
            print(f"round {r + 1}: no hook {got[False]:.3f} ms, hook {got[True]:.3f} ms, "
                  f"ratio {ratios[-1]:.3f}", file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "ray_cost", "rounds": rounds, "steps": iters, "workers": 2,
                      "no_hook_step_ms": round(statistics.median(bare_ms), 3),
                      "hook_step_ms": round(statistics.median(hook_ms), 3),
                      "hook_over_no_hook": round(statistics.median(ratios), 3), "target": "<= 1.00"}))


if __name__ == "__main__":
    main()
