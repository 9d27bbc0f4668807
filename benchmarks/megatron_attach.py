"""What attach_megatron costs a megatron-core training step, and what binding gives back.

One rank, the CPU mode of examples/megatron_gpt.py (megatron-core's GPTModel modules, MockGPTDataset
through a DataLoader with 1 worker process, megatron's FP32Optimizer), the same seeded work in
three modes, each in a fresh process (binding changes the process):

  bare      no placement at all
  monitor   attach_megatron(optimizer, data_iterator) with policy=none: step records, no binding
  bound     attach_megatron with policy=auto, tune off: the rank's plan applied, records

Printed per mode: p50 / p90 step time (ms, wall time of one loop iteration: data, forward,
backward, optimizer step), and the difference of the p50 to `bare`. The last line is one JSON
object of headline figures.

    python benchmarks/megatron_attach.py --quick     # < 1 minute
    python benchmarks/megatron_attach.py             # 4x the steps
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
MODES = {"bare": None, "monitor": {"policy": "none"},
         "bound": {"policy": "auto", "tune": {"enabled": False}}}

CHILD = r"""
import importlib.util, json, os, sys, time, warnings
warnings.filterwarnings("ignore")
spec = importlib.util.spec_from_file_location("megatron_gpt", sys.argv[1])
ex = importlib.util.module_from_spec(spec); spec.loader.exec_module(ex)
mode, steps, log_dir = json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
import torch
args = ex.parse_args(["--steps", str(steps), "--hidden-size", "128", "--seq-length", "64",
                      "--micro-batch-size", "8", "--vocab-size", "512", "--workers", "1"])
ex.initialize_distributed(False, 1)
torch.manual_seed(0)
model = ex.build_model(args)
opt = ex.CpuFP32Optimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                          ex.OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0))
data = ex.train_data_iterator(args)
pm = None
if mode is not None:
    pm = ex.attach_megatron(opt, data, model=model, config=dict(mode, monitor={"log_dir": log_dir}))
    data = pm.data_iterator
times = []
for _ in range(steps):
    t0 = time.perf_counter()
    opt.zero_grad()
    ex.cpu_loss(model, next(data)).backward()
    opt.step()
    times.append((time.perf_counter() - t0) * 1e3)
if pm is not None:
    pm.close()
print(json.dumps(times))
"""


def run_mode(mode: dict | None, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as log_dir:
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-c", CHILD, str(REPO / "examples" / "megatron_gpt.py"),
                               json.dumps(mode), str(steps), log_dir],
                              capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"megatron_attach: mode {mode} failed: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps (< 1 minute)")
    args = p.parse_args()
    steps = 60 if args.quick else 240
    warmup = steps // 6
    results = {}
    for name, mode in MODES.items():
        times = run_mode(mode, steps + warmup)[warmup:]
        results[name] = {"p50_ms": statistics.median(times),
                         "p90_ms": statistics.quantiles(times, n=10)[-1], "steps": len(times)}
    bare = results["bare"]["p50_ms"]
    print(f"megatron-core CPU step, 1 rank, {steps} measured steps per mode (after {warmup} warm-up)")
    print(f"{'mode':8} {'p50 ms':>8} {'p90 ms':>8} {'p50 - bare':>11}")
    for name, r in results.items():
        print(f"{name:8} {r['p50_ms']:8.2f} {r['p90_ms']:8.2f} {r['p50_ms'] - bare:+10.2f}ms")
    print(json.dumps({"benchmark": "megatron_attach", "steps": steps,
                      **{f"{k}_p50_ms": round(v["p50_ms"], 3) for k, v in results.items()},
                      "monitor_overhead_ms": round(results["monitor"]["p50_ms"] - bare, 3),
                      "bound_vs_bare_ms": round(results["bound"]["p50_ms"] - bare, 3)}))


if __name__ == "__main__":
    main()
