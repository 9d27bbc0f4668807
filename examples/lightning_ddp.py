"""PyTorch Lightning DDP on CPU with placement: one callback, nothing else changed.

    python examples/lightning_ddp.py --steps 20                 # Lightning starts the 2nd process itself
    placerun --standalone --nproc-per-node 2 examples/lightning_ddp.py --steps 20

Each rank writes <log-dir>/rank<R>.jsonl: one step record per optimizer step (accumulate 2 batches
per step here), with its data wait and gradient all-reduce time.
"""
import argparse

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset

from placement.integrations.lightning import PlacementCallback


class Points(Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, generator=g)
        return x, x.sum(dim=0, keepdim=True)


class Regression(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--log-dir", default="placement_logs")
    p.add_argument("--callback", choices=("on", "off"), default="on", help="off: the same run without placement")
    args = p.parse_args()
    callbacks = [PlacementCallback(monitor={"log_dir": args.log_dir, "flush_every": 5})] if args.callback == "on" else []
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, accumulate_grad_batches=2,
                      callbacks=callbacks, enable_checkpointing=False, logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(Regression(), DataLoader(Points(), batch_size=16, num_workers=1))


if __name__ == "__main__":
    main()
