"""What timing DDP's bucket all-reduces through a Python comm hook costs a small CPU step.

What
    One process, a gloo world of one, the small MLP of benchmarks/framework_callbacks.py wrapped
    in three DistributedDataParallel models: DDP's own C++ all-reduce (no hook), torch's Python
    `allreduce_hook` (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py), and
    placement's timed hook (placement/monitor/comm/timing.py install_ddp_hook). Rounds of 40
    steps each, alternated with the order turned; a ratio is the median over rounds of the
    arm's median step over the no-hook arm's in the same round.
Why
    Both hooks pay a Python call per bucket on the autograd thread and a `fut.then` callback on
    gloo's; a hook that returns the all-reduce's own future is refused by torch (the result must
    be a Python future: torch/csrc/distributed/c10d/python_comm_hook.cpp). Hence a one-rank
    gloo DDP job keeps DDP's own all-reduce under comm_timing=auto (timing.ddp_bucket_route).

    python benchmarks/ddp_hook.py [--quick]

Last line: {"benchmark": "ddp_hook", "none_ms": ..., "torch_hook_ratio": ..., "placement_hook_ratio": ...}
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARMS = ("none", "torch_hook", "placement_hook")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 rounds instead of 20")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from placement.monitor.comm.base import CollectiveClock, OriginalCollectives
    from placement.monitor.comm.timing import install_ddp_hook
    from placement.monitor.warn import WarnOnce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        models = {}
        for arm in ARMS:
            torch.manual_seed(0)
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
                torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                torch.nn.Linear(512, 10)))
            clock = None
            if arm == "torch_hook":
                model.register_comm_hook(None, default_hooks.allreduce_hook)
            elif arm == "placement_hook":
                clock = CollectiveClock(True)
                install_ddp_hook(model, clock, OriginalCollectives(), WarnOnce())
            models[arm] = (model, torch.optim.SGD(model.parameters(), lr=0.01), clock)
        x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
        per_round: list[dict[str, float]] = []
        for rnd in range(6 if args.quick else 20):
            got = {}
            for arm in ARMS[rnd % 3:] + ARMS[:rnd % 3]:
                model, opt, clock = models[arm]
                times = []
                for _ in range(40):
                    t0 = time.perf_counter()
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    times.append(time.perf_counter() - t0)
                    if clock is not None:
                        clock.take_raw()  # as the step hook does: the clock keeps one step
                got[arm] = statistics.median(times[5:]) * 1e3
            per_round.append(got)
    finally:
        dist.destroy_process_group()
    out = {"benchmark": "ddp_hook", "rounds": len(per_round),
           "none_ms": round(statistics.median(r["none"] for r in per_round), 3)}
    for arm in ARMS[1:]:
        out[f"{arm}_ratio"] = round(statistics.median(r[arm] / r["none"] for r in per_round), 3)
        print(f"{arm:15s} {statistics.median(r[arm] for r in per_round):.3f} ms  {out[f'{arm}_ratio']:.3f}x no hook")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
