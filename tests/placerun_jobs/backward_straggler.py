"""A DDP job as its author writes it (no placement import) in which one rank computes more than
the others from some step on: inside backward (a custom autograd function between layers 2 and
3, the way a slower core or a throttled socket computes), or inside forward
(tests/monitor/comm/test_comm_wait.py).

    placerun --standalone --nproc-per-node 2 backward_straggler.py --steps N --slow-rank R
        [--slow-from S] [--slow-in backward|forward] [--extra 0.4] [--bucket-mb 0.25]

Every rank does `--work-ms` of matrix products in forward each step; from step `--slow-from`
the slow rank does `--extra` times the step's work more, in backward or in forward. DDP's
buckets (`--bucket-mb`) are all-reduced while backward goes on, so on gloo the collectives are
in flight while the slow rank computes. Prints "steps N" on rank 0.
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH = 256


def calibrate(ms: float) -> int:
    """How many 128x128 matrix products take `ms` on this core (median of three tries)."""
    a = torch.randn(128, 128)
    n = 50
    tries = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            a @ a
        tries.append((time.perf_counter() - t0) / n)
    return max(1, int(ms / 1e3 / sorted(tries)[1]))


def work(n: int) -> None:
    a = torch.randn(128, 128)
    for _ in range(n):
        a @ a


class Extra(torch.autograd.Function):
    """Identity forward; `work(n)` more products in backward when `n` > 0 (set per step)."""

    n = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if Extra.n:
            work(Extra.n)
        return grad


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        x = torch.relu(self.l2(torch.relu(self.l1(x))))
        x = Extra.apply(x)  # between layers 2 and 3: backward reaches it after layers 4 and 3's buckets
        return self.l4(torch.relu(self.l3(x)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-from", type=int, default=21)
    p.add_argument("--slow-in", choices=["backward", "forward"], default="backward")
    p.add_argument("--extra", type=float, default=0.4, help="the slow rank's extra work, a share of the step's")
    p.add_argument("--work-ms", type=float, default=8.0)
    p.add_argument("--bucket-mb", type=float, default=0.25)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    per_ms = calibrate(1.0)
    fwd_n = int(args.work_ms * per_ms)
    x, y = torch.randn(64, WIDTH), torch.randn(64, WIDTH)
    # the step's work, once warm: forward's products plus the model's forward and backward
    for i in range(6):
        if i == 2:
            t0 = time.perf_counter()
        work(fwd_n)
        nn.functional.mse_loss(model.module(x), y).backward()
    extra_n = int(args.extra * (time.perf_counter() - t0) / 4 * 1e3 * per_ms)
    # rank 0's calibration for every rank: the ranks do the same work but for the slow one's extra
    counts = torch.tensor([fwd_n, extra_n], dtype=torch.int64)
    dist.broadcast(counts, 0)
    fwd_n, extra_n = (int(v) for v in counts)
    if rank == 0:
        print(f"work: {fwd_n} products a step, {extra_n} more on rank {args.slow_rank} from step {args.slow_from}",
              flush=True)
    opt.zero_grad()
    for step in range(1, args.steps + 1):
        slow = rank == args.slow_rank and step >= args.slow_from
        Extra.n = extra_n if slow and args.slow_in == "backward" else 0
        work(fwd_n + (extra_n if slow and args.slow_in == "forward" else 0))
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    if rank == 0:
        print(f"steps {args.steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
