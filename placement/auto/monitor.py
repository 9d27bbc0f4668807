"""The automatic monitor: step records for a program placerun runs, without a line of its code.

What
    placerun's startup hook (placement.bootstrap.start_worker) calls `install(session)` in every
    Python worker. Hooks wait for the program to import torch (placement/imports.py), then:
    - torch's global optimizer post-step hook (torch/optim/optimizer.py:309-326, called after
      every Optimizer.step by `profile_hook_step`, L534-538) and GradScaler.step (torch/amp/
      grad_scaler.py:375; it skips optimizer.step on inf/nan) are fires;
    - `_BaseDataLoaderIter.__next__` (torch/utils/data/dataloader.py:720, the span torch's
      profiler names `enumerate(DataLoader)#<Iter>.__next__`) is a fetch, and the time the main
      thread is blocked in it, and in DataLoader.__iter__ (worker start), is data wait;
    - DistributedDataParallel.__init__ remembers the model, whose bucket all-reduces get the
      same timed comm hook attach() installs (monitor/comm/timing.py install_ddp_hook).
    Fires and fetches on the rank's main thread become steps (auto/steps.py). At the first fire
    the rank's monitor starts, as attach() starts it (placement.attach_api.attach_automatic:
    the same records, exchange, stall watch, residence watch, tuner): by then the program has
    built its process group and model, and a program that never steps an optimizer (evaluation,
    inference) never starts a monitor and is told so in one line at exit.

One monitor a process
    A program (or a framework callback) that calls placement.attach() takes over: before the
    first fire, the hooks stand down; after it, the automatic monitor closes and attach()'s
    monitor numbers its steps on from where it stopped.

Cost
    Per step: the hook calls (a frame each) and StepFinder's integer work; per fetch, two clock
    reads. Hooks on another thread or in a forked child (a DataLoader worker) return at once.
"""
from __future__ import annotations

import atexit
import enum
import functools
import os
import sys
import threading
import weakref
from time import perf_counter_ns
from typing import Optional

from placement import imports
from placement.errors import say
from placement.events import EventKind
from placement.auto.steps import StepFinder
from placement.roles import main_thread, set_main_thread


class AutoState(enum.Enum):
    WAITING = "waiting"  # hooks in, no optimizer step yet
    RUNNING = "running"  # the monitor runs; steps come from the hooks
    GAVE_WAY = "gave_way"  # the program called attach(): its monitor is the process's one
    CLOSED = "closed"  # closed at exit (or the monitor could not start)


# The hooks run right after a step, when every code path is cold: the state is compared by
# identity with these, not looked up on the enum class each time (benchmarks/hook_profile.py).
_RUNNING, _WAITING = AutoState.RUNNING, AutoState.WAITING
_get_ident = threading.get_ident

NO_STEP_LINE = ("no optimizer step ran, so this run has no step records (placerun finds a step where a "
                "torch.optim optimizer steps: docs/monitor.md); a loop without one can mark its steps with "
                "placement.attach() and handle.step()")


class _ThreadEnd:
    """Kept in the main thread's locals: dropped, and so finalized, when that thread ends."""


