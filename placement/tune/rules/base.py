"""What a rule sees (RuleContext) and what it returns (Proposal). Rules decide only;
the Tuner applies, judges and rolls back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from placement.config import TuneConfig
from placement.roles import ThreadRole
from placement.tune.facts import HostFacts
from placement.tune.layout import RoleLayout
from placement.tune.window import WindowStats


@dataclass
class RuleContext:
    stats: WindowStats  # the window just finished
    layout: RoleLayout  # where each role may run now
    cfg: TuneConfig
    facts: HostFacts
    memory_mode: str  # the plan's memory policy for this rank ("bind", "none", ...)
    # DataLoader workers sharing a hot thread's CPU run at tune.background_nice (the binder
    # sees to it), so the hot thread preempts them.
    background_niced: bool


@dataclass(frozen=True)
class Proposal:
    """A change of one role's CPU set, or (role None) a warning that changes nothing."""

    rule: str
    role: Optional[ThreadRole]
    cpus: Optional[frozenset[int]]
    reason: str  # one line a person reads
    evidence: dict[str, Any] = field(default_factory=dict)
    # Our background roles moved in the same action, judged and undone with it: the role
    # goes to a core they ran on, so they make room (one action, one judgement, instead of
    # a move that the next window would have to undo half of).
    also: tuple[tuple[ThreadRole, frozenset[int]], ...] = ()

    @property
    def is_move(self) -> bool:
        return self.role is not None and self.cpus is not None


class Rule:
    """A named decision: propose(ctx) -> Proposal | None. May keep small state between windows."""

    name = ""

    def propose(self, ctx: RuleContext) -> Optional[Proposal]:
        raise NotImplementedError


def rounded(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 2)
