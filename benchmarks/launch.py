"""Launch cost of placerun against torchrun: the same trivial 2-rank gloo job (init, one
all-reduce, exit) under each, interleaved (ABBA order, so drift in machine load hits both
alike). Prints every run side by side (wall and CPU seconds), the medians, what placerun adds in-process (plan,
stage-1 binding, an unchanged rescan), and last one JSON line:
{"placerun_s": median, "torchrun_s": median, "ratio": placerun_s / torchrun_s}. Target: ratio <= 1.10.

    python benchmarks/launch.py [--quick] [--runs N]
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def launcher(name: str) -> list[str]:
    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "placement.launcher" if name == "placerun" else "torch.distributed.run"]


def timed_launch(name: str, job: str, log_dir: str) -> tuple[float, float]:
    """(wall s, CPU s of the launcher and all its workers) of one launch."""
    extra = [f"placement.monitor.log_dir={log_dir}"] if name == "placerun" else []
    cmd = [*launcher(name), "--standalone", "--nproc-per-node", "2", *extra, job]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        sys.exit(f"{name} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def in_process_costs() -> dict:
    """What placerun adds, measured here: plan_for_node (discovery + plan), stage-1 binding of one
    rank (mask + memory policy), and one rescan of a rank whose threads did not change."""
    from placement.bind.affinity import apply_process_mask
    from placement.bind.binder import RoleBinder
    from placement.bind.memory import apply_memory_policy
    from placement.config import load_config
    from placement.plan import plan_for_node

    t0 = time.perf_counter()
    _, plan = plan_for_node(load_config(), 2)
    plan_s = time.perf_counter() - t0
    rank_plan = plan.for_local_rank(0)
    before = os.sched_getaffinity(0)
    t0 = time.perf_counter()
    apply_process_mask(rank_plan.share())
    apply_memory_policy(rank_plan.memory)
    stage1_s = time.perf_counter() - t0
    binder = RoleBinder(rank_plan, None)
    binder.rescan()
    import placement.bind.binder as binder_mod

    binder_mod.SETTLE_S = 0.0  # measure the steady state: no thread is young any more
    binder.rescan()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        binder.rescan()
    rescan_us = (time.perf_counter() - t0) / n * 1e6
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), before)
    return {"plan_s": plan_s, "stage1_s": stage1_s, "rescan_unchanged_us": rescan_us}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 runs of each (under a minute)")
    p.add_argument("--runs", type=int, default=None, help="runs of each launcher (default 6, --quick 2)")
    args = p.parse_args()
    runs = args.runs or (2 if args.quick else 6)
    times: dict[str, list[float]] = {"placerun": [], "torchrun": []}
    cpu: dict[str, list[float]] = {"placerun": [], "torchrun": []}
    with tempfile.TemporaryDirectory(prefix="launch-bench-") as tmp:
        job = os.path.join(tmp, "job.py")
        Path(job).write_text(JOB)
        timed_launch("torchrun", job, tmp)  # warm the page cache for both (not counted)
        print(f"{'run':>4}  {'placerun s':>10}  {'torchrun s':>10}  {'placerun cpu s':>14}  {'torchrun cpu s':>14}")
        for i in range(runs):
            order = ("placerun", "torchrun") if i % 2 == 0 else ("torchrun", "placerun")
            for name in order:
                wall, used = timed_launch(name, job, os.path.join(tmp, "logs"))
                times[name].append(wall)
                cpu[name].append(used)
            print(f"{i:>4}  {times['placerun'][-1]:>10.3f}  {times['torchrun'][-1]:>10.3f}  "
                  f"{cpu['placerun'][-1]:>14.3f}  {cpu['torchrun'][-1]:>14.3f}", flush=True)
    placerun_s, torchrun_s = statistics.median(times["placerun"]), statistics.median(times["torchrun"])
    placerun_cpu, torchrun_cpu = statistics.median(cpu["placerun"]), statistics.median(cpu["torchrun"])
    print(f"{'med':>4}  {placerun_s:>10.3f}  {torchrun_s:>10.3f}  {placerun_cpu:>14.3f}  {torchrun_cpu:>14.3f}")
    print(f"wall ratio {placerun_s / torchrun_s:.3f}, CPU-time ratio {placerun_cpu / torchrun_cpu:.3f} "
          "(CPU time is the steadier figure on a shared machine)")
    costs = in_process_costs()
    print(f"placerun in-process: plan_for_node {costs['plan_s'] * 1e3:.1f} ms, stage-1 bind "
          f"{costs['stage1_s'] * 1e3:.2f} ms, rescan of an unchanged rank {costs['rescan_unchanged_us']:.1f} us")
    print(json.dumps({"placerun_s": round(placerun_s, 3), "torchrun_s": round(torchrun_s, 3),
                      "ratio": round(placerun_s / torchrun_s, 3)}))


if __name__ == "__main__":
    main()
