"""The placement state of one rank process, created by stage 1 (placement.bootstrap).

`placement.attach()` finds it with `current()` when the process runs under placerun, and
then uses its plan, event log and binder instead of planning and binding again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from placement.bind.binder import RoleBinder
from placement.bind.memory import AppliedMemory
from placement.config import PlacementConfig
from placement.events import EventKind, EventLog
from placement.plan.model import Plan, RankPlan
from placement.topology.model import Topology


@dataclass
class Session:
    config: PlacementConfig
    plan: Plan
    rank_plan: RankPlan
    topology: Optional[Topology]
    events: EventLog
    binder: RoleBinder
    rank: int
    local_rank: int
    world_size: int
    memory: Optional[AppliedMemory] = None  # what stage 1 applied (None: policy none, untouched)
    closed: bool = field(default=False, init=False)

    def close(self) -> None:
        """Stop the watcher, log the end, flush and close the event log. Idempotent."""
        if self.closed:
            return
        self.closed = True
        from placement.bind.fork import stop_rehoming

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
