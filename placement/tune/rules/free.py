"""Cores a role could move to: in the rank's share, no other hot role, nothing foreign pinned there."""
from __future__ import annotations

from placement.roles import HOT_ROLES, ThreadRole
from placement.tune.rules.base import RuleContext


def free_cores(ctx: RuleContext, role: ThreadRole) -> list[frozenset[int]]:
    """Candidate cores for `role`, best first: no other hot role with live threads there, no
    foreign thread pinned to the core, fewest other runnable foreign threads seen there,
    fewest of our background roles, fastest. A hot role with no thread in the window (NCCL
    in a CPU-only job) holds no core."""
    layout = ctx.layout
    active = [r for r in HOT_ROLES if ctx.stats.role(r) is not None]
    candidates = layout.candidate_cores(role, active)
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
