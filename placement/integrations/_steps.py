"""What the framework callbacks (placement.integrations.lightning, .transformers) share: attach at
the start of training, a step record per optimizer step, the data wait, close at the end.

The frameworks fetch the next batch themselves. The data wait is taken one of two ways, added to
the counter a watched iterator adds to (placement.monitor.watch.DataWaitCounter):
- between two of the framework's own hooks (Transformers: its callbacks get every event anyway):
  the callback marks the end of one step (with its logging, saving and evaluation) and adds the
  time up to the hook that starts the next;
- as the automatic monitor takes it (FetchWait, Lightning): the time the training thread is
  blocked in a DataLoader fetch, so that the callback needs no hook of the framework at each step.
Steps end where the optimizer steps (its post-step hook, as attach() installs it): with gradient
accumulation a record is an optimizer step, not a batch. Environment a callback sets for attach()
(Lightning's LOCAL_WORLD_SIZE) is put back at close: the process outlives the fit (a second fit,
a test run, the user's own code after it).
"""
from __future__ import annotations

import functools
import os
import threading
from time import perf_counter_ns
from typing import Any, Optional

import placement
from placement.attach_api import _current_session


class FrameworkSteps:
    def __init__(self, config: Any = None, overrides: Optional[dict[str, Any]] = None):
        self.config = config
        self.overrides = dict(overrides or {})
        self.handle: Any = None
        self._mark: Optional[int] = None
        self._env_set: list[str] = []  # keys start() added to os.environ, removed again by close()
        self._fetches: Optional[FetchWait] = None

    def start(self, model: Any, optimizer: Any, default_log_dir: Optional[str] = None,
              env_defaults: Optional[dict[str, str]] = None, time_fetches: bool = False) -> Any:
        """placement.attach(model, optimizer) with the callback's settings; `default_log_dir` (where
        the framework keeps its own output) when no monitor.log_dir was given and placerun's is not there;
        `env_defaults` set in os.environ where missing (attach() reads them), until close();
        `time_fetches`: the data wait is the DataLoader fetches' (FetchWait), not mark()'s."""
        for key, value in (env_defaults or {}).items():
            if key not in os.environ:
                os.environ[key] = value
                self._env_set.append(key)

        overrides = dict(self.overrides)
        given = overrides.get("monitor", {}).get("log_dir") if isinstance(overrides.get("monitor"), dict) else None
        # Under placerun the rank's log is placerun's (stage 1's bind events are in it): only a run
        # without placerun takes the framework's directory.
        if default_log_dir is not None and given is None and "monitor.log_dir" not in overrides \
                and self.config is None and _current_session() is None:
            overrides["monitor.log_dir"] = default_log_dir
        self.handle = placement.attach(model, optimizer, config=self.config, **overrides)
        monitor = self.handle.monitor
        if time_fetches and monitor is not None:
            self._fetches = FetchWait(monitor.hook)
        else:
            self.mark()
        return self.handle

    def mark(self) -> None:
        """The framework is done with a step (or an epoch starts): what follows up to batch_start()
        is the fetch of the next batch."""
        self._mark = perf_counter_ns()

    def batch_start(self) -> None:
        monitor = None if self.handle is None else self.handle.monitor
        if self._mark is not None and monitor is not None:
            monitor.hook.data_ns += perf_counter_ns() - self._mark
        self._mark = None

    def close(self) -> None:
        if self._fetches is not None:
            self._fetches.stop()
            self._fetches = None
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        for key in self._env_set:
            os.environ.pop(key, None)
        self._env_set.clear()


class FetchWait:
    """The time the calling (training) thread is blocked in a DataLoader fetch, added to the
    monitor's data wait: `_BaseDataLoaderIter.__next__` (torch/utils/data/dataloader.py:720, the
    span torch's profiler names `enumerate(DataLoader)#<Iter>.__next__`) and DataLoader.__iter__,
    where a DataLoader starts its workers: what the automatic monitor times (placement/auto/
    monitor.py, `_hook_dataloader`), without its step finding (here the optimizer's post-step hook
    ends the steps). Other threads' fetches and a forked worker's are not timed. In from
    construction to stop(), which puts the classes' own methods back (a method patched over ours
    meanwhile is left, and ours passes straight through from then on)."""

    def __init__(self, monitor: Any):
        from torch.utils.data import dataloader

        main = threading.get_ident()
        get_ident = threading.get_ident
        self.active = True
        timer = self

        def timed(original):
            @functools.wraps(original)
            def wrapper(obj):
                if get_ident() != main or not timer.active:
                    return original(obj)
                t0 = perf_counter_ns()
                try:
                    return original(obj)
                finally:  # StopIteration too: the wait for a loader to find its end is data wait
                    monitor.data_ns += perf_counter_ns() - t0
            return wrapper

        self._patches = []  # (class, name, its own method, ours)
        for cls, name in ((dataloader._BaseDataLoaderIter, "__next__"), (dataloader.DataLoader, "__iter__")):
            original = getattr(cls, name)
            ours = timed(original)
            setattr(cls, name, ours)
            self._patches.append((cls, name, original, ours))

    def stop(self) -> None:
        self.active = False
        for cls, name, original, ours in self._patches:
            if cls.__dict__.get(name) is ours:
                setattr(cls, name, original)
