"""A rank for tests/placerun/test_hosts.py: DDP on gloo with the monitor attached, STEPS optimizer steps
of about STEP_MS each; the rank SLOW_RANK (-1: none) waits SLOW_MS for each batch from step 11
on, so it enters every all-reduce late. Each rank writes OUT/attempt<A>.rank<R>.json once it is
stepping (A: 1 when OUT/killed exists: the test marks a kill before it kills a host).

    hosts_job.py OUT STEPS STEP_MS SLOW_RANK SLOW_MS
"""
import atexit
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import placement
from late_batches import Batches


def main():
    out, steps, step_ms, slow_rank, slow_ms = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), \
        int(sys.argv[4]), float(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = 1 if os.path.exists(os.path.join(out, "killed")) else 0
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    handle = placement.attach(model, opt)
    data = handle.watch(Batches(rank == slow_rank, slow_ms / 1e3))
    for step in range(1, steps + 1):
        x = next(data)
        time.sleep(step_ms / 1e3)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 5:
            name = os.path.join(out, f"attempt{attempt}.rank{rank}.json")
            with open(name + ".tmp", "w") as f:
                json.dump({"rank": rank, "pid": os.getpid(), "host": os.uname().nodename,
                           "group_rank": int(os.environ["GROUP_RANK"])}, f)
            os.rename(name + ".tmp", name)
    handle.close()
    dist.barrier()
    # What exit does (placement's atexit handlers say what a log lost), without gloo's teardown,
    # which sometimes aborts after a correct run (tests/placerun_helpers.py says why)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