class AutoMonitor:
    def __init__(self, session, find_main: bool = False):
        """find_main: the training loop may run on a thread of its own (Ray Train's
        TrainingThread): the thread of the first optimizer step is the rank's main thread."""
        self.session = session
        self.state = AutoState.WAITING
        self.handle = None
        self.counter = None  # the monitor's step hook: data wait and the last batch go to it (monitor/hook.py)
        self.finder: Optional[StepFinder] = None  # made when the monitor starts (adopt)
        self.fetches = 0  # batches the main thread fetched before the monitor started
        # The rank's main thread: the hooks act only there. In a forked child (a DataLoader
        # worker) no thread is it, so the hooks return at once there, with no getpid() call per step.
        self._main = None if find_main else main_thread().ident
        self._find_main = find_main
        self._pid = os.getpid()
        os.register_at_fork(after_in_child=self._forget_main)
        self._ddp: Optional[weakref.ref] = None
        self._undo: list = []  # callables that take the hooks out again

    # ---- installing ------------------------------------------------------------------------
    def install(self) -> None:
        """The hooks (as torch's modules are imported) and the exit path."""
        self.hook()
        atexit.register(self._at_exit)

    def hook(self) -> None:
        """Put the hooks in, each when its torch module is imported (at once if it is)."""
        imports.when_imported("torch.optim.optimizer", self._hook_optimizers)
        imports.when_imported("torch.amp.grad_scaler", self._hook_grad_scaler)
        imports.when_imported("torch.utils.data.dataloader", self._hook_dataloader)
        imports.when_imported("torch.nn.parallel.distributed", self._hook_ddp)

    def _hook_optimizers(self, module) -> None:
        auto = self

        def placement_auto_step(optimizer, _args, _kwargs):
            # _fire, inline: this runs at every step of every program, right after its optimizer
            # step, where each frame costs microseconds (benchmarks/monitor_overhead.py, auto_us)
            if _get_ident() != auto._main and not (auto._find_main and auto._adopt_main()):
                return
            state = auto.state
            if state is _RUNNING:
                auto.finder.fire(id(optimizer), False)
            elif state is _WAITING:
                auto._start(id(optimizer), False)

        self._undo.append(module.register_optimizer_step_post_hook(placement_auto_step).remove)

    def _hook_grad_scaler(self, module) -> None:
        cls = module.GradScaler
        original = cls.step
        fire = self._fire

        @functools.wraps(original)
        def step(scaler, optimizer, *args, **kwargs):
            out = original(scaler, optimizer, *args, **kwargs)
            fire(id(scaler), True)
            return out

        self._patch(cls, "step", original, step)

    def _hook_dataloader(self, module) -> None:
        it_cls, loader_cls = module._BaseDataLoaderIter, module.DataLoader
        next_original, iter_original = it_cls.__next__, loader_cls.__iter__
        auto = self

        @functools.wraps(next_original)
        def __next__(it):
            if _get_ident() != auto._main:  # (after give_way the class has its own again)
                return next_original(it)
            first = it._num_yielded == 0  # dataloader.py:723 counts the batches handed out
            t0 = perf_counter_ns()
            try:
                batch = next_original(it)
            except StopIteration:
                auto._waited(t0)
                raise
            # what a fetch tells the monitor, inline (one frame less at every fetch)
            counter = auto.counter
            if auto.state is not _RUNNING or counter is None:
                auto.fetches += 1
                return batch
            auto.finder.fetched(t0, first)  # may end the step at t0: the wait below is the next step's
            counter.data_ns += perf_counter_ns() - t0
            counter.last_batch = batch
            return batch

        @functools.wraps(iter_original)
        def __iter__(loader):
            t0 = perf_counter_ns()  # a DataLoader starts its workers here: data wait too
            it = iter_original(loader)
            if auto.state is _RUNNING and threading.get_ident() == auto._main:
                auto._waited(t0)
            return it

        self._patch(it_cls, "__next__", next_original, __next__)
        self._patch(loader_cls, "__iter__", iter_original, __iter__)

    def _hook_ddp(self, module) -> None:
        cls = module.DistributedDataParallel
        original = cls.__init__
        auto = self

        @functools.wraps(original)
        def __init__(ddp, *args, **kwargs):
            original(ddp, *args, **kwargs)
            if threading.get_ident() == auto._main or auto._find_main:
                auto._ddp = weakref.ref(ddp)

        self._patch(cls, "__init__", original, __init__)

    def _patch(self, cls, name: str, original, replacement) -> None:
        setattr(cls, name, replacement)
        self._undo.append(lambda: setattr(cls, name, original))

    def unhook(self) -> None:
        """Take every hook out (the classes get their own methods back)."""
        imports.cancel(self._hook_optimizers, self._hook_grad_scaler, self._hook_dataloader, self._hook_ddp)
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _forget_main(self) -> None:
        self._main = None
        self._find_main = False

    def _adopt_main(self) -> bool:
        """The calling thread steps the first optimizer: it is the rank's main thread from now on
        (roles, probes, the hang watch's stack), re-bound as `main` now. False: not this process."""
        if not self._find_main or os.getpid() != self._pid:
            return False
        self._find_main = False
        self._main = threading.get_ident()
        set_main_thread(self._main, threading.get_native_id())
        self.session.binder.rescan(force=True)
        # When that thread ends (Ray Train's training function returned) the rank's training is
        # over, and Ray stops the worker with ray.kill, where no exit handler runs: the monitor
        # closes as the thread ends, as at exit. A thread's locals are dropped as it ends (CPython
        # PyThreadState_Clear), and the marker with them.
        self._thread_end = threading.local()
        self._thread_end.marker = marker = _ThreadEnd()
        weakref.finalize(marker, self._main_ended)
        return True

    def _main_ended(self) -> None:
        if self.state is _RUNNING and self.handle is not None and os.getpid() == self._pid:
            self.state = AutoState.CLOSED
            self.handle.close()

    # ---- events ----------------------------------------------------------------------------
    def _fire(self, key: int, outer: bool) -> None:
        if threading.get_ident() != self._main and not (self._find_main and self._adopt_main()):
            return
        state = self.state
        if state is _RUNNING:
            self.finder.fire(key, outer)
        elif state is _WAITING:
            self._start(key, outer)

    def _waited(self, t0: int) -> None:
        counter = self.counter
        if self.state is _RUNNING and counter is not None:
            counter.data_ns += perf_counter_ns() - t0

    # ---- lifecycle -------------------------------------------------------------------------
    def _start(self, key: int, outer: bool) -> None:
        from placement import attach_api

        try:
            handle = attach_api.attach_automatic(model=None if self._ddp is None else self._ddp(),
                                                 megatron_iteration=megatron_iteration())
        except Exception as e:  # training goes on unmonitored, as under torchrun
            self.state = AutoState.CLOSED
            self.unhook()
            say(f"placement: rank {self.session.rank}: the automatic monitor did not start "
                f"({type(e).__name__}: {e}); this rank runs without step records")
            return
        if handle.monitor is None:  # placement.monitor.enabled=false
            self.state = AutoState.CLOSED
            self.unhook()
            return
        self.adopt(handle, key, outer)

    def adopt(self, handle, key: int, outer: bool = False) -> None:
        """Mark `handle`'s monitor's steps from now on; step 1 begins at the fire of `key`."""
        hook = handle.monitor.hook
        self.handle, self.counter = handle, hook
        handle.on_close = self._handle_closed
        # A fire ends a step now (the monitor's own hook, no frame between); a fetch at its start.
        self.finder = StepFinder(hook.on_step, lambda start_ns: hook.on_step(at=start_ns))
        self.state = AutoState.RUNNING
        self.finder.begin(key, outer, seen_fetch=self.fetches > 0)

    def give_way(self) -> None:
        """attach() was called: its monitor is the one. Idempotent. Where the loop's thread was
        still to be found, it is the caller's (attach() is called where the loop runs)."""
        if self.state in (AutoState.WAITING, AutoState.RUNNING):
            self.state = AutoState.GAVE_WAY
            self._adopt_main()
            self.unhook()

    def _handle_closed(self) -> None:
        if self.state is AutoState.RUNNING:
            self.state = AutoState.GAVE_WAY
            self.unhook()
        self.counter = None

    def _at_exit(self) -> None:
        if os.getpid() != self._pid:
            return
        if self.state is AutoState.RUNNING and self.handle is not None:
            self.state = AutoState.CLOSED
            self.handle.close()
        elif self.state is AutoState.WAITING and not hasattr(sys, "last_value"):
            # (sys.last_value: the program ends on an uncaught exception, which says enough)
            self.state = AutoState.CLOSED
            if not self.session.closed:
                self.session.events.event(EventKind.WARNING, source="monitor", message=NO_STEP_LINE,
                                          batches_fetched=self.fetches)
            say(f"placement: rank {self.session.rank}: {NO_STEP_LINE}")
        self.unhook()


def megatron_iteration() -> Optional[int]:
    """Megatron-LM's iteration now, when the program is Megatron-LM's train(): it sets
    `args.curr_iteration = iteration` before each train_step (megatron/training/training.py, the
    train loop) in the args megatron/training/global_vars.py keeps as _GLOBAL_ARGS, as NVIDIA's
    ft_launcher reads it. Looked up, never imported; None elsewhere."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    value = getattr(getattr(global_vars, "_GLOBAL_ARGS", None), "curr_iteration", None)
    return value if isinstance(value, int) else None


_auto: Optional[AutoMonitor] = None


def install(session, find_main: bool = False) -> Optional[AutoMonitor]:
    """The automatic monitor for this worker (placement.monitor.auto), or None when it is off."""
    global _auto
    cfg = session.config.monitor
    if not (cfg.enabled and cfg.auto) or _auto is not None:
        return _auto
    _auto = AutoMonitor(session, find_main)
    _auto.install()
    return _auto


def current() -> Optional[AutoMonitor]:
    return _auto
