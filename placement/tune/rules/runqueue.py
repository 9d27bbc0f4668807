"""runqueue: a hot thread waits for its CPU. Find who shares its core and move one of them.

Our own co-runners are looked at first (another role of this rank busy on that core),
then anything else on that core as seen in /proc. Our own co-runner is moved away
when that is possible; else the hot thread moves to a free core of the rank's share.
"""
from __future__ import annotations

from typing import Optional

from placement.cpuset import format_cpulist
from placement.roles import HOT_ROLES, ThreadRole
from placement.tune.rules.base import Proposal, Rule, RuleContext, rounded
from placement.tune.rules.free import active_hot_roles, busy_own, free_cores

# A co-runner of ours is blamed only when it is on-CPU at least this fraction of the time
# the hot thread waited: a role that barely ran cannot have kept it waiting.
CO_RUNNER_MIN_FRACTION = 0.5


class RunqueueRule(Rule):
    name = "runqueue"

    def __init__(self) -> None:
        self._said_held: set[tuple[ThreadRole, frozenset[int]]] = set()  # (hot role, core) told once

    def propose(self, ctx: RuleContext) -> Optional[Proposal]:
        waiting = []
        for role in HOT_ROLES:
            rw = ctx.stats.role(role)
            if (rw is not None and ctx.layout.cpus(role) and rw.runq_share_pct is not None
                    and rw.runq_share_pct > ctx.cfg.runq_wait_pct):
                waiting.append((rw.runq_share_pct, role))
        if not waiting:
            return None
        wait_pct, hot = max(waiting)
        layout = ctx.layout
        hot_rw = ctx.stats.role(hot)
        ran_on = hot_rw.cpus & layout.cpus(hot) or layout.cpus(hot)
        core = layout.cores.cores_of(ran_on)
        evidence = {"role": hot.value, "runq_pct": rounded(wait_pct), "threshold_pct": ctx.cfg.runq_wait_pct,
                    "core": sorted(core), "window": [ctx.stats.first_step, ctx.stats.last_step]}

        own = self._own_co_runner(ctx, hot, core, wait_pct)
        if own is not None:
            other, busy_pct = own
            evidence["co_runner"] = {"role": other.value, "cpu_pct": rounded(busy_pct)}
            move = self._move_own(ctx, other, core)
            if move is not None:
                return Proposal(self.name, other, move,
                                f"{hot} waits {wait_pct:.0f}% of the step behind our {other} on core "
                                f"{format_cpulist(core)}: move {other} to {format_cpulist(move)}", evidence)

        # The /proc scan for foreign threads reads every thread of the machine (milliseconds on a
        # node of busy ranks): it is made only when a move can follow, after free_cores (which
        # scans only when the share has another core), not at every window in which the hot
        # thread waits with nowhere to go (a rank alone on its core).
        cores = free_cores(ctx, hot)
        if not cores:
            return self._held_by_own(ctx, hot, core, wait_pct, evidence)
        foreign = ctx.facts.foreign_threads(core)
        if foreign:
            evidence["foreign"] = _foreign_evidence(foreign, core)
        target = layout.shaped_like(hot, cores[0])
        cause = (f"foreign {foreign[0].name!r} (pid {foreign[0].pid})" if foreign
                 else "an unseen co-runner" if own is None else f"our {own[0]}")
        also = self._make_room(ctx, hot, target)
        room = "".join(f"; {role} makes room: {format_cpulist(layout.cpus(role))} -> {format_cpulist(cpus)}"
                       for role, cpus in also)
        return Proposal(self.name, hot, target,
                        f"{hot} waits {wait_pct:.0f}% of the step on core {format_cpulist(core)} behind "
                        f"{cause}: move it to free core {format_cpulist(target)}{room}", evidence, also)

    def _held_by_own(self, ctx: RuleContext, hot: ThreadRole, core: frozenset[int], wait_pct: float,
                     evidence: dict) -> Optional[Proposal]:
        """No free core because our own busy roles hold the others: said once per hot role and
        core, as a warning that moves nothing."""
        if (hot, core) in self._said_held:
            return None
        held = []
        for c in ctx.layout.candidate_cores(hot, active_hot_roles(ctx)):
            busy = busy_own(ctx, hot, ctx.layout.cores.cores_of(c))
            if busy is not None:
                held.append((c, busy))
        if not held:
            return None
        self._said_held.add((hot, core))
        foreign = ctx.facts.foreign_threads(core)
        if foreign:
            evidence["foreign"] = _foreign_evidence(foreign, core)
        where = ", ".join(f"{format_cpulist(c)} ({role} {pct:.0f}% per CPU)" for c, (role, pct) in held)
        evidence["held_by_own"] = [{"core": sorted(c), "role": role.value, "cpu_pct_per_cpu": rounded(pct)}
                                   for c, (role, pct) in held]
        return Proposal(self.name, None, None,
                        f"{hot} waits {wait_pct:.0f}% of the step on core {format_cpulist(core)}, and stays: the "
                        f"other cores of its share run our own busy threads: {where}; moved there, it would "
                        f"share a core with our own work",
                        evidence)

    @staticmethod
    def _make_room(ctx: RuleContext, hot: ThreadRole,
                   target: frozenset[int]) -> tuple[tuple[ThreadRole, frozenset[int]], ...]:
        """DataLoader workers on the target core leave it: to the rest of their set, or, with
        none left, to the cores the hot thread leaves (they share those with whatever drove it
        out, at their own nice, rather than make it wait again). `other` stays: its threads
        of this process take the GIL, and one descheduled behind a foreign hog while holding
        it stalls main; next to main it only runs when main would wait for the GIL anyway."""
        layout = ctx.layout
        core = layout.cores.cores_of(target)
        moves = []
        for other in layout.co_runners(hot, core):
            if other is not ThreadRole.DATALOADER:
                continue
            rest = layout.cpus(other) - core
            moves.append((other, rest or layout.cpus(hot) - core))
        return tuple((role, cpus) for role, cpus in moves if cpus)

    @staticmethod
    def _own_co_runner(ctx: RuleContext, hot: ThreadRole, core: frozenset[int],
                       wait_pct: float) -> Optional[tuple[ThreadRole, float]]:
        """The busiest other role of ours whose set overlaps the hot thread's core, if busy enough."""
        best = None
        for other in ctx.layout.co_runners(hot, core):
            rw = ctx.stats.role(other)
            busy = rw.cpu_share_pct if rw is not None else None
            if busy is None or busy < CO_RUNNER_MIN_FRACTION * wait_pct:
                continue
            if best is None or busy > best[1]:
                best = (other, busy)
        return best

    @staticmethod
    def _move_own(ctx: RuleContext, other: ThreadRole, core: frozenset[int]) -> Optional[frozenset[int]]:
        """Where our co-runner goes: its own set minus the hot core when that leaves CPUs,
        else a free core of its own; a background role with no free core left takes the
        cores no active hot role holds, foreign work there or not (it runs niced and yields,
        the hot thread must not share)."""
        rest = ctx.layout.cpus(other) - core
        if rest:
            return rest
        cores = free_cores(ctx, other)
        if cores:
            return ctx.layout.shaped_like(other, cores[0])
        if other in HOT_ROLES:
            return None
        spare = ctx.layout.candidate_cores(other, active_hot_roles(ctx))
        return frozenset().union(*spare) if spare else None


def _foreign_evidence(foreign: list, core: frozenset[int]) -> list[dict]:
    return [{"pid": t.pid, "tid": t.tid, "name": t.name, "pinned": t.pinned_within(core)} for t in foreign[:8]]
