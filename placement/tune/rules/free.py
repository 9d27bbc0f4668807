"""Cores a role could move to: in the rank's share, no other hot role, nothing foreign pinned
there, no busy role of ours."""
from __future__ import annotations

from typing import Optional

from placement.roles import HOT_ROLES, ThreadRole
from placement.tune.rules.base import RuleContext

# A role of ours on-CPU at least this share of the step, per CPU of its set, keeps a core from
# being free: a thread moved there trades the foreign hog for our own work. Where that work is
# main's OpenMP team (a CPU-only rank's intra-op pool spans main's and other's CPUs,
# plan.auto.intra_op_threads), main moved onto it puts two threads of one team on one core, and
# each barrier waits for the scheduler to switch between them (docs/benchmarks.md, contention).
OWN_BUSY_PCT = 25.0


def active_hot_roles(ctx: RuleContext) -> list[ThreadRole]:
    """Hot roles with live threads in the window: only they hold a core (NCCL holds none in a
    CPU-only job, pin_memory none without pinned-memory loaders)."""
    return [r for r in HOT_ROLES if ctx.stats.role(r) is not None]


def free_cores(ctx: RuleContext, role: ThreadRole) -> list[frozenset[int]]:
    """Candidate cores for `role`, best first: no other active hot role there, no foreign
    thread pinned to the core, no busy role of ours (busy_own), fewest other runnable foreign
    threads seen there, fewest of our background roles, fastest."""
    layout = ctx.layout
    candidates = layout.candidate_cores(role, active_hot_roles(ctx))
    if not candidates:
        return []
    foreign = ctx.facts.foreign_threads(frozenset().union(*candidates))
    scored = []
    for order, core in enumerate(candidates):  # candidates come fastest first
        full_core = layout.cores.cores_of(core)
        if any(t.pinned_within(full_core) for t in foreign) or busy_own(ctx, role, full_core) is not None:
            continue
        seen_here = sum(1 for t in foreign if t.last_cpu in full_core)
        ours = len(layout.co_runners(role, full_core))
        scored.append(((seen_here, ours, order), core))
    return [core for _, core in sorted(scored, key=lambda x: x[0])]


def busy_own(ctx: RuleContext, role: ThreadRole, core: frozenset[int]) -> Optional[tuple[ThreadRole, float]]:
    """The busiest role of ours, other than `role`, whose set overlaps `core` and that ran at
    least OWN_BUSY_PCT of the step per CPU of its set, with that figure; None when there is none.
    DataLoader workers do not count: a move makes them leave the core (runqueue's make-room),
    and while they share a hot thread's CPU they run niced."""
    best = None
    for other in ctx.layout.co_runners(role, core):
        if other is ThreadRole.DATALOADER:
            continue
        rw = ctx.stats.role(other)
        cpus = ctx.layout.cpus(other)
        if rw is None or rw.cpu_share_pct is None or not cpus:
            continue
        per_cpu = rw.cpu_share_pct / len(cpus)
        if per_cpu >= OWN_BUSY_PCT and (best is None or per_cpu > best[1]):
            best = (other, per_cpu)
    return best
