"""A soak: a real DDP job across hosts under placerun for M minutes, tuner on, DataLoader workers
respawning every epoch; does memory stay flat, does binding stay put, how much log does it write?

usage: python benchmarks/soak.py [--minutes M] [--quick] [--hosts N] [--ranks-per-host K] [--own-cores] [--keep DIR]
(--quick: 1 minute; default 6 minutes; --hosts 2, 1 rank each by default; --hosts 1 --ranks-per-host 2
is the README's main job, balanced, on one host)

The job: N hosts of the test bed (tests/hostbed.py: network + UTS namespaces on a bridge, root),
one placerun agent per host (`--nnodes N --rdzv-backend c10d`, K ranks each, gloo over the bed's
network; --own-cores: each host's processes on a core of their own, CPU i for host i, as hosts
that do not share cores), each rank the README's main job's loop (examples/train_ddp.py: an MLP under DDP fed by
2 DataLoader worker processes that respawn every 20-step epoch: thousands of thread births)
with placement's defaults (tuner on). Without the bed (not root, no namespaces) the same ranks
run as agents on this host, and the JSON says `"hosts": 1` with the reason on stderr.

Every 2 s each rank samples its own VmRSS and Python's allocated blocks (the monitor's and the
loop's objects: what a leak in either grows); at the end it reads back, with the workers of the
last epoch alive, every thread's CPU set against the role's planned set (drift left unrepaired).
From the placement logs: events per hour by type, binding drift the binder found and repaired
(`bind` events with `drift`), and the bytes the logs took per step per rank, as written and once
rotated (compressed as monitor.log_rotate_mb compresses a rotated log), with what each comes to
for a week at 1 step/s on 16,384 ranks. The job is balanced (every rank runs the same loop), so
every `straggler` event that names a rank is a false one: counted per 10,000 exchange windows
(`straggler_events_per_10k_windows`; the target is at most 1), job-wide slowdowns apart.

Memory growth is the least-squares slope of the samples against the step after the first quarter
of the run (start-up: allocator pools, caches filling), in MiB per 10,000 steps.
Target: growth under 1 MiB per 10,000 steps on every rank, no drift left unrepaired.
Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from placement.report.logs import read_logs  # noqa: E402
SAMPLE_EVERY_S = 2.0
STOP_CHECK_EVERY = 50  # steps between the ranks' all_reduce of "time is up" (every rank stops at one step)
PORT = 29400
WEEK_S = 7 * 24 * 3600
BIG_JOB_RANKS = 16384


# ---- one rank -----------------------------------------------------------------------------
def worker(out: Path, seconds: float) -> None:
    sys.path.insert(0, str(REPO / "examples"))
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler
    from train_ddp import FEATURES, SyntheticRegression

    import placement
    from placement import _procfs
    from placement.bind.where import where_threads_run

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = SyntheticRegression(32 * 20 * world)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=2, persistent_workers=False)
    handle = placement.attach(model, optimizer)
    deadline = time.monotonic() + seconds
    samples, step, epoch, stop = [], 0, 0, torch.zeros(1)
    next_sample = 0.0
    off_plan = None
    while off_plan is None:
        sampler.set_epoch(epoch)
        for x, y in handle.watch(loader):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            now = time.monotonic()
            if now >= next_sample:
                next_sample = now + SAMPLE_EVERY_S
                samples.append({"t": time.time(), "step": step, "py_blocks": sys.getallocatedblocks(),
                                "rss_kib": int(_procfs.status_value(_procfs.status(os.getpid()), b"VmRSS:").split()[0])})
            if step % STOP_CHECK_EVERY == 0:
                stop.fill_(1.0 if now >= deadline else 0.0)
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                if stop.item():  # this epoch's workers are alive: read every thread back now
                    rows = [] if handle.binder is None else where_threads_run(handle.binder)
                    off_plan = [{"tid": r.tid, "name": r.name, "role": r.role.value, "planned": sorted(r.planned),
                                 "allowed": sorted(r.allowed)} for r in rows if not r.on_plan]
                    threads_checked = len(rows)
                    break
        epoch += 1
    handle.close()
    (out / f"soak-rank{rank}.json").write_text(json.dumps({
        "rank": rank, "steps": step, "epochs": epoch, "samples": samples,
        "threads_checked": threads_checked, "off_plan": off_plan, "log_dir": str(Path(handle.config.monitor.log_dir).resolve())}))
    dist.destroy_process_group()


# ---- the harness --------------------------------------------------------------------------
def _slope_per_10k_steps(samples: list[dict], key: str, scale: float) -> float | None:
    """Least-squares slope of samples[key] * scale against the step, after the first quarter."""
    tail = samples[len(samples) // 4:]
    if len(tail) < 3:
        return None
    xs, ys = [s["step"] for s in tail], [s[key] * scale for s in tail]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return None if sxx == 0 else 10_000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def _host_bed(n: int, own_cores: bool):
    sys.path.insert(0, str(REPO / "tests"))
    from hostbed import HostBed, unavailable  # tests/hostbed.py: the bed lives with the tests that use it

    why = unavailable()
    if why:
        print(f"soak: {why}: the ranks run as agents on this host", file=sys.stderr)
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return HostBed.create(n, cpus=[frozenset({cpus[i % len(cpus)]}) for i in range(n)] if own_cores else None)


def _agent_cmd(n: int, per_host: int, endpoint: str, log_dir: Path, out: Path, seconds: float) -> list[str]:
    return [sys.executable, "-m", "placement.launcher", "--nnodes", str(n), "--nproc-per-node", str(per_host),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "soak",
            f"placement.monitor.log_dir={log_dir}", "placement.monitor.summary_every=0",
            __file__, "--worker", str(out), str(seconds)]


def _straggler_counts(events: list[dict], rank0_steps: int) -> dict:
    """On a balanced job: straggler events that name a rank (false ones), job-wide ones, windows."""
    from placement.config import MonitorConfig

    windows = rank0_steps // MonitorConfig().exchange_every  # the soak leaves the default
    named = [e for e in events if e["type"] == "straggler" and e.get("stragglers")]
    return {"exchange_windows": windows, "straggler_events": len(named),
            "straggler_events_per_10k_windows": round(10_000 * len(named) / windows, 1) if windows else None,
            "straggler_ranks_named": dict(collections.Counter(str(r) for e in named for s in e["stragglers"]
                                                              for r in s.get("ranks", []))),
            "job_wide_events": sum(1 for e in events if e["type"] == "straggler" and e.get("job_wide"))}


def run(minutes: float, n_hosts: int, per_host: int = 1, own_cores: bool = False, keep: str = "") -> dict:
    seconds = minutes * 60.0
    with tempfile.TemporaryDirectory(prefix="placement-soak-") as tmp:
        out = Path(keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        bed = _host_bed(n_hosts, own_cores)
        t0 = time.monotonic()
        try:
            if bed is not None:
                endpoint = f"{bed.hosts[0].addr}:{PORT}"
                cmds = [(h.argv(_agent_cmd(n_hosts, per_host, endpoint, out / f"logs-{h.name}", out, seconds)), h.env())
                        for h in bed.hosts]
            else:
                cmds = [(_agent_cmd(n_hosts, per_host, f"127.0.0.1:{PORT}", out / f"logs-agent{i}", out, seconds), None)
                        for i in range(n_hosts)]
            procs = []
            for i, (cmd, env) in enumerate(cmds):
                with open(out / f"agent{i}.err", "w") as err:
                    procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err))
            for i, p in enumerate(procs):
                if p.wait(timeout=seconds + 300) != 0:
                    raise SystemExit(f"soak: agent {i} failed (exit {p.returncode}); its stderr: {out / f'agent{i}.err'}")
        finally:
            if bed is not None:
                bed.close()
        wall_s = time.monotonic() - t0
        ranks = [json.loads(f.read_text()) for f in sorted(out.glob("soak-rank*.json"))]
        log = read_logs(sorted({r["log_dir"] for r in ranks}))  # the report's reader: torn lines skipped, counted
        log_bytes = sum(Path(f).stat().st_size for f in log.files)
        # what the same logs take once rotated (monitor.log_rotate_mb): compressed as the rotation does
        gz_bytes = sum(len(gzip.compress(Path(f).read_bytes(), compresslevel=6)) if not f.endswith(".gz")
                       else Path(f).stat().st_size for f in log.files)
    kinds = collections.Counter(e["type"] for e in log.events)
    drift = sum(1 for e in log.events if e["type"] == "bind" and "drift" in e)
    steps = sum(r["steps"] for r in ranks)
    hours_rank = wall_s / 3600.0 * len(ranks)
    rss = {r["rank"]: _slope_per_10k_steps(r["samples"], "rss_kib", 1 / 1024) for r in ranks}
    blocks = {r["rank"]: _slope_per_10k_steps(r["samples"], "py_blocks", 1.0) for r in ranks}
    per_step = log_bytes / steps if steps else None
    gz_per_step = gz_bytes / steps if steps else None
    unrepaired = sum(len(r["off_plan"]) for r in ranks)
    return {
        "minutes": minutes, "hosts": n_hosts if bed is not None else 1, "ranks": len(ranks),
        "own_cores": own_cores and bed is not None,
        "steps_per_rank": {r["rank"]: r["steps"] for r in ranks}, "epochs_per_rank": {r["rank"]: r["epochs"] for r in ranks},
        "rss_mib": {r["rank"]: [round(r["samples"][0]["rss_kib"] / 1024, 1), round(r["samples"][-1]["rss_kib"] / 1024, 1)]
                    for r in ranks},
        "rss_growth_mib_per_10k_steps": {k: None if v is None else round(v, 3) for k, v in rss.items()},
        "py_blocks_growth_per_10k_steps": {k: None if v is None else round(v) for k, v in blocks.items()},
        "events_per_rank_hour": {k: round(v / hours_rank, 1) for k, v in sorted(kinds.items())},
        "log_lines_skipped": log.skipped, "drift_repaired": drift, "threads_checked": sum(r["threads_checked"] for r in ranks),
        "drift_unrepaired": unrepaired,
        "log_bytes_per_step_per_rank": None if per_step is None else round(per_step, 1),
        "week_at_16k_ranks_tb": None if per_step is None else round(per_step * WEEK_S * BIG_JOB_RANKS / 1e12, 2),
        "rotated_bytes_per_step_per_rank": None if gz_per_step is None else round(gz_per_step, 1),
        "week_at_16k_ranks_tb_rotated": None if gz_per_step is None else round(gz_per_step * WEEK_S * BIG_JOB_RANKS / 1e12, 3),
        **(counts := _straggler_counts(log.events, next((r["steps"] for r in ranks if r["rank"] == 0), 0))),
        "met": all(v is not None and v < 1.0 for v in rss.values()) and unrepaired == 0,
        "precision_met": counts["straggler_events"] * 10_000 <= counts["exchange_windows"],
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), float(sys.argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=6.0, help="how long the job trains (default 6)")
    p.add_argument("--quick", action="store_true", help="1 minute")
    p.add_argument("--hosts", type=int, default=2, help="hosts of the bed (default 2)")
    p.add_argument("--ranks-per-host", type=int, default=1, help="ranks on each host (default 1)")
    p.add_argument("--own-cores", action="store_true", help="each host's processes on a core of their own")
    p.add_argument("--keep", default="", help="keep the logs here (default: a temporary directory)")
    args = p.parse_args()
    if args.minutes <= 0:
        print(f"soak: --minutes {args.minutes:g} is not valid; give a number of minutes above 0", file=sys.stderr)
        return 2
    if not 1 <= args.hosts <= 16:
        print(f"soak: --hosts {args.hosts} is not valid; give 1 to 16", file=sys.stderr)
        return 2
    if args.ranks_per_host < 1:
        print(f"soak: --ranks-per-host {args.ranks_per_host} is not valid; give 1 or more", file=sys.stderr)
        return 2
    print(json.dumps(run(1.0 if args.quick else args.minutes, args.hosts, args.ranks_per_host, args.own_cores,
                         args.keep)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
