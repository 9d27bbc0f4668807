"""Hugging Face Trainer on CPU with placement: a 2-layer GPT-2 built from a config (no download),
one callback added.

    placerun --standalone --nproc-per-node 2 examples/transformers_trainer.py --output-dir out
    torchrun --standalone --nproc-per-node 2 examples/transformers_trainer.py --output-dir out

Each rank writes <output-dir>/placement_logs/rank<R>.jsonl (the Trainer's own output_dir).
"""
import argparse

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from placement.integrations.transformers import PlacementCallback


class Tokens(Dataset):
    def __len__(self):
        return 2048

    def __getitem__(self, i):
        ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--output-dir", default="trainer_out")
    p.add_argument("--callback", choices=("on", "off"), default="on", help="off: the same run without placement")
    args = p.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=32))
    targs = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=8,
                              gradient_accumulation_steps=2, use_cpu=True, ddp_backend="gloo", report_to=[],
                              save_strategy="no", logging_steps=10, dataloader_num_workers=1,
                              disable_tqdm=True)
    callbacks = [PlacementCallback(monitor={"flush_every": 5})] if args.callback == "on" else []
    Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=callbacks).train()


if __name__ == "__main__":
    main()
