"""The README's main job: a small DDP training script as PyTorch's DDP tutorial writes it, with no
placement import. placerun binds its ranks and records its steps on its own:

    placerun --standalone --nproc-per-node 2 placement.monitor.log_dir=DIR examples/train_ddp.py --steps 60 --workers 2
    placement report DIR

An MLP on synthetic regression data fed by DataLoader worker processes that respawn every epoch,
DDP on gloo. At the last step each rank prints the CPUs each of its threads may run on, read from
/proc (under placerun: the plan's; under torchrun: anything). examples/train_ddp_attach.py is the
same job with placement.attach() in the script.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

FEATURES = 64


class SyntheticRegression(Dataset):
    """y = x . w + noise, every sample made on demand from its index (the workers do real work)."""

    def __init__(self, size: int):
        self.size = size
        self.w = torch.linspace(-1.0, 1.0, FEATURES)

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(FEATURES, generator=g)
        return x, (x @ self.w + 0.01 * torch.randn((), generator=g)).unsqueeze(0)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="training steps (default: 60)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank (default: 2)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps-per-epoch", type=int, default=20, help="workers respawn every epoch (default: 20)")
    return p.parse_args()


def thread_cpus(pid: int) -> list[str]:
    """'name (tid): Cpus_allowed_list' for every thread of `pid` and of its DataLoader workers."""
    lines = []
    pids = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids += [int(c) for c in f.read().split()]
    except OSError:
        pass
    for p in pids:
        for tid in sorted(os.listdir(f"/proc/{p}/task"), key=int):
            try:
                with open(f"/proc/{p}/task/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{p}/task/{tid}/status") as f:
                    cpus = next(line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list"))
            except (OSError, StopIteration):
                continue  # the thread ended meanwhile
            lines.append(f"{name} ({tid}{'' if p == pid else f', worker {p}'}): {cpus}")
    return lines


def build_job(args, rank: int, world_size: int):
    """The DDP model, its optimizer, the sampler and the DataLoader (workers respawn every epoch)."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256),
                                                  nn.ReLU(), nn.Linear(256, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = SyntheticRegression(args.batch_size * args.steps_per_epoch * world_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        persistent_workers=False)
    return model, optimizer, sampler, loader


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer, sampler, loader = build_job(args, rank, world_size)
    step, epoch, loss = 0, 0, torch.tensor(0.0)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.steps:  # the workers of this epoch are still alive: look now
                for r in range(world_size):  # one rank at a time, so the tables do not interleave
                    if r == rank:
                        sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in thread_cpus(os.getpid())))
                        sys.stdout.flush()
                    dist.barrier()
                break
        epoch += 1
    if rank == 0:
        print(f"done: {step} steps, {epoch} epoch(s), last loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
