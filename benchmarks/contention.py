"""Contention benchmark: does the tuner remove the slowdown a co-runner causes, and does it
stay out of the way when nothing is wrong?

One rank, a real training-like loop: a torch CPU step of a few ms on the main thread
(torch.set_num_threads(1), like a GPU rank's Python thread), fed by a DataLoader with 2
worker processes, measured by placement.attach(). With --pool, main computes instead on the
intra-op pool the plan gives a CPU-only rank (main's and other's cores): there the tuner has
no free core to offer main, and must do no harm. Two scenarios, each in phases:

  hog:  quiet -> a foreign CPU hog (another process, spinning) pinned to the core the main
        thread runs on -> hog gone
  data: light batches -> batches whose CPU work is too heavy for the DataLoader's CPUs -> light

each run under four placements in fresh processes:

  none    no binding at all (policy=none)
  node    process-level node binding, what `torchrun --numa-binding=node` does (policy=node)
  static  our per-role plan, tuner off (policy=auto, tune.enabled=false)
  tune    our per-role plan with the tuner (policy=auto, tune.enabled=true)

Printed per phase: p50 and p99 step time (ms, wall time of one loop iteration including the
wait for data), the ratios to the quiet phase, and the steps until the step time recovers
(rolling median of one tune window back within RECOVERED x the quiet p50). "settled p99" is
the p99 of a phase after its first SETTLE_WINDOWS windows, the same cut for every mode.
The first window of every run (worker start, allocator warm-up) is left out of the quiet phase.
Each (scenario, mode) runs --repeat times, interleaved; phase figures are taken over the steps
of all its runs pooled (a single run's p99 rests on two or three steps), recovery is the
median over the runs;
"other load" is how many CPUs' worth of time the rest of the machine used meanwhile (this
benchmark's own processes, the hog included, subtracted): on a shared machine it says how
much to trust a row. The last line is one JSON object of headline figures.

    python benchmarks/contention.py --quick      # < 1 minute
    python benchmarks/contention.py              # 3x the steps, 5 runs of each (about 7 minutes)
    python benchmarks/contention.py --scenarios hog --modes static,tune --window-min-s 0.5

Its phases and recovery are counted in tune windows of --window steps, so the tuner's windows
are held at that (tune.window_min_s 0); --window-min-s 0.5 runs the product's default, windows
paced to 0.5 s (at these ~5 ms steps, 160 steps each: use the longer phases, not --quick).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

MODES = {
    "none": ["policy=none", "tune.enabled=false"],
    "node": ["policy=node", "tune.enabled=false"],
    "static": ["policy=auto", "tune.enabled=false"],
    "tune": ["policy=auto", "tune.enabled=true"],
}
SCENARIOS = ("hog", "data")
PHASES = {"hog": ("quiet", "hog", "gone"), "data": ("light", "heavy", "light again")}
RECOVERED = 1.2  # a rolling window median within this factor of the quiet p50 counts as recovered
SETTLE_WINDOWS = 3
WORKERS = 2
# CPU ms of work per batch in the DataLoader workers: light leaves them mostly idle; heavy is
# more than their CPUs deliver at the step rate (WORKERS workers, each one batch per HEAVY_MS).
LIGHT_MS = 0.3
HEAVY_MS = 8.0


@dataclass
class Steps:
    before: int
    during: int
    after: int

    @property
    def total(self) -> int:
        return self.before + self.during + self.after


# ---- the hog: another process, pinned to one CPU, spinning ---------------------------------
def hog(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


# ---- one run: a child process --------------------------------------------------------------
def main_thread_cpu() -> int:
    """The CPU the main thread runs on now (field 39 of its stat)."""
    with open(f"/proc/self/task/{os.getpid()}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rfind(b")") + 2:].split()[36])


def allowed_cpus(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return ""


# --nccl-lag: records reach the tuner as under NCCL timing: each step's comm durations settled
# LAG_STEPS steps later (tests/nccl_recorder_standins.settle_steps_late), so the monitor holds the last
# steps back until they settle, and batches every 2 windows (flush_every 40 > window 20).
LAG_STEPS = 2


def child(scenario: str, mode: str, steps: Steps, window: int, log_dir: str, out: str, lag: bool = False,
          pool: bool = False, window_min_s: float = 0.0) -> None:
    import torch
    from torch.utils.data import DataLoader, Dataset

    import placement
    from placement.config import load_config

    torch.set_num_threads(1)

    class Batches(Dataset):
        """Batch i costs HEAVY_MS of worker CPU in the data scenario's middle phase, else LIGHT_MS."""

        def __len__(self) -> int:
            return steps.total + WORKERS * 4

        def __getitem__(self, i: int):
            heavy = scenario == "data" and steps.before <= i < steps.before + steps.during
            end = time.thread_time() + (HEAVY_MS if heavy else LIGHT_MS) / 1000.0
            while time.thread_time() < end:  # decode/augment stand-in: a fixed amount of CPU work
                pass
            return torch.randn(64, 512), torch.randn(64, 512)

    cfg = load_config(MODES[mode] + ["strict=false", f"monitor.log_dir={log_dir}", f"tune.window={window}",
                                     f"tune.window_min_s={window_min_s}",
                                     f"monitor.rescan_every={window}", "monitor.summary_every=0"]
                      + ([f"monitor.flush_every={2 * window}"] if lag else []))
    handle = placement.attach(config=cfg)
    if not pool:  # attach() gave torch the plan's OMP_NUM_THREADS; this main thread computes alone
        torch.set_num_threads(1)
    if lag and handle.monitor is not None:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from nccl_recorder_standins import settle_steps_late

        settle_steps_late(handle, LAG_STEPS)  # the stand-in for NCCL's late durations
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(Batches(), batch_size=None, num_workers=WORKERS, prefetch_factor=4, persistent_workers=False)
    times: list[float] = []
    hog_proc = None
    hog_cpu = None
    batches = iter(handle.watch(loader))
    try:
        for step in range(steps.total):
            if scenario == "hog" and step == steps.before:
                hog_cpu = main_thread_cpu()
                hog_proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--hog", str(hog_cpu)])
            if hog_proc is not None and step == steps.before + steps.during:
                hog_proc.kill()
                hog_proc.wait()
                hog_proc = None
            t0 = time.perf_counter()
            x, y = next(batches)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            handle.step()
            times.append((time.perf_counter() - t0) * 1000.0)
        main_cpus = allowed_cpus(os.getpid())
    finally:
        if hog_proc is not None:
            hog_proc.kill()
            hog_proc.wait()
        handle.close()
    with open(out, "w") as f:
        json.dump({"times_ms": times, "hog_cpu": hog_cpu, "main_cpus_at_end": main_cpus}, f)


