"""What the framework callbacks (placement.integrations.lightning, .transformers) share: attach at
the start of training, a step record per optimizer step, the data wait taken between two of the
framework's own hooks, close at the end.

The frameworks fetch the next batch themselves, between the end of one step (with its logging,
saving and evaluation) and the hook that starts the next: the callback marks the first and adds
the time up to the second to the step's data wait, the counter a watched iterator adds to
(placement.monitor.watch.DataWaitCounter). Steps end where the optimizer steps (its post-step hook,
as attach() installs it): with gradient accumulation a record is an optimizer step, not a batch.
Environment a callback sets for attach() (Lightning's LOCAL_WORLD_SIZE) is put back at close: the
process outlives the fit (a second fit, a test run, the user's own code after it).
"""
from __future__ import annotations

import os
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

    def start(self, model: Any, optimizer: Any, default_log_dir: Optional[str] = None,
              env_defaults: Optional[dict[str, str]] = None) -> Any:
        """placement.attach(model, optimizer) with the callback's settings; `default_log_dir` (where
        the framework keeps its own output) when no monitor.log_dir was given and placerun's is not there;
        `env_defaults` set in os.environ where missing (attach() reads them), until close()."""
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
        self.mark()
        return self.handle

    def mark(self) -> None:
        """The framework is done with a step (or an epoch starts): what follows up to batch_start()
        is the fetch of the next batch."""
        self._mark = perf_counter_ns()

    def batch_start(self) -> None:
        monitor = None if self.handle is None else self.handle.monitor
        if self._mark is not None and monitor is not None:
            monitor.data_ns += perf_counter_ns() - self._mark
        self._mark = None

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        for key in self._env_set:
            os.environ.pop(key, None)
        self._env_set.clear()
