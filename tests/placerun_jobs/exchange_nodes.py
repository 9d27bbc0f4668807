"""A rank for tests/monitor/crossrank/test_exchange_nodes.py: DDP on gloo with the monitor attached; the rank named
by SLOW_RANK waits SLOW_MS for each batch from step 11 on, so it enters every all-reduce late.

    exchange_nodes.py STEPS SLOW_RANK SLOW_MS
"""
import sys

import torch
import torch.distributed as dist

import placement
from late_batches import Batches


def main():
    steps, slow_rank, slow_ms = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    handle = placement.attach(model, opt)
    data = handle.watch(Batches(rank == slow_rank, slow_ms / 1e3))
    for _ in range(steps):
        x = next(data)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    handle.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
