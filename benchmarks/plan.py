"""Planning: what each policy gives a rank's hot threads, and what planning costs.

usage: python benchmarks/plan.py [--quick] [--repeat N]

For the DGX H100-like and EPYC NPS4 fixtures of tests/sysfs_builder.py (8 ranks each) and the
live machine (2 ranks), every policy is planned from the same discovered topology and measured
side by side:
  plan ms          median make_plan time over N runs (pure: no I/O)
  main cpus        CPUs the rank's main thread may run on (mean over ranks)
  main sharers     ranks whose CPU set holds a CPU of that main thread's core(s) (mean; 1 = alone)
  main perf_rank   worst perf_rank main's set allows minus the node's best (0 = only fastest cores)
  remote share     fraction of the rank's CPUs outside its GPU's node (0 = all local)
plus plan_for_node on the live machine (discovery + planning, what `placement plan` and placerun
pay). The last line is one JSON object of headline figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from placement.config import Policy, load_config  # noqa: E402
from placement.plan import JobSpec, make_plan, plan_for_node  # noqa: E402
from placement.roles import ThreadRole  # noqa: E402
from placement.topology import discover  # noqa: E402

FIXTURE_RANKS = {"dgx_h100": 8, "epyc_nps4": 8}


def median_ms(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def quality(topo, plan) -> dict:
    """Per-plan figures about the main thread, averaged over ranks."""
    core_of = {}
    for members in topo.groups("core").values():
        for c in members:
            core_of[c] = min(members)
    node_of = {c.id: c.numa for c in topo.cpus}
    perf = {c.id: c.perf_rank if c.perf_rank is not None else 0 for c in topo.cpus}
    gpu_node = {g.index: g.numa for g in topo.gpus}
    cpus, sharers, perf_gap, remote = [], [], [], []
    for r in plan.ranks:
        main = r.cpus(ThreadRole.MAIN)
        if not main:
            return {"main_cpus": None, "main_sharers": None, "main_perf_gap": None, "remote_share": None}
        main_cores = {core_of.get(c, c) for c in main}
        cpus.append(len(main))
        sharers.append(sum(1 for o in plan.ranks if {core_of.get(c, c) for c in o.share()} & main_cores))
        home = gpu_node.get(r.gpu.index) if r.gpu else node_of[min(main)]
        node_best = min(perf[c] for c in topo.usable() if node_of[c] == home)
        perf_gap.append(max(perf[c] for c in main) - node_best)
        share = r.share()
        remote.append(sum(1 for c in share if node_of[c] != home) / len(share))
    return {"main_cpus": statistics.mean(cpus), "main_sharers": statistics.mean(sharers),
            "main_perf_gap": statistics.mean(perf_gap), "remote_share": statistics.mean(remote)}


def fmt(v) -> str:
    return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) and not v.is_integer() else f"{v:g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (< 1 minute)")
    ap.add_argument("--repeat", type=int, default=None)
    args = ap.parse_args()
    repeat = args.repeat or (20 if args.quick else 200)
    from sysfs_builder import make_tree

    headline: dict = {}
    tmp = tempfile.mkdtemp(prefix="plan-bench-")
    cases = [(name, discover(make_tree(tmp, name)), n) for name, n in FIXTURE_RANKS.items()]
    cases.append(("live", discover("/"), 2))
    print(f"{'topology':10} {'ranks':>5} {'policy':13} {'plan ms':>8} {'main cpus':>9} {'main sharers':>12} "
          f"{'main perf_rank':>14} {'remote share':>12}")
    for name, topo, n in cases:
        for policy in Policy.values():
            cfg = load_config([f"policy={policy}", "strict=false"])
            job = JobSpec(n, dataloader_workers=cfg.dataloader_workers)
            ms = median_ms(lambda: make_plan(topo, job, cfg), repeat)
            q = quality(topo, make_plan(topo, job, cfg))
            print(f"{name:10} {n:>5} {policy:13} {ms:8.2f} {fmt(q['main_cpus']):>9} {fmt(q['main_sharers']):>12} "
                  f"{fmt(q['main_perf_gap']):>14} {fmt(q['remote_share']):>12}")
            if policy in ("auto", "node") and name != "live":
                headline[f"{name}_{policy}_plan_ms"] = round(ms, 3)
                headline[f"{name}_{policy}_main_cpus"] = q["main_cpus"]
                headline[f"{name}_{policy}_main_sharers"] = q["main_sharers"]
                headline[f"{name}_{policy}_main_perf_gap"] = q["main_perf_gap"]
    live_ms = median_ms(lambda: plan_for_node(load_config(["strict=false"]), 2), max(3, repeat // 10))
    print(f"live plan_for_node (discovery + plan, 2 ranks): {live_ms:.1f} ms")
    headline["live_plan_for_node_ms"] = round(live_ms, 2)
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