# ---- figures -------------------------------------------------------------------------------
def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def recovery_steps(times: list[float], start: int, end: int, quiet_p50: float, window: int) -> int | None:
    """Steps from `start` until a window's rolling median is back within RECOVERED x quiet p50."""
    for k in range(start, end - window + 1):
        if statistics.median(times[k:k + window]) <= RECOVERED * quiet_p50:
            return k - start
    return None


def phase_cuts(steps: Steps, window: int) -> list[tuple[int, int]]:
    """Step ranges of the three phases (the first window of a run, warm-up, left out)."""
    return [(window, steps.before), (steps.before, steps.before + steps.during),
            (steps.before + steps.during, steps.total)]


def phase_figures(series: list[list[float]], steps: Steps, window: int) -> dict:
    """p50, p99 and settled p99 of each phase over the steps of all `series` pooled (one run's
    p99 is its second or third slowest step: pooled runs give the tail three times the steps),
    and the ratios to the quiet phase."""
    phases = []
    for lo, hi in phase_cuts(steps, window):
        xs = [t for times in series for t in times[lo:hi]]
        settled = [t for times in series for t in times[min(lo + SETTLE_WINDOWS * window, hi - 1):hi]]
        phases.append({"p50": quantile(xs, 0.5), "p99": quantile(xs, 0.99), "settled_p99": quantile(settled, 0.99)})
    quiet = phases[0]
    return {"phases": phases,
            "during_settled_p99_ratio": phases[1]["settled_p99"] / quiet["p99"],
            "during_p50_ratio": phases[1]["p50"] / quiet["p50"],
            "after_p50_ratio": phases[2]["p50"] / quiet["p50"]}


def run_recovery(times: list[float], steps: Steps, window: int) -> int | None:
    """Steps of one run from the start of its middle phase until it recovered."""
    (qlo, qhi), (lo, hi), _ = phase_cuts(steps, window)
    return recovery_steps(times, lo, hi, quantile(times[qlo:qhi], 0.5), window)


