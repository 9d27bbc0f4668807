"""Per-step cost of the Lightning and Transformers callbacks against a bare run of the same loop,
and of a plain DDP loop under placerun against the same loop under torchrun.

Frameworks: one process per run (binding changes the process), one rank, the models of
examples/lightning_ddp.py and examples/transformers_trainer.py, runs alternated bare / callback
with the order rotated each round; a ratio is the median over rounds of the arm's median step
over bare's in the same round.
A step is timed from one optimizer step's end to the next (a timing callback in both runs);
printed per framework: median step time of each mode and its ratio to bare (1.00 = no cost).
Modes: `monitor` is the callback with policy none (its own per-step cost: hooks, records),
`bound` with policy auto as a user gets it (also the plan's binding and its OMP_NUM_THREADS),
`empty_callback` the framework's own base callback class, doing nothing: what any callback costs
in the framework's dispatch (Lightning 2.6 calls every hook of every callback, each inside
`trainer.profiler.profile()` named by the callback's `state_key`: lightning/pytorch/trainer/call.py
`_call_callback_hooks`). `<framework>_monitor_over_empty_callback` is monitor over it, paired by
round: the monitor's cost beyond being a callback.
`bare` is also what torchrun gives a one-process job: it sets OMP_NUM_THREADS=1 only when it
starts more than one process (torch/distributed/run.py), so bound/bare is bound/torchrun.

DDP: a small MLP trained with DistributedDataParallel over gloo, launched by `torchrun` and by
`placerun` (policy auto, its monitor on: what a user who swaps the launcher gets), with 1 and 2
processes per node, alternated; each launcher with its own defaults (torchrun: OMP_NUM_THREADS=1
for 2 processes; placerun: the plan's). Rank 0's median step time; placerun/torchrun, paired
by round as above.

    python benchmarks/framework_callbacks.py --quick     # ~5 minutes
    python benchmarks/framework_callbacks.py --quick --decompose   # DDP only, placerun's parts off one at a time
    python benchmarks/framework_callbacks.py --only lightning    # one framework (or ddp) alone
    python benchmarks/framework_callbacks.py --cadence   # Lightning only: the hand-overs' floor off and on

--cadence: the monitor thread's hand-over (records built and written, the thread scan) holds the
GIL, so a Python-bound step waits for it; arm `monitor` has hand-overs at least
monitor.handover_min_s (0.5 s) apart, the default; arm `monitor_no_floor` is the same callback with
handover_min_s=0, a hand-over at every due step (every 20 steps at the defaults).
"""
from __future__ import annotations

import argparse
import json
import os
import re
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
cadence = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
spec = importlib.util.spec_from_file_location("ex", sys.argv[5])
ex = importlib.util.module_from_spec(spec); spec.loader.exec_module(ex)
stamps = []
if framework == "lightning":
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader
    class Stamp(Callback):
        def on_train_batch_end(self, *a): stamps.append(time.perf_counter())
    policy = {"monitor": "none", "monitor_no_floor": "none", "bound": "auto"}.get(mode)
    cbs = [Stamp()] + ([ex.PlacementCallback(policy=policy, tune={"enabled": False}, monitor={"log_dir": out, **cadence})] if policy else [])
    if mode == "empty_callback":
        cbs.append(Callback())
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
    if mode == "empty_callback":
        cbs.append(TrainerCallback())
    Trainer(model=model, args=args, train_dataset=ex.Tokens(), callbacks=cbs).train()
