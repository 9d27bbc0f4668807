"""Cores a role could move to: in the rank's share, no other hot role, nothing foreign pinned there."""
from __future__ import annotations

from placement.roles import HOT_ROLES, ThreadRole
from placement.tune.rules.base import RuleContext


def active_hot_roles(ctx: RuleContext) -> list[ThreadRole]:
    """Hot roles with live threads in the window: only they hold a core (NCCL holds none in a
    CPU-only job, pin_memory none without pinned-memory loaders)."""
    return [r for r in HOT_ROLES if ctx.stats.role(r) is not None]


def free_cores(ctx: RuleContext, role: ThreadRole) -> list[frozenset[int]]:
    """Candidate cores for `role`, best first: no other active hot role there, no foreign
    thread pinned to the core, fewest other runnable foreign threads seen there, fewest of
    our background roles, fastest."""
    layout = ctx.layout
    candidates = layout.candidate_cores(role, active_hot_roles(ctx))
    if not candidates:
        return []
    foreign = ctx.facts.foreign_threads(frozenset().union(*candidates))
    scored = []
    for order, core in enumerate(candidates):  # candidates come fastest first
        full_core = layout.cores.cores_of(core)
        if any(t.pinned_within(full_core) for t in foreign):
            continue
        seen_here = sum(1 for t in foreign if t.last_cpu in full_core)
        ours = len(layout.co_runners(role, full_core))
        scored.append(((seen_here, ours, order), core))
    return [core for _, core in sorted(scored, key=lambda x: x[0])]
