"""What placement costs a real job, all of it: a plain DDP job with DataLoader workers
(benchmarks/job_cost_job.py: no placement import, the script times its own steady steps and reads
every thread's CPU from /proc), launched in alternated arms, the order turned each round.

Arms (each a launcher command line; the job unchanged):
    torchrun      python -m torch.distributed.run
    placerun      placerun with its defaults (binding, the monitor, the tuner)
    monitor_off   placerun placement.monitor.auto=false (binding only)
    tuner_off     placerun placement.tune.enabled=false
    unbound       placerun placement.policy=none (the monitor without binding)
    record_each   placerun placement.monitor.record_min_s=0 (a record a step, as before records
                  were paced in time; not in the default arms)

Printed per arm: rank 0's steps/s (median over rounds) and its ratio to torchrun and to
monitor_off paired by round; placement's threads' CPU (every thread of rank 0 whose name starts
with `placement`, from /proc/<pid>/task/*/schedstat over the steady steps) per step and as a share
of main's CPU; torch's threads' CPU per step (every other thread but main: gloo's run loops, where
the monitor's future callbacks run); and what the monitor says of itself in the log: the `end` event's
`placement_cpu_us_per_step` (all of placement's CPU per step) beside the /proc figure, and its
threads' part (less the step hook's) over the whole run against /proc over the same steps
(`*_self_threads_over_proc_whole`: the end event counts the monitor's whole life, start-up and
warm-up included, which the steady figure leaves out).

    python benchmarks/job_cost.py --quick          # 3 rounds of 700 steps
    python benchmarks/job_cost.py                  # 5 rounds of 1,500 steps
    python benchmarks/job_cost.py --arms torchrun,placerun,monitor_off --rounds 7
    python benchmarks/job_cost.py --arms placerun,h1 --arm h1=placement.monitor.handover_min_s=1
    python benchmarks/job_cost.py --arms placerun,before --tree before=/tmp/old-checkout

--arm NAME=OVERRIDE[,OVERRIDE...] adds a placerun arm with those overrides; --tree NAME=PATH adds
a placerun arm that imports placement from another checkout (PYTHONPATH), so that two versions
alternate in one run.
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
JOB = REPO / "benchmarks" / "job_cost_job.py"
BIN = Path(sys.executable).parent

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PLACERUN = [str(BIN / "placerun")]
ARMS = {  # arm -> (launcher, placement overrides)
    "torchrun": (TORCHRUN, []),
    "placerun": (PLACERUN, []),
    "monitor_off": (PLACERUN, ["placement.monitor.auto=false"]),
    "tuner_off": (PLACERUN, ["placement.tune.enabled=false"]),
    "unbound": (PLACERUN, ["placement.policy=none"]),
    "record_each": (PLACERUN, ["placement.monitor.record_min_s=0"]),
}
DEFAULT_ARMS = ("torchrun", "placerun", "monitor_off", "tuner_off", "unbound")


TREES: dict[str, str] = {}  # arm -> the checkout whose placement it runs (--tree)


def run_arm(arm: str, steps: int, warmup: int, nproc: int, work: Path) -> dict:
    out, logs = work / f"{arm}.json", work / f"{arm}-logs"
    launcher, overrides = ARMS[arm]
    if launcher is PLACERUN:
        overrides = overrides + [f"placement.monitor.log_dir={logs}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLACEMENT_")}
    if arm in TREES:
        env["PYTHONPATH"] = os.pathsep.join([TREES[arm]] + [p for p in [env.get("PYTHONPATH")] if p])
        launcher = [sys.executable, "-m", "placement.launcher"]
    cmd = launcher + ["--standalone", "--nproc-per-node", str(nproc)] + overrides + \
        [str(JOB), "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
    # (`python -m` puts the working directory first on sys.path: in this checkout's it would run
    # this checkout's launcher, whatever PYTHONPATH says)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=TREES.get(arm))
    if proc.returncode != 0:
        sys.exit(f"job_cost: arm {arm} exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    got = json.loads(out.read_text())
    threads = got.pop("threads")
    main = next(t for t in threads if t["main"])
    ours = [t for t in threads if t["name"].startswith("placement")]
    if ARMS[arm][0] is not TORCHRUN and not ours:  # placement refused its config or failed to start: no figure
        sys.exit(f"job_cost: arm {arm} ran without any thread of placement's: "
                 f"{(proc.stderr.strip().splitlines() or ['(no stderr)'])[-1][:300]}")
    n = got["steps"]
    got["main_cpu_us_per_step"] = main["cpu_ns"] / 1e3 / n
    got["placement_cpu_us_per_step"] = sum(t["cpu_ns"] for t in ours) / 1e3 / n
    got["placement_threads"] = {t["name"]: round(t["cpu_ns"] / 1e3 / n, 1) for t in ours}
    # torch's own threads (gloo's run loops, OpenMP's, the pin-memory thread): what the monitor's
    # future callbacks and hooks add there is placement's cost too, though no thread of ours spends it
    backend: dict[str, float] = {}
    for t in threads:
        if not t["main"] and not t["name"].startswith("placement"):
            backend[t["name"]] = backend.get(t["name"], 0.0) + t["cpu_ns"] / 1e3 / n
    got["backend_threads"] = {k: round(v, 1) for k, v in sorted(backend.items())}
    got["backend_cpu_us_per_step"] = sum(backend.values())
    got["self_reported"] = _self_reported(logs / "rank0.jsonl") if arm != "torchrun" else None
    # The end event's figure covers the monitor's whole life (start-up, warm-up, close): set
    # beside it the /proc figure over the same steps, each thread's CPU since it started.
    got["placement_whole_us_per_step"] = sum(t["cpu_total_ns"] for t in ours) / 1e3 / got["steps_total"]
    return got


def _self_reported(log: Path) -> dict | None:
    """The monitor's `end` event of rank 0: what it says it cost."""
    if not log.exists():
        return None
    end = None
    for line in log.read_text().splitlines():
        if '"type": "end"' in line or '"type":"end"' in line:
            rec = json.loads(line)
            if rec.get("source") == "monitor":
                end = rec
    if end is None:
        return None
    keys = ("monitor_us_per_step", "monitor_thread_us_per_step", "placement_cpu_us_per_step", "placement_cost_pct")
    return {k: end.get(k) for k in keys}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 rounds of 700 steps")
    p.add_argument("--rounds", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS))
    p.add_argument("--arm", action="append", default=[], metavar="NAME=OVERRIDE[,OVERRIDE...]",
                   help="a placerun arm with these overrides")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="a placerun arm running the placement of another checkout")
    args = p.parse_args()
    for spec, tree in [(a, False) for a in args.arm] + [(t, True) for t in args.tree]:
        name, _, value = spec.partition("=")
        if not name or not value or name in ARMS:
            print(f"job_cost: bad arm {spec!r}: NAME=VALUE with a new NAME", file=sys.stderr)
            sys.exit(2)
        if not tree:
            ARMS[name] = (PLACERUN, value.split(","))
        elif not (Path(value) / "placement" / "launcher.py").is_file():
            print(f"job_cost: --tree {spec!r}: {value}/placement/launcher.py is missing", file=sys.stderr)
            sys.exit(2)
        else:
            ARMS[name], TREES[name] = (PLACERUN, []), str(Path(value).resolve())
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        print(f"job_cost: unknown arm {bad[0]!r}; choose from {', '.join(ARMS)}", file=sys.stderr)
        sys.exit(2)
    rounds = args.rounds or (3 if args.quick else 5)
    steps = args.steps or (700 if args.quick else 1500)
    # The steady state starts once the exchange grid is agreed (four windows in, from two
    # windows after: step ~160 at 20-step windows): what a long job pays, not its start.
    warmup = max(200, steps // 6)
    results: dict[str, list[dict]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="job_cost-") as tmp:
        for r in range(rounds):
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            for arm in order:
                work = Path(tmp) / f"r{r}"
                work.mkdir(exist_ok=True)
                got = run_arm(arm, steps, warmup, args.nproc, work)
                results[arm].append(got)
                print(f"round {r} {arm:12s} {got['steps_per_s']:7.2f} steps/s  main {got['main_cpu_us_per_step']:7.0f} us/step"
                      f"  placement {got['placement_cpu_us_per_step']:6.1f} us/step {got['placement_threads']}"
                      f"  torch's {got['backend_threads']}"
                      f"  says {got['self_reported']}", flush=True)
    summary: dict = {"benchmark": "job_cost", "rounds": rounds, "steps": steps - warmup, "nproc": args.nproc}

    def ratio(arm: str, base: str):
        if arm not in results or base not in results:
            return None
        return round(statistics.median(a["steps_per_s"] / b["steps_per_s"]
                                       for a, b in zip(results[arm], results[base])), 3)

    for arm, runs in results.items():
        summary[f"{arm}_steps_per_s"] = round(statistics.median(g["steps_per_s"] for g in runs), 2)
        if arm != "torchrun":
            summary[f"{arm}_vs_torchrun"] = ratio(arm, "torchrun")
        ours = statistics.median(g["placement_cpu_us_per_step"] for g in runs)
        main_us = statistics.median(g["main_cpu_us_per_step"] for g in runs)
        summary[f"{arm}_placement_cpu_us_per_step"] = round(ours, 1)
        summary[f"{arm}_placement_pct_of_main"] = round(100 * ours / main_us, 3) if main_us else None
        summary[f"{arm}_backend_cpu_us_per_step"] = round(statistics.median(g["backend_cpu_us_per_step"] for g in runs), 1)
        said = [g["self_reported"].get("placement_cpu_us_per_step") for g in runs
                if g["self_reported"] and g["self_reported"].get("placement_cpu_us_per_step") is not None]
        if said:
            summary[f"{arm}_self_reported_us_per_step"] = round(statistics.median(said), 1)
            # its threads' part (less the hook's, on main) against /proc over the whole run
            threads = [g["self_reported"]["placement_cpu_us_per_step"] - (g["self_reported"].get("monitor_us_per_step") or 0.0)
                       for g in runs if g["self_reported"] and g["self_reported"].get("placement_cpu_us_per_step") is not None]
            whole = statistics.median(g["placement_whole_us_per_step"] for g in runs)
            summary[f"{arm}_proc_whole_us_per_step"] = round(whole, 1)
            summary[f"{arm}_self_threads_over_proc_whole"] = round(statistics.median(threads) / whole, 2) if whole else None
    for arm in ("placerun", "tuner_off", "unbound"):
        if arm in results and "monitor_off" in results:
            summary[f"{arm}_vs_monitor_off"] = ratio(arm, "monitor_off")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