print(json.dumps([(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])][5:]))
"""
EXAMPLE = {"lightning": "lightning_ddp.py", "transformers": "transformers_trainer.py"}
# Lightning's example steps in ~0.45 ms: 300 of them are 0.13 s, where a run's median step is the
# monitor's start (its first hand-overs, the budget's first judgement) more than its steady cost.
# Ten times the steps: about as many seconds of steps as the Transformers runs.
STEPS_SCALE = {"lightning": 10}
ONLY = (*EXAMPLE, "ddp")  # --only's choices

DDP = r"""
import json, os, sys, time
import torch, torch.distributed as dist
steps, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
stamps = []
for _ in range(steps):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    stamps.append(time.perf_counter())
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump([(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])][5:], f)
# both ranks into teardown together: with rank 0 gone first (writing its steps), rank 1 aborted
# inside gloo's teardown ("terminate called without an active exception", SIGABRT) in 2 of 12
# plain-torchrun runs on torch 2.13; with the barrier, 0 in 20
dist.barrier()
dist.destroy_process_group()
"""


def launcher(name: str) -> list[str]:
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [
        sys.executable, "-m", "placement.launcher" if name == "placerun" else "torch.distributed.run"]


# --decompose: placerun with one part of the product off, beside the two launchers' own defaults.
DDP_PARTS = {"placerun monitor off": ["placement.monitor.auto=false"],
             "placerun comm timing off": ["placement.monitor.comm_timing=off"],
             "placerun binding off": ["placement.policy=none"],
             "placerun one set per process": ["placement.policy=node"],
             "placerun tuner off": ["placement.tune.enabled=false"]}


def _banner(line: str) -> bool:
    """A line of torchrun's OMP_NUM_THREADS banner (torch/distributed/run.py, its warning when it
    starts more than one process): a `run.py:<n>]` log line that is empty, stars, or the advice."""
    head, sep, msg = line.partition("] ")
    msg = (msg if sep else "").strip()
    return "run.py:" in head and (not msg or set(msg) == {"*"} or msg.startswith("Setting OMP_NUM_THREADS"))


def run_ddp(arm: str, nproc: int, steps: int) -> list[float]:
    """Rank 0's step times (ms) of the DDP loop launched by `arm` (a launcher with its own
    defaults, or a DDP_PARTS arm)."""
    name = "placerun" if arm in DDP_PARTS else arm
    with tempfile.TemporaryDirectory() as d:
        job, out = os.path.join(d, "ddp.py"), os.path.join(d, "steps.json")
        with open(job, "w") as f:
            f.write(DDP)
        extra = [f"placement.monitor.log_dir={d}", *DDP_PARTS.get(arm, [])] if name == "placerun" else []
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PLACEMENT_", "OMP_NUM_THREADS"))}
        p = subprocess.run([*launcher(name), "--standalone", "--nproc-per-node", str(nproc), *extra, job,
                            str(steps), out], capture_output=True, text=True, env=env, timeout=600)
        if p.returncode != 0 or not os.path.exists(out):
            # torchrun's banner is the last stderr line when a worker dies without a word: say
            # the exit code, whether rank 0 wrote its steps, and a worker's own error (else the
            # last line that is not the banner)
            said = [l.strip() for l in p.stderr.splitlines() if l.strip() and not _banner(l)]
            raised = [l for l in said if re.match(r"(\[rank\d+\]: )?\w+(Error|Exception): ", l)]  # a worker's own error
            sys.exit(f"framework_callbacks: ddp under {name} x{nproc} failed: exit {p.returncode}, "
                     f"steps {'written' if os.path.exists(out) else 'not written'}; " + (raised or said or ["?"])[-1])
        with open(out) as f:
            return json.load(f)


NO_FLOOR = {"handover_min_s": 0}  # --cadence's monitor_no_floor arm


def run(framework: str, mode: str, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        p = subprocess.run([sys.executable, "-c", CHILD, framework, mode, str(steps), out,
                            str(REPO / "examples" / EXAMPLE[framework]), json.dumps(NO_FLOOR if mode == "monitor_no_floor" else {})],
                           capture_output=True, text=True, env=env, timeout=600)
    if p.returncode != 0:
        sys.exit(f"framework_callbacks: {framework} {mode} failed: {p.stderr.strip().splitlines()[-1]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    p.add_argument("--cadence", action="store_true",
                   help="Lightning only: bare, monitor, and monitor with a hand-over at every due step (monitor_no_floor)")
    p.add_argument("--decompose", action="store_true",
                   help="DDP only, with each of DDP_PARTS (placerun with one part off or changed) as an arm of its own")
    p.add_argument("--only", help=f"one of {', '.join(ONLY)}: one framework, or the DDP loop alone")
    args = p.parse_args()
    if args.only is not None and args.only not in ONLY:
        print(f"framework_callbacks: unknown --only {args.only!r}; choose from {', '.join(ONLY)}", file=sys.stderr)
        sys.exit(2)
    steps, rounds = (60, 3) if args.quick else (300, 5)
    result = {"benchmark": "framework_callbacks", "steps": steps, "rounds": rounds}
    modes = ("bare", "monitor", "monitor_no_floor") if args.cadence else ("bare", "empty_callback", "monitor", "bound")
    frameworks = () if args.decompose else ("lightning",) if args.cadence else EXAMPLE
    if args.only:
        frameworks = tuple(f for f in frameworks if f == args.only)
    for framework in frameworks:
        n = steps * STEPS_SCALE.get(framework, 1)
        per_round = alternated(modes, rounds, lambda mode: run(framework, mode, n))
        med, ratio = paired(per_round, "bare")
        print(f"{framework:13s} " + "  ".join(f"{m} {med[m]:7.3f} ms ({ratio[m]:.3f}x)" for m in med))
        result[f"{framework}_steps"] = n
        for mode in med:
            result[f"{framework}_{mode}_ms"] = round(med[mode], 3)
            result[f"{framework}_{mode}_ratio"] = round(ratio[mode], 3)
        if "empty_callback" in med:
            # what the monitor costs beyond being a callback at all (the framework's dispatch)
            result[f"{framework}_monitor_over_empty_callback"] = round(paired(per_round, "empty_callback")[1]["monitor"], 3)
    for nproc in () if args.cadence or args.only not in (None, "ddp") else (1, 2):
        arms = ("torchrun", "placerun", *(DDP_PARTS if args.decompose else ()))
        per_round = alternated(arms, rounds, lambda arm: run_ddp(arm, nproc, steps * 2))
        med, ratio = paired(per_round, "torchrun")
        print(f"ddp x{nproc}        " + "  ".join(f"{a} {med[a]:7.3f} ms ({ratio[a]:.3f}x)" for a in arms))
        result[f"ddp{nproc}_torchrun_ms"] = round(med["torchrun"], 3)
        result[f"ddp{nproc}_placerun_ms"] = round(med["placerun"], 3)
        result[f"ddp{nproc}_placerun_vs_torchrun"] = round(ratio["placerun"], 3)
        for arm in DDP_PARTS if args.decompose else ():
            key = arm.replace("placerun ", "").replace(" ", "_")
            result[f"ddp{nproc}_{key}_vs_torchrun"] = round(ratio[arm], 3)
    print(json.dumps(result))


def alternated(arms: tuple[str, ...], rounds: int, measure) -> list[dict[str, float]]:
    """Per round, each arm's median step (ms), the arms' order rotated every round (the first
    run of a round pays for what the one before left in the caches: no arm is always first)."""
    out = []
    for r in range(rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        out.append({arm: statistics.median(measure(arm)) for arm in order})
    return out


def paired(per_round: list[dict[str, float]], base: str) -> tuple[dict[str, float], dict[str, float]]:
    """Each arm's median step over the rounds, and the median over rounds of its ratio to `base`
    in the same round (a drift of the machine between rounds cancels)."""
    arms = list(per_round[0])
    med = {arm: statistics.median(r[arm] for r in per_round) for arm in arms}
    ratio = {arm: statistics.median(r[arm] / r[base] for r in per_round) for arm in arms}
    return med, ratio


if __name__ == "__main__":
    main()