def tune_actions(log_path: str) -> list[str]:
    out = []
    try:
        with open(log_path) as f:
            for line in f:
                e = json.loads(line)
                if e.get("type") == "tune" and e.get("phase") in ("kept", "applied"):
                    first, last = e["evidence"]["window"]
                    out.append(f"{e['phase']} {e['rule']} {e['role']} {e['change']['from']}->{e['change']['to']}"
                               + (f" gain {e['effect']['gain_pct']:+.0f}%" if e.get("effect")
                                  else f" (evidence: steps {first}-{last})"))
                elif e.get("type") == "rollback":
                    out.append(f"rollback {e['rule']} {e['role']}: {e['why']}")
                elif e.get("type") == "warning" and e.get("source") == "tune":
                    out.append(f"warning {e['rule']}: {e['message']}")
    except OSError:
        pass
    return out


def busy_cpu_seconds() -> float:
    """CPU time spent busy by the whole machine so far (all CPUs), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_one(scenario: str, mode: str, steps: Steps, window: int, tmp: str, rep: int, lag: bool = False,
            pool: bool = False, window_min_s: float = 0.0) -> dict:
    """One run in a fresh process; also measures how busy the rest of the machine was
    meanwhile (all CPU time minus this run's own processes, hog included), in CPUs."""
    log_dir = os.path.join(tmp, f"{scenario}-{mode}-{rep}")
    out = os.path.join(tmp, f"{scenario}-{mode}-{rep}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", scenario, mode, "--window", str(window),
           "--steps", f"{steps.before},{steps.during},{steps.after}", "--log-dir", log_dir, "--out", out] \
        + (["--nccl-lag"] if lag else []) + (["--pool"] if pool else []) + ["--window-min-s", str(window_min_s)]
    busy0, ours0, t0 = busy_cpu_seconds(), children_cpu_seconds(), time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"contention: {scenario}/{mode} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(out) as f:
        data = json.load(f)
    data["recovery_steps"] = run_recovery(data["times_ms"], steps, window)
    data["actions"] = tune_actions(os.path.join(log_dir, "rank0.jsonl"))
    data["other_load_cpus"] = max(0.0, (busy_cpu_seconds() - busy0) - (children_cpu_seconds() - ours0)) / wall
    return data


def combine_runs(runs: list[dict], steps: Steps, window: int) -> dict:
    """Phase figures over the pooled steps of repeated runs; recovery and load as medians
    over the runs; each run's own ratio, recovery and tuner actions in `per_run`."""
    def med(values):
        known = [v for v in values if v is not None]
        return statistics.median(known) if len(known) > len(values) / 2 else None

    out = dict(runs[0])
    out.update(phase_figures([r["times_ms"] for r in runs], steps, window))
    out["per_run"] = [{"main_cpus_at_end": r["main_cpus_at_end"], "hog_cpu": r.get("hog_cpu"),
                       "actions": r["actions"], "recovery_steps": r["recovery_steps"],
                       "settled_p99_ratio": phase_figures([r["times_ms"]], steps, window)["during_settled_p99_ratio"]}
                      for r in runs]
    out["recovery_steps"] = med([r["recovery_steps"] for r in runs])
    out["recovery_windows"] = None if out["recovery_steps"] is None else round(out["recovery_steps"] / window, 2)
    out["other_load_cpus"] = med([r["other_load_cpus"] for r in runs])
    out["runs"] = len(runs)
    return out


def fmt(x: float | None, digits: int = 2) -> str:
    return "never" if x is None else f"{x:.{digits}f}"


def print_table(scenario: str, results: dict[str, dict], steps: Steps, window: int) -> None:
    names = PHASES[scenario]
    runs = next(iter(results.values()))["runs"]
    print(f"\nscenario {scenario}: phases {names[0]} {steps.before} steps, {names[1]} {steps.during}, "
          f"{names[2]} {steps.after}; tune window {window} steps; phase figures over the steps of {runs} run(s) pooled, recovery their median")
    head = (f"{'mode':<7}" + "".join(f"{n + ' p50/p99 ms':>24}" for n in names)
            + f"{names[1] + ' settled p99':>20}{'p50 x quiet':>13}{'settled p99 x quiet p99':>25}"
            + f"{'recovery steps':>16}{names[2] + ' p50 x quiet':>22}{'other load':>12}")
    print(head)
    print("-" * len(head))
    for mode, r in results.items():
        ph = r["phases"]
        print(f"{mode:<7}" + "".join(f"{p['p50']:>15.2f} /{p['p99']:>7.2f}" for p in ph)
              + f"{ph[1]['settled_p99']:>20.2f}{r['during_p50_ratio']:>13.2f}{r['during_settled_p99_ratio']:>25.2f}"
              + f"{fmt(r['recovery_steps'], 0):>16}{r['after_p50_ratio']:>22.2f}{r['other_load_cpus']:>8.2f} CPU")
    for mode, r in results.items():
        for k, run in enumerate(r["per_run"]):
            extra = f" (hog pinned to cpu {run['hog_cpu']})" if run["hog_cpu"] is not None else ""
            print(f"  {mode} run {k + 1}: main thread ends on cpus {run['main_cpus_at_end']}{extra}; "
                  f"{names[1]} settled p99 x quiet p99 {run['settled_p99_ratio']:.2f}, "
                  f"recovery steps {fmt(run['recovery_steps'], 0)}")
            for a in run["actions"]:
                print(f"    {a}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps: under a minute")
    ap.add_argument("--window", type=int, default=20, help="tune window in steps (placement.tune.window)")
    ap.add_argument("--window-min-s", type=float, default=0.0,
                    help="placement.tune.window_min_s (default 0: windows of --window steps, which the phases "
                         "and recovery are counted in; the product's 0.5 paces them to 0.5 s at short steps)")
    ap.add_argument("--repeat", type=int, help="runs per scenario and mode, interleaved (default 1 with --quick, else 5)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}")
    ap.add_argument("--nccl-lag", action="store_true",
                    help=f"records reach the tuner as under NCCL timing: {LAG_STEPS} steps late, every 2 windows")
    ap.add_argument("--pool", action="store_true",
                    help="main computes on the plan's intra-op pool (a CPU-only rank), not alone")
    ap.add_argument("--hog", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--steps", help=argparse.SUPPRESS)
    ap.add_argument("--log-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.hog is not None:
        hog(args.hog)
        return 0
    if args.child:
        steps = Steps(*map(int, args.steps.split(",")))
        child(args.child[0], args.child[1], steps, args.window, args.log_dir, args.out, args.nccl_lag, args.pool,
              args.window_min_s)
        return 0
    modes = args.modes.split(",")
    scenarios = args.scenarios.split(",")
    for name, valid in ((modes, MODES), (scenarios, SCENARIOS)):
        bad = [x for x in name if x not in valid]
        if bad:
            print(f"contention: unknown {bad[0]!r}; choose from {', '.join(valid)}", file=sys.stderr)
            return 2
    w = args.window
    steps = Steps(4 * w, 8 * w, 4 * w) if args.quick else Steps(12 * w, 24 * w, 12 * w)
    print(f"contention benchmark on {os.cpu_count()} CPUs, pid {os.getpid()}; modes {', '.join(modes)}")
    started = time.monotonic()
    repeat = args.repeat or (1 if args.quick else 5)
    runs: dict[tuple[str, str], list[dict]] = {(sc, m): [] for sc in scenarios for m in modes}
    with tempfile.TemporaryDirectory(prefix="placement-contention-") as tmp:
        for rep in range(repeat):  # interleaved, so a burst of load elsewhere hits every mode alike
            for scenario in scenarios:
                for m in modes:
                    runs[(scenario, m)].append(run_one(scenario, m, steps, w, tmp, rep, args.nccl_lag, args.pool,
                                                                args.window_min_s))
    all_results = {sc: {m: combine_runs(runs[(sc, m)], steps, w) for m in modes} for sc in scenarios}
    for scenario in scenarios:
        print_table(scenario, all_results[scenario], steps, w)
    print(f"\n({time.monotonic() - started:.0f} s)")
    hog_res = all_results.get("hog", {})
    headline = {
        "nccl_lag_steps": LAG_STEPS if args.nccl_lag else 0,
        "pool": args.pool,
        "quiet_p99_ms": round(hog_res["tune"]["phases"][0]["p99"], 3) if "tune" in hog_res else None,
        "hog_p99_ratio": {m: round(r["during_settled_p99_ratio"], 3) for m, r in hog_res.items()},
        "recovery_windows": hog_res["tune"]["recovery_windows"] if "tune" in hog_res else None,
        "quiet_p50_tune_over_static": (round(hog_res["tune"]["phases"][0]["p50"] / hog_res["static"]["phases"][0]["p50"], 3)
                                       if {"tune", "static"} <= set(hog_res) else None),
        "data_heavy_p50_ratio": {m: round(r["during_p50_ratio"], 3) for m, r in all_results.get("data", {}).items()},
        "other_load_cpus": round(statistics.median(r["other_load_cpus"] for rs in runs.values() for r in rs), 2),
    }
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
