"""Hugging Face Transformers `Trainer`: one callback.

    from placement.integrations.transformers import PlacementCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[PlacementCallback()])

At train begin it calls placement.attach(model, optimizer) (the Trainer's, after accelerate
prepared them: DDP under torchrun/placerun/`accelerate launch`). Steps are the Trainer's own:
on_step_end comes once per optimizer step (after gradient_accumulation_steps micro-batches), so a
record is an optimizer step. The data wait is the time from the end of the previous step (its
on_step_end and the logging, saving and evaluation after it, whose hooks re-mark) to on_step_begin:
Trainer fetches the step's micro-batches there (transformers 5 trainer.py, get_batch_samples before
on_step_begin). Logs land in `<args.output_dir>/placement_logs` unless monitor.log_dir is given, or
placerun's log directory under placerun (one log per rank, stage 1's events in it).

Keyword arguments are placement.attach's (`PlacementCallback(tune={"enabled": False})`).
"""
from __future__ import annotations

import os
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError:
    raise ImportError("placement.integrations.transformers needs Hugging Face Transformers: "
                      "pip install 'placement[transformers]'") from None

from placement.integrations._steps import FrameworkSteps


class PlacementCallback(TrainerCallback):
    def __init__(self, config: Any = None, **overrides: Any):
        self.steps = FrameworkSteps(config, overrides)

    @property
    def handle(self) -> Any:
        return self.steps.handle

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self.steps.start(_ddp_of(model), optimizer, default_log_dir=os.path.join(args.output_dir, "placement_logs"))

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.mark()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.batch_start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.mark()

    on_log = on_save = on_evaluate = on_step_end  # each ends work between steps that is not data wait

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.close()


def _ddp_of(model: Any) -> Any:
    """The torch DDP wrapping `model`, else `model`. Callbacks get the Trainer's unwrapped model
    (CallbackHandler.model); attach() times DDP's bucket all-reduces through a comm hook on the DDP
    itself, which holds the model in its `_modules`: found once, at train begin, through the
    garbage collector's referrer lists (a few dicts, not a heap walk)."""
    import gc

    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return model
    # model <- DDP's `_modules` dict <- DDP's instance __dict__ <- the DDP: dicts only, two levels.
    level = [c for c in gc.get_referrers(model) if isinstance(c, dict)]
    for _ in range(2):
        above = [r for c in level for r in gc.get_referrers(c)]
        for owner in above:
            if isinstance(owner, DistributedDataParallel) and owner.module is model:
                return owner
        level = [r for r in above if isinstance(r, dict)]
    return model
