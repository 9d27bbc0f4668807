"""Megatron-core: per-step records for a Megatron training loop with one call.

    from placement.integrations.megatron import attach_megatron
    pm = attach_megatron(optimizer, train_data_iterator, model=model)
    ... train_step(forward_step, pm.data_iterator, model, optimizer, ...) ...  # unchanged loop
    pm.close()

A step ends when Megatron's optimizer wrapper steps: its `step()` runs once per iteration (after
all microbatches) whatever it wraps, also when it skips the inner torch step after an fp16 overflow
or steps several inner optimizers (ChainedOptimizer), so the wrapper's step, not the torch one,
marks the boundary. The data iterator Megatron's schedules call `next()` on is wrapped so the
time blocked on the next microbatch is the step's data wait. Built on placement.attach: under
placerun it joins the rank's Session; run alone, it plans and binds this rank itself.

Megatron-LM hands `train_step` a megatron-core `RerunDataIterator` (megatron/training/training.py,
`_get_iterator`), and `train_step` calls `RerunStateMachine.should_run_forward_backward` on it,
which asserts `isinstance(d, RerunDataIterator)` in every mode but DISABLED (megatron-core 0.16.1,
megatron/core/rerun_state_machine.py:294 -> `_sanitize_data_iterators`, 921-923). So such an
iterator is not wrapped: its inner iterator is (RerunDataIterator.__next__ calls `next(self.iterable)`,
1114-1127), in place, and the same object is handed back. Replayed microbatches (a rerun) come from
its buffer, not from the inner iterator, so they add no data wait; close() puts the inner iterator back.
"""
from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Optional

import placement
from placement.errors import ConfigError


def torch_optimizers(optimizer: Any) -> list:
    """The torch.optim.Optimizer(s) inside Megatron's wrapper, in the order they step:
    ChainedOptimizer.chained_optimizers[*], then MegatronOptimizer.optimizer (FP32Optimizer,
    Float16OptimizerWithFloat16Params, DistributedOptimizer), or a torch optimizer itself.

    Raises ConfigError naming what was given when none is found."""
    import torch

    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for o in chained for inner in torch_optimizers(o)]
    inner = getattr(optimizer, "optimizer", None)  # MegatronOptimizer.optimizer (None on a stub rank)
    if isinstance(inner, torch.optim.Optimizer):
        return [inner]
    if inner is None and hasattr(optimizer, "step_with_ready_grads"):
        return []  # a Megatron stub optimizer: this rank holds no trainable parameters
    raise ConfigError(f"optimizer of type {type(optimizer).__name__} is not a Megatron optimizer or torch "
                      "optimizer; valid: MegatronOptimizer, ChainedOptimizer, torch.optim.Optimizer")


def _rerun_iterator_class() -> Optional[type]:
    """megatron-core's RerunDataIterator when its module is loaded (an object can be one only
    then): placement never imports megatron-core for this check."""
    module = sys.modules.get("megatron.core.rerun_state_machine")
    return getattr(module, "RerunDataIterator", None)


@dataclass
class _InnerSwap:
    """A RerunDataIterator whose inner iterator attach_megatron wrapped, and what it was."""
    rerun_iterator: Any
    original: Any

    def restore(self) -> None:
        self.rerun_iterator.iterable = self.original


def watch_data_iterator(handle: Any, data_iterator: Any, swaps: Optional[list] = None) -> Any:
    """Megatron's data_iterator as its schedules take it: None (ranks that load no data), one
    iterator, or a list of them (virtual pipeline stages); each iterator wrapped by handle.watch,
    except a RerunDataIterator, whose inner iterator is wrapped in place (and recorded in `swaps`
    for close()) so megatron-core's rerun state machine still accepts it."""
    if data_iterator is None:
        return None
    if isinstance(data_iterator, list):
        return [watch_data_iterator(handle, it, swaps) for it in data_iterator]
    rerun_class = _rerun_iterator_class()
    if rerun_class is not None and isinstance(data_iterator, rerun_class):
        original = data_iterator.iterable
        data_iterator.iterable = handle.watch(original)
        if swaps is not None:
            swaps.append(_InnerSwap(data_iterator, original))
        return data_iterator
    return handle.watch(data_iterator)


@dataclass
class MegatronAttachment:
    handle: Any  # the placement.attach Handle (add_observer, comm, ...)
    optimizer: Any  # the Megatron optimizer whose step() now also ends a step record
    data_iterator: Any  # pass this to the training loop in place of the original
    torch_optimizers: list = field(default_factory=list)
    _step_wrapper: Any = None
    _swaps: list = field(default_factory=list)  # _InnerSwap per RerunDataIterator wrapped in place
    _closed: bool = False

    def close(self) -> None:
        """Restore the optimizer's own step() and the inner iterators of RerunDataIterators, flush
        the records, stop the monitor. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # Only our wrapper is removed: one installed over it later (an LR scheduler's) stays, and
        # ends no record once the handle is closed.
        if vars(self.optimizer).get("step") is self._step_wrapper:
            del self.optimizer.step
        for swap in self._swaps:
            swap.restore()
        self.handle.close()

    def __enter__(self) -> "MegatronAttachment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attach_megatron(optimizer: Any, data_iterator: Any = None, *, model: Any = None,
                    config: Any = None, **overrides: Any) -> MegatronAttachment:
    """Attach placement to a Megatron-core training loop.

    optimizer: Megatron's optimizer (get_megatron_optimizer's result) or a torch optimizer.
    data_iterator: what the loop hands Megatron's forward_backward_func or Megatron-LM's train_step
        (None, an iterator, a RerunDataIterator, or a list of them). A RerunDataIterator comes back
        as the same object (its inner iterator watched): Megatron-LM's loop needs no other change.
    model: the model, or Megatron-LM's list of chunks; one module is passed on to placement.attach
        (a torch DDP comm hook when it is one).
    config / overrides: as placement.attach (PlacementConfig or dict; keyword overrides).
    """
    inner = torch_optimizers(optimizer)
    # Megatron-LM's model is a list of chunks (several with a virtual pipeline). attach() takes one
    # module, for a torch DDP comm hook; Megatron's own DDP issues its bucket collectives through
    # torch.distributed's Python functions, which attach times without a hook.
    chunk = (model[0] if len(model) == 1 else None) if isinstance(model, list) else model
    handle = placement.attach(chunk, None, config=config, **overrides)
    original_step = optimizer.step

    @functools.wraps(original_step)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_step(*args, **kwargs)
        handle.step()
        return result

    # A bound method on the instance (close() deletes it and the class's step is back); bound, so
    # wrappers that rebind step.__func__ (torch's LR schedulers) can wrap it in turn.
    step = types.MethodType(step, optimizer)
    optimizer.step = step
    swaps: list[_InnerSwap] = []
    watched = watch_data_iterator(handle, data_iterator, swaps)
    return MegatronAttachment(handle=handle, optimizer=optimizer, data_iterator=watched, torch_optimizers=inner,
                              _step_wrapper=step, _swaps=swaps)
