"""The jobs benchmarks/gpu_check.py launches (under placerun or torchrun, one process per GPU);
each writes what it measured to --out as one JSON object (rank 0). No placement import unless
--attach: the launcher alone decides what placement does to it.

    comm        compute kernels and all-reduces of 4 KB to 256 MB (16 MB on CPU), each collective
                timed by the job itself: CUDA events on the current stream around the call (the
                NCCL stream waits for the current stream and the current stream for it, so the
                pair spans the collective's kernel, plus a few us of the cross-stream wait); on
                CPU, wall time around the blocking gloo call. A plain optimizer steps each
                iteration so placerun's automatic monitor makes step records.
    throughput  a launch-bound loop (many small layers: the main thread's speed sets the step
                rate) fed by DataLoader workers that do CPU work per sample; steps/s over a timed
                window after a warm-up. --ddp wraps the model in DistributedDataParallel, so each
                step all-reduces its gradient buckets (under placerun, through its comm timing).
    cost        a GPU-bound step of ~10 ms (matrix products, no host sync inside the step) plus a
                small model's optimizer step; median step time; --attach starts placement.attach().
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

GPU_SIZES = (4 << 10, 1 << 20, 16 << 20, 256 << 20)  # bytes per all-reduce
CPU_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
GPU_STEP_MS = (2.0, 10.0, 50.0)  # compute per step, cycled: 2-50 ms steps
CPU_STEP_MS = (2.0, 10.0, 20.0)


def _setup(device_kind: str):
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _matmul_ms(device, a, b, reps: int = 20) -> float:
    """Time of one a @ b on this device (ms), after a warm-up."""
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / reps


def comm(args) -> dict:
    device = _setup(args.device)
    cuda = device.type == "cuda"
    sizes, targets = (GPU_SIZES, GPU_STEP_MS) if cuda else (CPU_SIZES, CPU_STEP_MS)
    n = 4096 if cuda else 256
    dtype = torch.bfloat16 if cuda else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    one = _matmul_ms(device, a, b)
    # NCCL's one-rank all-reduce launches a kernel only for pre-multiplied ops (AVG), a copy or
    # nothing for SUM (nccl src/enqueue.cc ncclLaunchOneRank); gloo has no AVG.
    op = dist.ReduceOp.AVG if cuda else dist.ReduceOp.SUM
    bufs = [torch.ones(s // 4, device=device) for s in sizes]
    model = torch.nn.Linear(64, 64).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64, device=device)
    timed: list[list] = []
    for i in range(args.steps):
        for _ in range(max(1, round(targets[i % len(targets)] / one))):
            a @ b
        pairs = []
        # Every size each step except 256 MB, which comes every 4th step.
        for j, buf in enumerate(bufs):
            if j == len(bufs) - 1 and i % 4:
                continue
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                dist.all_reduce(buf, op=op)
                e.record()
                pairs.append((s, e))
            else:
                t0 = time.perf_counter()
                dist.all_reduce(buf, op=op)
                pairs.append((time.perf_counter() - t0) * 1e3)
        timed.append(pairs)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    _sync(device)
    truth = [sum(s.elapsed_time(e) for s, e in p) if cuda else sum(p) for p in timed]
    out = {"job": "comm", "device": str(device), "steps": args.steps, "matmul_ms": one,
           "collectives_per_step": [len(p) for p in timed], "truth_ms": truth,
           "env": {k: os.environ.get(k) for k in ("TORCH_NCCL_ENABLE_TIMING", "CUDA_DEVICE_MAX_CONNECTIONS",
                                                  "TORCH_FR_BUFFER_SIZE", "OMP_NUM_THREADS")}}
    dist.destroy_process_group()
    return out


class Samples(torch.utils.data.Dataset):
    """A sample costs its DataLoader worker ~`work` Python-level CPU operations (decode-like)."""

    def __init__(self, n: int, work: int):
        self.n, self.work = n, work

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        acc = 0
        for k in range(self.work):
            acc += (i * k) % 7
        return torch.full((128,), float(acc % 3))


def throughput(args) -> dict:
    device = _setup(args.device)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(128, 128), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    if args.ddp:
        # 48 layers of 128x128 are ~3 MB of gradients: DDP's default 25 MB bucket cap makes one or two
        # buckets (torch/nn/parallel/distributed.py, bucket_cap_mb).
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, foreach=True)
    loader = torch.utils.data.DataLoader(Samples(10**7, args.sample_work), batch_size=32,
                                         num_workers=args.workers, pin_memory=device.type == "cuda",
                                         persistent_workers=True, prefetch_factor=4)
    it = iter(loader)
    t_end_warm = time.perf_counter() + args.warmup_s
    steps = 0
    t0 = None
    while True:
        xb = next(it).to(device, non_blocking=True)
        loss = model(xb).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
        if steps % 20 == 0:
            loss.item()  # bound how far the CPU runs ahead of the GPU
            now = time.perf_counter()
            if t0 is None and now >= t_end_warm:
                _sync(device)
                t0, steps = time.perf_counter(), 0
            elif t0 is not None and now - t0 >= args.seconds:
                _sync(device)
                elapsed = time.perf_counter() - t0
                break
    out = {"job": "throughput", "device": str(device), "steps": steps, "seconds": elapsed,
           "steps_per_s": steps / elapsed, "main_cpus": sorted(os.sched_getaffinity(0)),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
           "ddp": args.ddp}
    dist.destroy_process_group()
    return out


def cost(args) -> dict:
    device = _setup(args.device)
    cuda = device.type == "cuda"
    if args.attach:
        import placement
    n = 4096 if cuda else 192
    dtype = torch.bfloat16 if cuda else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    reps = args.reps or max(1, round(10.0 / _matmul_ms(device, a, b)))
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 16)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    handle = placement.attach(model, opt) if args.attach else None
    x = torch.randn(64, 256, device=device)
    stamps = []
    for i in range(args.steps):
        for _ in range(reps):
            a @ b
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i % 50 == 49:
            _sync(device)  # a trainer's periodic loss.item(): the CPU stays within 50 steps
        stamps.append(time.perf_counter())
    _sync(device)
    if handle is not None:
        handle.close()
    gaps = [(t1 - t0) * 1e3 for t0, t1 in zip(stamps, stamps[1:])][10:]
    # Wall time over whole periods of 50 steps (the CPU runs ahead inside a period).
    whole = stamps[-1] - stamps[9] if len(stamps) > 10 else 0.0
    out = {"job": "cost", "device": str(device), "steps": args.steps, "matmuls_per_step": reps,
           "step_ms_mean": whole * 1e3 / max(1, len(stamps) - 10), "step_ms_median": statistics.median(gaps),
           "attach": args.attach}
    dist.destroy_process_group()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("job", choices=("comm", "throughput", "cost"))
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--sample-work", type=int, default=2000)
    p.add_argument("--attach", action="store_true")
    p.add_argument("--ddp", action="store_true", help="throughput: wrap the model in DistributedDataParallel")
    p.add_argument("--reps", type=int, default=0, help="cost: matrix products per step (0: as many as ~10 ms)")
    args = p.parse_args(argv)
    result = {"comm": comm, "throughput": throughput, "cost": cost}[args.job](args)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
