"""Where each role of one rank may run now, and the cores the tuner may move them to.

Pure set algebra on frozensets of CPU ids. The bounds are the rank's share of the
plan (the union of its role sets, within the usable CPUs of the cores the plan lists):
every set the tuner proposes is a subset of them, so a rank never leaves its NUMA share
nor takes CPUs given to another rank. The cores and their perf_rank come from the plan
(RankPlan.cores), the roles' current sets from the binder that owns them: no topology here.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Optional

from placement.plan.model import RankPlan
from placement.roles import HOT_ROLES, ThreadRole


@dataclass(frozen=True)
class CoreMap:
    """Physical cores (sets of SMT siblings) and per-CPU perf_rank (0 = fastest)."""

    cores: tuple[frozenset[int], ...]
    perf_rank: dict[int, int] = field(default_factory=dict)

    @classmethod
    def from_plan(cls, rank_plan: RankPlan) -> "CoreMap":
        """The cores of the rank's share as the plan lists them; a plan without cores (made
        without a topology) counts every CPU of the share as its own core of unknown speed."""
        if not rank_plan.cores:
            return cls(tuple(frozenset({c}) for c in sorted(rank_plan.share())))
        cores = [c.cpus for c in rank_plan.cores if c.cpus]
        ranks = {cpu: rank for c in rank_plan.cores for cpu, rank in c.perf_rank}
        return cls(tuple(sorted(cores, key=min)), ranks)

    @property
    def cpus(self) -> frozenset[int]:
        return frozenset().union(*self.cores) if self.cores else frozenset()

    def core_of(self, cpu: int) -> frozenset[int]:
        for core in self.cores:
            if cpu in core:
                return core
        return frozenset({cpu})

    def cores_of(self, cpus: Iterable[int]) -> frozenset[int]:
        """Every CPU of every core that holds one of `cpus`."""
        out: frozenset[int] = frozenset()
        for c in cpus:
            out |= self.core_of(c)
        return out

    def rank_of(self, cpus: Iterable[int]) -> Optional[int]:
        """Best (lowest) perf_rank among `cpus`; None when unknown."""
        ranks = [self.perf_rank[c] for c in cpus if c in self.perf_rank]
        return min(ranks) if ranks else None


@dataclass(frozen=True)
class RoleLayout:
    roles: dict[ThreadRole, frozenset[int]]
    bounds: frozenset[int]
    cores: CoreMap

    @classmethod
    def from_plan(cls, rank_plan: RankPlan) -> "RoleLayout":
        """The plan's own role sets on the plan's cores (where a rank starts)."""
        return cls.of({role: frozenset(a.cpus) for role, a in rank_plan.roles.items()}, CoreMap.from_plan(rank_plan))

    @classmethod
    def of(cls, roles: Mapping[ThreadRole, frozenset[int]], cores: CoreMap) -> "RoleLayout":
        """`roles` (each role's set now: the binder's) cut to the share the cores span."""
        bounds = cores.cpus
        cut = {role: frozenset(cpus) & bounds for role, cpus in roles.items()}
        return cls({r: c for r, c in cut.items() if c}, bounds, cores)

    def cpus(self, role: ThreadRole) -> frozenset[int]:
        return self.roles.get(role, frozenset())

    def with_role(self, role: ThreadRole, cpus: frozenset[int]) -> "RoleLayout":
        if not cpus or not cpus <= self.bounds:
            raise ValueError(f"cpus {sorted(cpus)} for role {role} are not a non-empty subset of the "
                             f"rank's share {sorted(self.bounds)}")
        return replace(self, roles={**self.roles, role: frozenset(cpus)})

    def hot_cpus(self, excluding: Optional[ThreadRole] = None,
                 active: Optional[Iterable[ThreadRole]] = None) -> frozenset[int]:
        """CPUs held by hot roles (main, nccl, pin_memory), optionally leaving one out, and
        only those in `active` when given (a role with no live thread holds no core)."""
        out: frozenset[int] = frozenset()
        roles = HOT_ROLES if active is None else [r for r in HOT_ROLES if r in set(active)]
        for role in roles:
            if role != excluding:
                out |= self.cpus(role)
        return out

    def co_runners(self, role: ThreadRole, where: frozenset[int]) -> list[ThreadRole]:
        """Other roles whose CPU set overlaps `where` (the cores a role runs on)."""
        return [r for r, cpus in self.roles.items() if r != role and cpus & where]

    def candidate_cores(self, role: ThreadRole, active: Optional[Iterable[ThreadRole]] = None) -> list[frozenset[int]]:
        """Cores of the share, each cut to the share, that hold no other (active) hot role and
        are not where `role` is now; fastest perf_rank first, then lowest CPU id."""
        taken = self.cores.cores_of(self.hot_cpus(excluding=role, active=active) | self.cpus(role))
        out = []
        for core in self.cores.cores:
            inside = core & self.bounds
            if inside and not core & taken:
                out.append(inside)
        rank = self.cores.rank_of
        return sorted(out, key=lambda c: (rank(c) if rank(c) is not None else 0, min(c)))

    def shaped_like(self, role: ThreadRole, core: frozenset[int]) -> frozenset[int]:
        """The CPUs of `core` a role moved there gets: the whole core when the role holds
        whole cores now, else as many CPUs as it holds now (fastest, lowest id first)."""
        now = self.cpus(role)
        if now and now == self.cores.cores_of(now) & self.bounds:
            return core
        want = max(1, len(now))
        rank = self.cores.perf_rank
        return frozenset(sorted(core, key=lambda c: (rank.get(c, 0), c))[:want])
