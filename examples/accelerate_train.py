"""Hugging Face Accelerate loop with placement: one `placement.attach()` after `accelerator.prepare`.

    placerun --standalone --nproc-per-node 2 examples/accelerate_train.py --steps 20
    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py --steps 20    # attach binds each rank
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py        # on a GPU node, the same

An Accelerate user writes the loop, so placement comes in as in any loop of one's own: attach() with
the model and optimizer accelerate prepared (the DDP model, whose all-reduces it times; the
AcceleratedOptimizer, whose inner optimizer's steps end the steps: with
`accelerator.accumulate`, one step per optimizer step, here 2 batches) and `handle.watch` around
the prepared dataloader for the data wait. Accelerate reads torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), which placerun sets as torchrun does.
Each rank writes <log-dir>/rank<R>.jsonl; under placerun, by default placerun's log (stage 1's
bind events are in it).
"""
import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

import placement


class Points(Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, generator=g)
        return x, x.sum(dim=0, keepdim=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--log-dir", help="default: placerun's placement.monitor.log_dir under placerun, else placement_logs")
    p.add_argument("--callback", choices=("on", "off"), default="on", help="off: the same run without placement")
    args = p.parse_args()
    # cpu=True where there is no GPU: accelerate then runs DDP on gloo (MULTI_CPU) from torchrun's env.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Points(), batch_size=16, shuffle=True, num_workers=1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    handle = None
    if args.callback == "on":
        monitor = {"flush_every": 5} | ({"log_dir": args.log_dir} if args.log_dir else {})
        handle = placement.attach(model, optimizer, monitor=monitor)
    batches = handle.watch(loader) if handle is not None else loader
    done = 0
    for x, y in batches:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        done += accelerator.sync_gradients
        if done == args.steps:
            break
    if handle is not None:
        handle.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
