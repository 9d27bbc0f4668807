"""The README's main job with placement.attach() in the script: the same MLP, DDP on gloo and
respawning DataLoader workers as examples/train_ddp.py, for runs without placerun and for what the
handle offers (handle.watch, the binder's thread table):

    torchrun --standalone --nproc-per-node 2 examples/train_ddp_attach.py --steps 60 --workers 2

Under torchrun `placement.attach` plans and binds the rank itself; under placerun it takes the
automatic monitor's place (one monitor a process). At the last step each rank prints where each of
its threads actually ran, read from /proc.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import placement
from placement.bind.where import format_thread_placements, where_threads_run
# The same job as the main one: its model, data and arguments (this script's folder is on sys.path).
from train_ddp import build_job, parse_args


def report_where_threads_ran(handle, rank: int, world_size: int) -> None:
    """Rank by rank, the threads of this rank and of its DataLoader workers, read back from /proc."""
    lines = [f"[rank {rank}] where each thread ran (planned set vs Cpus_allowed_list read back):"]
    if handle.binder is None:
        lines.append(f"[rank {rank}]   not bound (placement.policy=none)")
    else:
        lines.append(format_thread_placements(where_threads_run(handle.binder), prefix=f"[rank {rank}]   "))
        memory = handle.session.memory
        if memory is not None:
            lines.append(f"[rank {rank}]   memory policy: planned {memory.planned.mode} {memory.planned.nodes}, "
                         f"applied {memory.applied.mode} {memory.applied.nodes}"
                         + (" (read back)" if memory.verified else " (not verifiable here)")
                         + (f"; {memory.fallback}" if memory.fallback else ""))
    for r in range(world_size):  # one rank at a time, so the tables do not interleave
        if r == rank:
            sys.stdout.write("\n".join(lines) + "\n")
            sys.stdout.flush()
        dist.barrier()


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer, sampler, loader = build_job(args, rank, world_size)
    handle = placement.attach(model, optimizer)  # under placerun: the Session stage 1 made
    step, epoch, loss = 0, 0, torch.tensor(0.0)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in handle.watch(loader):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # attach hooked the optimizer: one step record per call
            step += 1
            if step == args.steps:  # the workers of this epoch are still alive: report now
                report_where_threads_ran(handle, rank, world_size)
                break
        epoch += 1
    handle.close()
    if rank == 0:
        print(f"done: {step} steps, {epoch} epoch(s), last loss {loss.item():.4f}, "
              f"logs in {os.path.abspath(handle.config.monitor.log_dir)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
