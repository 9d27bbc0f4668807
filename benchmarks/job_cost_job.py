"""The job benchmarks/job_cost.py measures: a plain DDP script as users write it, no placement
import. gloo, an MLP 128-512-512-1, batch 64, a DataLoader with persistent worker processes whose
__getitem__ does a little Python work per sample (as augmentation does). The script times its own
steps; over its steady steps (from --warmup on) it reads every thread of its own process from
/proc (schedstat: on-CPU and runqueue ns, comm: the name) at the start and at the end, and rank 0
writes one JSON object to --out: steps, seconds, steps/s, and each thread's CPU and runqueue ns
over the steady steps.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/job_cost_job.py --out r.json
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Augmented(Dataset):
    """Each sample made on demand with a little Python per sample, as an augmentation pipeline's."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        acc = 0
        for j in range(200):  # a few tens of us of Python per sample
            acc = (acc * 31 + i + j) % 1000003
        g = torch.Generator().manual_seed(i)
        x = torch.randn(128, generator=g)
        return x + acc * 1e-9, x.sum().unsqueeze(0)


def threads(pid: int) -> dict:
    """tid -> (name, on-CPU ns, runqueue ns, times put on a CPU) of every thread of `pid`, from /proc."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait, slices = (int(v) for v in f.read().split()[:3])
        except OSError:
            continue  # ended meanwhile
        out[int(tid)] = (name, run, wait, slices)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                                  nn.Linear(512, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = Augmented(64 * (args.steps + 8) * world)
    loader = DataLoader(data, batch_size=64, sampler=DistributedSampler(data, world, rank, shuffle=False),
                        num_workers=args.workers, persistent_workers=args.workers > 0)
    it = iter(loader)
    pid = os.getpid()
    before = t0 = None
    for step in range(args.steps):
        if step == args.warmup:
            before, t0 = threads(pid), time.perf_counter()
        x, y = next(it)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    t1 = time.perf_counter()
    after = threads(pid)
    if rank == 0:
        per_thread = []
        for tid, (name, run, wait, slices) in after.items():
            b = before.get(tid)
            run0, wait0, slices0 = b[1:] if b is not None else (0, 0, 0)
            per_thread.append({"tid": tid, "name": name, "cpu_ns": run - run0, "runq_ns": wait - wait0,
                               "slices": slices - slices0, "cpu_total_ns": run,
                               "main": tid == pid, "new": b is None})
        steps = args.steps - args.warmup
        with open(args.out, "w") as f:
            json.dump({"steps": steps, "steps_total": args.steps, "seconds": t1 - t0, "steps_per_s": steps / (t1 - t0),
                       "threads": per_thread}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
