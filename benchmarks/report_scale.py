"""`placement report` on a cluster's logs: 1,024 ranks x 1,000 steps (a million step records)
from 128 nodes of 8 ranks, generated here as the monitor writes them, then reported
(summary, heatmap) in a fresh process whose wall time and peak RSS are measured.

usage: python benchmarks/report_scale.py [--quick] [--ranks N] [--steps N] [--trace [--trace-part]]
       python benchmarks/report_scale.py --long [--quick] [--ranks N] [--steps N]
       python benchmarks/report_scale.py --week [--quick] [--ranks N] [--steps N]

The logs: one directory per node (node000/rank0.jsonl ...), each record shaped like a real
StepRecord line (main, nccl and pin_memory roles, span figures every 10th step), a `start`
event per rank naming its host and node, and rank 0's straggler events every 10 steps: one
rank cpu-slow for 200 steps, one data-slow for 100, a comm-slow stretch, and one rank that
stops at step 800 with a `stall` event. --quick: 256 ranks x 250 steps. --trace also times
`--trace` (a million steps make a ~1 GB trace file).
Target: the million-record report in < 30 s and < 2 GiB here. Last line: one JSON object.

--long: a long job's logs, with a `digest` line every 1,000 steps and each rank's event index
(`rank<R>.events`: every line but the step lines) as the monitor writes them (monitor.digest_every),
1,024 ranks x 20,000 steps (20 M step lines, ~8 GiB; --quick 256 x 4,000), reported with `--read
digests` (by the indexes), with `--read steps`, and with `--read digests` again with the indexes
moved aside (`digests_scan`: how logs written before the indexes are read) in fresh processes, each
extrapolated to a week at 1 step/s of 1,024 ranks (619 M step lines; linear in the steps, an upper
bound for the index read, whose start-up cost does not grow).

--week: that week itself as the index read meets it: 1,024 ranks x 604,800 steps, every digest
(619,520 of them) in the ranks' event indexes and logs of a start line each (the step lines are
never read), reported with `--read digests` in a fresh process. Target: under a minute here.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from placement.monitor.health.peers import peer_event  # noqa: E402

RANKS_PER_NODE = 8
T0 = 1_800_000_000.0


def _role(threads, cpu, runq, cpus, span):
    if span:
        return (f'{{"threads":{threads},"cpu_ms":{cpu:.4f},"runq_ms":{runq:.4f},"nivcsw":3,"migrations":0,'
                f'"minflt":12,"mhz":2994.5,"cpus":[{cpus}],"span_steps":10}}')
    return (f'{{"threads":{threads},"cpu_ms":{cpu:.4f},"runq_ms":{runq:.4f},"nivcsw":null,"migrations":null,'
            f'"minflt":null,"mhz":2994.5,"cpus":[{cpus}],"span_steps":1}}')


def scenario(ranks: int, steps: int) -> dict:
    return {"cpu_slow": 77 % ranks, "cpu_steps": range(steps * 3 // 10, steps // 2),
            "data_slow": 500 % ranks, "data_steps": range(steps * 6 // 10, steps * 7 // 10),
            "comm_steps": range(steps // 10, steps // 10 + 20),
            "stalled": 900 % ranks, "stall_step": steps * 8 // 10}


def generate(root: Path, ranks: int, steps: int, every: int = 10, seed: int = 0, digest_every: int = 0) -> dict:
    """Every rank's log under root/node<NNN>/ (ranks written in parallel, one process per CPU)."""
    import multiprocessing

    sc = scenario(ranks, steps)
    for node in range(-(-ranks // RANKS_PER_NODE)):
        (root / f"node{node:03d}").mkdir(parents=True, exist_ok=True)
    args = [(root, rank, ranks, steps, every, seed, digest_every) for rank in range(ranks)]
    with multiprocessing.get_context("fork").Pool(len(os.sched_getaffinity(0))) as pool:
        pool.starmap(_write_rank, args, chunksize=max(1, ranks // 64))
    return sc


def _write_rank(root: Path, rank: int, ranks: int, steps: int, every: int, seed: int, digest_every: int) -> None:
    from placement.records.digest import StepDigest
    from placement.records.parts import split_step

    rng = random.Random(seed * 1_000_003 + rank)
    sc = scenario(ranks, steps)
    base_ms = 100.0
    node = rank // RANKS_PER_NODE
    lines = [json.dumps({"type": "start", "t": T0 - 1.0, "rank": rank, "source": "monitor", "pid": 1000 + rank,
                         "host": f"host{node:03d}", "node_rank": node, "backend": "nccl"}, separators=(",", ":"))]
    t = T0
    last = sc["stall_step"] if rank == sc["stalled"] else steps
    cpu_r = rank == sc["cpu_slow"]
    data_r = rank == sc["data_slow"]
    local = rank % RANKS_PER_NODE
    digest = StepDigest(rank)
    index = [lines[0]]  # every line but the step lines: the log's event index, as EventLog writes it
    with open(root / f"node{node:03d}" / f"rank{rank}.jsonl", "w") as f:
        for step in range(1, last + 1):
            data = 0.5 + rng.random() * 0.2 + (30.0 if data_r and step in sc["data_steps"] else 0.0)
            runq = 0.1 + rng.random() * 0.1 + (25.0 if cpu_r and step in sc["cpu_steps"] else 0.0)
            comm = 20.0 + rng.random() * 2 + (40.0 if step in sc["comm_steps"] else 0.0)
            step_ms = base_ms + rng.random() * 3 + (data - 0.5) + (runq - 0.1) + (comm - 20.0)
            t += step_ms / 1e3
            enter = t - (comm + 1.0) / 1e3
            span = step % 10 == 0
            roles = (f'"main":{_role(1, step_ms - comm - data - runq, runq, local * 2, span)},'
                     f'"nccl":{_role(2, 1.2, 0.05, local * 2 + 1, span)},'
                     f'"pin_memory":{_role(1, 0.3, 0.01, local * 2 + 1, span)}')
            verdict = "cpu-bound" if runq > 10 else ("data-bound" if data > 10 else "comm-bound")
            lines.append(f'{{"type":"step","rank":{rank},"step":{step},"t":{t:.6f},"step_ms":{step_ms:.4f},'
                         f'"data_ms":{data:.4f},"comm_ms":{comm:.4f},"comm_count":4,"roles":{{{roles}}},'
                         f'"verdict":"{verdict}","local_rank":{local},"comm_enter_t":{enter:.6f},"probe_steps":1}}')
            if digest_every:  # as the monitor's DigestSink sums them (placement/records/digest.py)
                digest.add_step(step, t, step_ms, split_step(step_ms, data, comm, runq), verdict, True)
                if digest.steps == digest_every or step == last:
                    lines.append(json.dumps({"type": "digest", **digest.fields()}, separators=(",", ":")))
                    index.append(lines[-1])
                    digest = StepDigest(rank)
            if len(lines) >= 10_000:
                f.write("\n".join(lines) + "\n")
                lines = []
        if rank == 0:
            lines.extend(_rank0_events(ranks, steps, every, sc))
            index.extend(_rank0_events(ranks, steps, every, sc))
        f.write("\n".join(lines) + "\n")
    with open(root / f"node{node:03d}" / f"rank{rank}.events", "w") as f:
        f.write("\n".join(index) + "\n")


def _rank0_events(ranks: int, steps: int, every: int, sc: dict) -> list[str]:
    out = []
    for first in range(1, steps + 1, every):
        window = range(first, first + every)
        t = T0 + (first + every) * 0.125
        stragglers, more, job_wide = [], {}, None
        if window.start in sc["cpu_steps"]:
            stragglers.append({"kind": "cpu-slow", "ranks": [sc["cpu_slow"]], "lateness_ms": 25.0,
                               "why": "its main thread waits 25.1 ms/step in the runqueue (CPU stall) vs 0.2 on peers",
                               "cost_ms_per_step": 24.0, "cost_pct": 19.4,
                               "cost_by_cause": {"cpu_stall": 24.0, "data": 0.0, "compute": 0.0}})
        if window.start in sc["data_steps"]:
            stragglers.append({"kind": "data-slow", "ranks": [sc["data_slow"]], "lateness_ms": 30.0,
                               "why": "waits 30.5 ms/step for data vs 0.6 on peers",
                               "cost_ms_per_step": 29.5, "cost_pct": 22.8,
                               "cost_by_cause": {"cpu_stall": 0.0, "data": 29.5, "compute": 0.0}})
        if window.start in sc["comm_steps"]:
            job_wide = {"kind": "comm-slow", "cause": "comm", "cost_ms_per_step": 40.0, "cost_pct": 40.0,
                        "why": "all ranks enter together but collectives take 60 ms vs 20"}
        if stragglers or job_wide:
            event = {"type": "straggler", "t": t, "rank": 0, "steps": [window.start, window.stop - 1],
                     "stragglers": stragglers, "more": more, "waiting": f"0-{ranks - 1}" if stragglers else []}
            if job_wide:
                event["job_wide"] = job_wide
            out.append(json.dumps(event, separators=(",", ":")))
    # As rank 0's peer watch writes it from the hung rank's post (placement/monitor/health/peers.py).
    stall = peer_event({"phase": "stalled", "rank": sc["stalled"], "last_step": sc["stall_step"], "stalled_s": 30.4,
                        "threshold_s": 30.0, "main": {"tid": 4242, "state": "S", "wchan": "futex_do_wait",
                                                      "stack": ['File "train.py", line 80 in step']}})
    out.append(json.dumps({"type": "stall", "t": T0 + sc["stall_step"] * 0.125 + 30, "rank": 0, **stall},
                          separators=(",", ":")))
    return out


def run_report(root: Path, out: Path, trace: bool, trace_part: list[str], read: str = "") -> dict:
    cmd = [sys.executable, "-m", "placement.cli", "report", str(root)]
    cmd += ["--read", read] if read else ["--heatmap", str(out / "heatmap.png")]
    if trace:
        cmd += ["--trace", str(out / "trace.json"), *trace_part]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    seconds = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode != 0:
        raise SystemExit(f"report failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {"seconds": seconds, "peak_mib": peak_kib / 1024 if peak_kib > before else None, "stdout": proc.stdout}


WEEK_STEPS = 7 * 24 * 3600  # a week at 1 step/s
DIGEST_EVERY = 1000  # monitor.digest_every's default


def long_job(ranks: int, steps: int) -> dict:
    """A long job's logs (a digest every DIGEST_EVERY steps, as the monitor writes them) reported
    by their digests and by every step line, each in a fresh process; both extrapolated to a
    week at 1 step/s of 1,024 ranks (linear in the lines read: the same reader, more of the
    same lines)."""
    work = Path(tempfile.mkdtemp(prefix="report_scale_long."))
    try:
        t0 = time.perf_counter()
        sc = generate(work / "logs", ranks, steps, digest_every=DIGEST_EVERY)
        gen_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in (work / "logs").rglob("*.jsonl"))
        index_size = sum(f.stat().st_size for f in (work / "logs").rglob("*.events"))
        by = {read: run_report(work / "logs", work, False, [], read=read) for read in ("digests", "steps")}
        print(by["digests"]["stdout"][:2000])
        # The same logs without their event indexes (written before them): digests found by scanning.
        for f in (work / "logs").rglob("*.events"):
            f.rename(f.with_suffix(".aside"))
        by["digests_scan"] = run_report(work / "logs", work, False, [], read="digests")
        records = ranks * steps - (steps - sc["stall_step"])
        scale = WEEK_STEPS * 1024 / (ranks * steps)
        head = {"ranks": ranks, "steps": steps, "records": records, "digest_every": DIGEST_EVERY,
                "log_gib": round(size / 2**30, 2), "index_kib_per_rank": round(index_size / 1024 / ranks, 1),
                "generate_s": round(gen_s, 1), "cpus": len(os.sched_getaffinity(0))}
        for read, res in by.items():
            head[f"{read}_s"] = round(res["seconds"], 2)
            head[f"{read}_peak_mib"] = None if res["peak_mib"] is None else round(res["peak_mib"], 1)
            head[f"week_1024_ranks_{read}_min"] = round(res["seconds"] * scale / 60, 1)
        text = by["digests"]["stdout"]
        head["named"] = {"cpu_slow": f"cpu-slow         1 rank(s), windows each: {sc['cpu_slow']} in" in text,
                         "data_slow": f"data-slow        1 rank(s), windows each: {sc['data_slow']} in" in text,
                         "by_digests": "read by digests" in text}
        head["target_min"] = 10  # a week of 1,024 ranks reported in minutes, extrapolated (--week measures it)
        head["met"] = head["week_1024_ranks_digests_min"] < head["target_min"] and all(head["named"].values())
        return head
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write_week_rank(root: Path, rank: int, digests: int, template: dict) -> None:
    """A rank of a week-long job as `placement report --read digests` meets it: its log (here only
    the start line: the step lines are never read) and its event index with every digest."""
    node = rank // RANKS_PER_NODE
    start = json.dumps({"type": "start", "t": T0 - 1.0, "rank": rank, "source": "monitor", "pid": 1000 + rank,
                        "host": f"host{node:03d}", "node_rank": node, "backend": "nccl"}, separators=(",", ":"))
    lines = [start]
    for k in range(digests):
        d = dict(template, rank=rank, t=T0 + (k + 1) * DIGEST_EVERY * 0.1,
                 steps=[k * DIGEST_EVERY + 1, (k + 1) * DIGEST_EVERY])
        lines.append(json.dumps({"type": "digest", **d}, separators=(",", ":")))
    folder = root / f"node{node:03d}"
    (folder / f"rank{rank}.jsonl").write_text(start + "\n")
    (folder / f"rank{rank}.events").write_text("\n".join(lines) + "\n")


def week_job(ranks: int, steps: int) -> dict:
    """A week at 1 step/s read by its event indexes, not extrapolated: every digest of `steps` steps
    of `ranks` ranks written (one template digest of 1,000 real-shaped steps, its step range and
    time changed), then `placement report --read digests` in a fresh process."""
    import multiprocessing

    from placement.records.digest import StepDigest
    from placement.records.parts import split_step

    rng = random.Random(7)
    digest = StepDigest(0)
    for step in range(1, DIGEST_EVERY + 1):
        data, runq, comm = 0.5 + rng.random() * 0.2, 0.1 + rng.random() * 0.1, 20.0 + rng.random() * 2
        step_ms = 100.0 + rng.random() * 3 + data + runq + comm - 20.6
        digest.add_step(step, T0 + step * 0.1, step_ms, split_step(step_ms, data, comm, runq), "comm-bound", True)
    template = digest.fields()
    work = Path(tempfile.mkdtemp(prefix="report_scale_week."))
    try:
        for node in range(-(-ranks // RANKS_PER_NODE)):
            (work / "logs" / f"node{node:03d}").mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with multiprocessing.get_context("fork").Pool(len(os.sched_getaffinity(0))) as pool:
            pool.starmap(_write_week_rank, [(work / "logs", r, steps // DIGEST_EVERY, template) for r in range(ranks)],
                         chunksize=max(1, ranks // 64))
        gen_s = time.perf_counter() - t0
        index = sum(f.stat().st_size for f in (work / "logs").rglob("*.events"))
        res = run_report(work / "logs", work, False, [], read="digests")
        print(res["stdout"][:1500])
        return {"ranks": ranks, "steps": steps, "digests": ranks * (steps // DIGEST_EVERY),
                "index_mib": round(index / 2**20, 1), "generate_s": round(gen_s, 1),
                "digests_s": round(res["seconds"], 2),
                "digests_peak_mib": None if res["peak_mib"] is None else round(res["peak_mib"], 1),
                "read_by_index": "event indexes of" in res["stdout"], "target_s": 60,
                "met": res["seconds"] < 60 and "event indexes of" in res["stdout"]}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="256 ranks x 250 steps (< 1 minute)")
    ap.add_argument("--long", action="store_true",
                    help="a long job read by its digests and by every line: 1,024 ranks x 20,000 steps "
                         "(--quick: 256 x 4,000), extrapolated to a week")
    ap.add_argument("--week", action="store_true",
                    help="a week at 1 step/s of 1,024 ranks read by its event indexes, written directly "
                         "(--quick: 256 ranks)")
    ap.add_argument("--ranks", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--trace", action="store_true", help="also write and time --trace")
    ap.add_argument("--trace-part", action="store_true",
                    help="with --trace: only 100 steps of 64 ranks (--steps, --ranks)")
    args = ap.parse_args()
    if args.week:
        print(json.dumps(week_job(args.ranks or (256 if args.quick else 1024), args.steps or WEEK_STEPS)))
        return
    if args.long:
        print(json.dumps(long_job(args.ranks or (256 if args.quick else 1024),
                                  args.steps or (4000 if args.quick else 20_000))))
        return
    ranks = args.ranks or (256 if args.quick else 1024)
    steps = args.steps or (250 if args.quick else 1000)
    work = Path(tempfile.mkdtemp(prefix="report_scale."))
    try:
        t0 = time.perf_counter()
        sc = generate(work / "logs", ranks, steps)
        gen_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in (work / "logs").rglob("*.jsonl"))
        part = ["--steps", f"{steps // 2 + 1}:{steps // 2 + 100}", "--ranks", "0-63"] if args.trace_part else []
        res = run_report(work / "logs", work, args.trace, part)
        text = res["stdout"]
        print(text[:3000])
        named = {"cpu_slow": f"cpu-slow         1 rank(s), windows each: {sc['cpu_slow']} in" in text,
                 "data_slow": f"data-slow        1 rank(s), windows each: {sc['data_slow']} in" in text,
                 "stalled_first": text.find(f"rank {sc['stalled']} (") < text.find("held the job back")}
        head = {"ranks": ranks, "steps": steps, "records": ranks * steps - (steps - sc["stall_step"]),
                "log_mib": round(size / 2**20, 1), "generate_s": round(gen_s, 2),
                "report_s": round(res["seconds"], 2),
                "peak_mib": None if res["peak_mib"] is None else round(res["peak_mib"], 1),
                "heatmap_kib": round((work / "heatmap.png").stat().st_size / 1024, 1),
                "trace_mib": round((work / "trace.json").stat().st_size / 2**20, 1) if args.trace else None,
                "trace_part": " ".join(part) or None,
                "named": named, "target_s": 30, "target_mib": 2048}
        head["met"] = (head["report_s"] < 30 and (head["peak_mib"] or 0) < 2048 and all(named.values())
                       if ranks * steps >= 1_000_000 else None)
        print(json.dumps(head))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
