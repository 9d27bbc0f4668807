"""A rank for tests/placerun/test_placerun_e2e.py: starts real threads (gloo, the intra-op pool, two
DataLoader worker processes), says where its pid is, and holds still while the test reads its
/proc from outside; then finishes a step and exits.

    hold.py OUT_DIR [gloo|nccl]      (nccl: one GPU per rank, NCCL's proxy threads too)
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset


class Items(Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        return torch.full((4,), float(i))


def main():
    out = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    loader = DataLoader(Items(), batch_size=2, num_workers=2, persistent_workers=True)
    batches = iter(loader)
    next(batches)
    torch.ones(256, 256) @ torch.ones(256, 256)  # starts the intra-op thread pool
    dist.all_reduce(torch.ones(1, device=device))  # NCCL creates its threads here
    with open(os.environ["PLACEMENT_PLAN_FILE"]) as f:
        plan = json.load(f)["plan"]  # the hand-off file: config and plan
    report = {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "pid": os.getpid(), "plan": plan}
    tmp = os.path.join(out, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.rename(tmp, os.path.join(out, f"rank{rank}.json"))
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out, "done")):
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)
    next(batches)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
