"""Per-step cost of the Lightning and Transformers callbacks against a bare run of the same loop.

One process per run (binding changes the process), one rank, the models of examples/lightning_ddp.py
and examples/transformers_trainer.py, runs alternated bare / callback. A step is timed from one
optimizer step's end to the next (a timing callback in both runs); printed per framework: median
step time of each mode and its ratio to bare (1.00 = no cost). Modes: `monitor` is the callback
with policy none (its own per-step cost: hooks, records), `bound` with policy auto as a user gets
it (also the plan's binding, whose OMP_NUM_THREADS changes torch's own speed).

    python benchmarks/framework_callbacks.py --quick     # ~1-2 minutes
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

CHILD = r"""
import importlib.util, json, sys, time, warnings
warnings.filterwarnings("ignore")
framework, mode, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
spec = importlib.util.spec_from_file_location("ex", sys.argv[5])
ex = importlib.util.module_from_spec(spec); spec.loader.exec_module(ex)
stamps = []
if framework == "lightning":
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader
    class Stamp(Callback):
        def on_train_batch_end(self, *a): stamps.append(time.perf_counter())
    policy = {"monitor": "none", "bound": "auto"}.get(mode)
    cbs = [Stamp()] + ([ex.PlacementCallback(policy=policy, tune={"enabled": False}, monitor={"log_dir": out})] if policy else [])
    Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=cbs, enable_checkpointing=False, logger=False,
            enable_progress_bar=False, enable_model_summary=False).fit(ex.Regression(), DataLoader(ex.Points(), batch_size=16))
else:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    class Stamp(TrainerCallback):
        def on_step_end(self, *a, **k): stamps.append(time.perf_counter())
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=32))
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=8, use_cpu=True,
                             report_to=[], save_strategy="no", logging_steps=10**6, disable_tqdm=True)
    policy = {"monitor": "none", "bound": "auto"}.get(mode)
    cbs = [Stamp()] + ([ex.PlacementCallback(policy=policy, tune={"enabled": False})] if policy else [])
    Trainer(model=model, args=args, train_dataset=ex.Tokens(), callbacks=cbs).train()
print(json.dumps([(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])][5:]))
"""
EXAMPLE = {"lightning": "lightning_ddp.py", "transformers": "transformers_trainer.py"}


def run(framework: str, mode: str, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        p = subprocess.run([sys.executable, "-c", CHILD, framework, mode, str(steps), out,
                            str(REPO / "examples" / EXAMPLE[framework])], capture_output=True, text=True, env=env,
                           timeout=600)
    if p.returncode != 0:
        sys.exit(f"framework_callbacks: {framework} {mode} failed: {p.stderr.strip().splitlines()[-1]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    args = p.parse_args()
    steps, rounds = (80, 2) if args.quick else (300, 3)
    result = {"benchmark": "framework_callbacks", "steps": steps, "rounds": rounds}
    for framework in EXAMPLE:
        times: dict[str, list[float]] = {"bare": [], "monitor": [], "bound": []}
        for _ in range(rounds):
            for mode in times:
                times[mode] += run(framework, mode, steps)
        med = {mode: statistics.median(t) for mode, t in times.items()}
        print(f"{framework:13s} " + "  ".join(f"{m} {v:7.3f} ms ({v / med['bare']:.3f}x)" for m, v in med.items()))
        for mode, v in med.items():
            result[f"{framework}_{mode}_ms"] = round(v, 3)
            result[f"{framework}_{mode}_ratio"] = round(v / med["bare"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
