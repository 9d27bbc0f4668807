"""PyTorch Lightning: one callback, no change to the LightningModule.

    from placement.integrations.lightning import PlacementCallback
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[PlacementCallback()])

At fit start (after Lightning set up the process group, wrapped the model in DDP and built the
optimizers) it calls placement.attach(trainer.strategy.model, the first optimizer): under placerun
it joins the rank's Session; under Lightning's own launcher, which starts the other processes
itself, each process plans its share of the node (LOCAL_WORLD_SIZE from trainer.num_devices when
the launcher did not set it, removed again at close) and binds itself. A step ends at each
optimizer step: with accumulate_grad_batches=k, one step per k batches; at each batch's end in
manual optimization without an optimizer (configure_optimizers returned None). The data wait is the
time the training thread is blocked in DataLoader fetches (Lightning's data fetcher fetches one
batch ahead, through the DataLoader's iterator: integrations/_steps.py FetchWait), as under
placerun's automatic monitor. close() at fit end.

Keyword arguments are placement.attach's (`PlacementCallback(monitor={"log_dir": "runs/x"})`).

No hook of this callback runs at a step. Lightning calls a callback's hook only if it is callable,
each call inside trainer.profiler.profile() named by the callback's state_key
(lightning/pytorch/trainer/call.py, `_call_callback_hooks`: lines 224-228 in 2.6.6, 186-190 in
2.0.0), a few microseconds each: the hooks of Lightning's Callback that this one does not use are
None on it, so Lightning skips them (the base class's empty ones are six a step). A subclass that
needs one of them defines it again.
"""
from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError:
        raise ImportError("placement.integrations.lightning needs PyTorch Lightning: "
                          "pip install 'placement[lightning]'") from None

from placement.integrations._steps import FrameworkSteps


class PlacementCallback(Callback):
    def __init__(self, config: Any = None, **overrides: Any):
        super().__init__()
        self.steps = FrameworkSteps(config, overrides)

    @property
    def handle(self) -> Any:
        return self.steps.handle

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = trainer.optimizers
        optimizer = optimizers[0] if optimizers else None
        # configure_optimizers returned None: Lightning holds a stand-in optimizer
        # (lightning/pytorch/core/optimizer.py `_MockOptimizer`, set at L186 in 2.6.6), which its
        # automatic optimization steps (the post-step hook fires) and manual optimization does not.
        batch_is_step = optimizer is None or (not pl_module.automatic_optimization and all(
            type(o).__name__ == "_MockOptimizer" for o in optimizers))
        self.steps.start(trainer.strategy.model, optimizer, env_defaults={"LOCAL_WORLD_SIZE": str(trainer.num_devices)},
                         time_fetches=True)
        # the one hook at a step, and only where no optimizer step ends it (the instance's
        # attribute is what Lightning's getattr finds)
        self.on_train_batch_end = self._batch_end if batch_is_step else None

    def _batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.handle is not None:
            self.handle.step()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.steps.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.steps.close()


# Lightning calls these on a callback directly, not through `_call_callback_hooks` (call.py,
# `_call_callbacks_on_save_checkpoint`, `_call_callbacks_on_load_checkpoint`): they stay methods.
_CALLED_DIRECTLY = ("on_save_checkpoint", "on_load_checkpoint")
for _hook in [name for name in vars(Callback) if name.startswith("on_") or name in ("setup", "teardown")]:
    if _hook not in vars(PlacementCallback) and _hook not in _CALLED_DIRECTLY:
        setattr(PlacementCallback, _hook, None)
del _hook
