"""A Hydra app whose config tree holds placement's: `placement` is one more config group.

    python examples/hydra_app/train.py placement.policy=exclusive placement/tune=off train.steps=100
    python examples/hydra_app/train.py --cfg job            # the composed config, placement included
    placerun --standalone --nproc-per-node 2 examples/hydra_app/train.py placement/monitor=verbose

'/' picks a preset of configs/placement/{policy,monitor,tune}, '.' sets one key. Under placerun
the binding keys (policy, memory, smt, reserved_cpus, ...) were applied by placerun before this
script started, so give those to placerun; the monitor and tune keys the app sets still apply, and
the ones it leaves at their default keep placerun's values.
"""
from __future__ import annotations

import os
import sys

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig

import placement
from placement.errors import PlacementError
from placement.integrations.hydra import changed_settings, register_configs

register_configs()  # before @hydra.main composes: the `placement` group lives in the ConfigStore


class RandomRegression(torch.utils.data.Dataset):
    def __init__(self, n: int, dim: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        settings = changed_settings(cfg.placement)  # also checks what Hydra cannot: ranges, cpu lists
    except PlacementError as e:
        print(f"train.py: {e}", file=sys.stderr)
        sys.exit(2)
    t = cfg.train
    if "RANK" in os.environ:  # under placerun / torchrun
        dist.init_process_group("gloo")
    model = torch.nn.Sequential(torch.nn.Linear(16, t.hidden), torch.nn.ReLU(), torch.nn.Linear(t.hidden, 1))
    if dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=t.lr)
    data = RandomRegression(t.steps * t.batch_size, 16)
    loader = torch.utils.data.DataLoader(data, batch_size=t.batch_size, num_workers=t.workers)
    try:
        handle = placement.attach(model, optimizer, config=settings)
    except PlacementError as e:  # e.g. an unwritable log_dir: one line, as for a bad setting
        print(f"train.py: {e}", file=sys.stderr)
        sys.exit(2)
    with handle:
        for x, y in handle.watch(loader):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()  # ends the step record
        steps, used = handle.steps, handle.config
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print(f"hydra_app: {steps} steps, final loss {loss.item():.4f}, policy {used.policy}, "
              f"tune {'on' if used.tune.enabled else 'off'}, records in {used.monitor.log_dir}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
