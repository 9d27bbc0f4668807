"""Training loops written as their authors write them, with no placement import: placerun's
automatic monitor must find their steps (tests/auto/test_auto_monitor.py).

    placerun --standalone --nproc-per-node 2 auto_loops.py LOOP --iters N [--slow-rank R] [--hang-rank R]

LOOP: plain (PyTorch's DDP tutorial), two_opt (a GAN's two optimizers), accum (4 micro-batches an
optimizer step), scaler (torch.amp.GradScaler("cpu"), steps skipped on inf), chained (megatron-core
ChainedOptimizer), attach (the program calls placement.attach itself), noopt (evaluation only).
Prints "iterations N" on rank 0: the loop's iterations (optimizer steps for accum).
"""
import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

FEATURES = 32


class Slow(Dataset):
    """Samples made on demand; each batch waits `delay` s in the loader (data wait > 0)."""

    def __init__(self, n, delay):
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        g = torch.Generator().manual_seed(i)
        x = torch.randn(FEATURES, generator=g)
        return x, x.sum().unsqueeze(0)


def loader(args, rank, world, batches):
    ds = Slow(batches * 4 * world, args.delay)
    return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, world, rank, shuffle=False),
                      num_workers=args.workers)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("loop", choices=["plain", "two_opt", "accum", "scaler", "chained", "attach", "noopt"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.001)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--work-ms", type=float, default=0.0, help="busy compute every rank does each iteration")
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-at", type=int, default=10)
    p.add_argument("--hang-s", type=float, default=0.0, help="the hung rank's main thread sleeps this long")
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--megatron-lm-from", type=int, default=-1,
                   help="keep Megatron-LM's args.curr_iteration as its train() does, from this iteration")
    args = p.parse_args()
    megatron_args = None
    if args.megatron_lm_from >= 0:
        # Megatron-LM is not on PyPI: its megatron/training/global_vars.py holds the parsed args in
        # _GLOBAL_ARGS, and train() sets args.curr_iteration = iteration before each train_step.
        import types

        megatron_args = argparse.Namespace(curr_iteration=None)
        sys.modules["megatron.training.global_vars"] = types.SimpleNamespace(_GLOBAL_ARGS=megatron_args)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1)))
    loss_fn = nn.MSELoss()
    if args.loop == "noopt":
        model.eval()
        with torch.no_grad():
            n = sum(1 for x, y in loader(args, rank, world, args.iters) if model(x) is not None)
        if rank == 0:
            print(f"evaluated {n}", flush=True)
        dist.destroy_process_group()
        sys.exit(args.exit_code)
    micro = 4 if args.loop == "accum" else 1
    data = loader(args, rank, world, args.iters * micro)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    handle = None
    if args.loop == "attach":
        import placement

        handle = placement.attach(model, opt)
    if args.loop == "two_opt":
        critic = DDP(nn.Linear(1, 1))
        opt_c = torch.optim.SGD(critic.parameters(), lr=0.001)
    if args.loop == "scaler":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    if args.loop == "chained":
        from megatron.core import parallel_state
        from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, MegatronOptimizer, OptimizerConfig

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)

        class CpuFP32Optimizer(FP32Optimizer):  # examples/megatron_gpt.py: FP32Optimizer without its CUDA line
            def __init__(self, optimizer, config):
                MegatronOptimizer.__init__(self, optimizer, config, lambda _: None)
                self._scale = torch.tensor([1.0])
                self.is_stub_optimizer = optimizer is None

        class CpuChainedOptimizer(ChainedOptimizer):
            """megatron-core's ChainedOptimizer.step (prepare_grads, then each inner optimizer's
            step_with_ready_grads) with the grad norm taken on CPU: megatron's own uses a CUDA
            multi-tensor kernel (get_grad_norm_fp32)."""

            def get_grad_norm(self):
                return float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters()])))

        params = list(model.parameters())
        cfg = OptimizerConfig(optimizer="sgd", lr=0.001, clip_grad=0.0)
        opt = CpuChainedOptimizer([CpuFP32Optimizer(torch.optim.SGD(params[:2], lr=0.001), cfg),
                                CpuFP32Optimizer(torch.optim.SGD(params[2:], lr=0.001), cfg)])
    iters = skipped = 0
    for i, (x, y) in enumerate(data):
        if megatron_args is not None:
            megatron_args.curr_iteration = args.megatron_lm_from + iters
        if args.loop == "accum":
            loss_fn(model(x), y).div(micro).backward()
            if (i + 1) % micro:
                continue
        elif args.loop == "scaler":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            if iters % 5 == 2:  # an overflow: GradScaler skips optimizer.step (pytorch#55585)
                next(model.parameters()).grad.fill_(float("inf"))
                skipped += 1
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        else:
            loss = loss_fn(model(x), y)
            loss.backward()
        busy_ms = args.work_ms + (args.slow_ms if rank == args.slow_rank else 0.0)
        end = time.perf_counter() + busy_ms / 1e3
        while time.perf_counter() < end:
            pass
        if rank == args.hang_rank and iters == args.hang_at:
            time.sleep(args.hang_s)
        if args.loop == "two_opt":
            opt.step()
            opt.zero_grad()
            c_loss = critic(model(x).detach()).pow(2).mean()
            c_loss.backward()
            opt_c.step()
            opt_c.zero_grad()
        elif args.loop == "chained":
            opt.step()
            opt.zero_grad()
        elif args.loop != "scaler":
            opt.step()
            opt.zero_grad()
        iters += 1
    if handle is not None:
        handle.close()
    if rank == 0:
        print(f"iterations {iters} skipped {skipped}", flush=True)
    dist.destroy_process_group()
    sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
