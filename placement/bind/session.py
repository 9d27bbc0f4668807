"""The placement state of one rank process, created by stage 1 (placement.bootstrap).

`placement.attach()` finds it with `current()` when the process runs under placerun, and
then uses its plan, event log and binder instead of planning and binding again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from placement.bind.binder import RoleBinder
from placement.bind.fork import stop_rehoming
from placement.bind.memory import AppliedMemory
from placement.config import PlacementConfig
from placement.events import EventKind, EventLog
from placement.identity import RankIdentity
from placement.plan.model import Plan, RankPlan


@dataclass
class Session:
    config: PlacementConfig
    plan: Plan
    rank_plan: RankPlan
    events: EventLog
    binder: RoleBinder  # owns each role's current CPU set (the tuner moves roles through it)
    identity: RankIdentity
    memory: Optional[AppliedMemory] = None  # what stage 1 applied (None: policy none, untouched)
    # The process's CPUs before stage 1 narrowed it: what a process torchrun starts counts as "the
    # system's" (bind/dataloader.py).
    launched_cpus: frozenset[int] = frozenset()
    # Who the rank is, when only its program can say (a Ray worker is bound at its `import torch`,
    # its rank set by Ray Train later): called once, before the monitor starts and at the latest
    # at close; it sets `identity` and opens the held event log (placement/integrations/ray.py).
    settle: Optional[Callable[["Session"], None]] = None
    closed: bool = field(default=False, init=False)

    def settle_identity(self) -> None:
        settle, self.settle = self.settle, None
        if settle is not None:
            settle(self)

    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def local_rank(self) -> int:
        return self.identity.local_rank

    @property
    def world_size(self) -> int:
        return self.identity.world_size

    def close(self) -> None:
        """Stop the watcher, log the end, flush and close the event log. Idempotent."""
        if self.closed:
            return
        self.settle_identity()
        self.closed = True
        stop_rehoming()
        self.binder.stop_watcher()
        self.events.event(EventKind.END)
        self.events.close()


_current: Optional[Session] = None


def current() -> Optional[Session]:
    return _current


def set_current(s: Optional[Session]) -> None:
    global _current
    _current = s
