"""Test doubles for the tuner's unit tests: synthetic step records, a binder that records
what it was asked (the real RoleBinder is exercised by tests/tune/test_tune_e2e.py), fixed host
facts, and an in-memory event log."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

from placement.bind.affinity import BindResult
from placement.config import TuneConfig
from placement.records.step import RoleSample, StepRecord
from placement.plan.cores import share_cores
from placement.plan.model import MemoryPolicy, RankPlan, RoleAssignment
from placement.roles import ThreadInfo, ThreadRole
from placement.topology.model import Cpu, NumaNode, Topology
from placement.tune.facts import ForeignThread


def topology(n_cpus: int, perf_rank: Optional[dict[int, int]] = None, smt: bool = False) -> Topology:
    """One NUMA node; with smt, CPU i and i + n/2 are siblings of one core."""
    half = n_cpus // 2
    cpus = [Cpu(id=i, package=0, core=(i % half if smt else i), l3=0, numa=0,
                perf_rank=(perf_rank or {}).get(i, 0)) for i in range(n_cpus)]
    return Topology(cpus=cpus, numa_nodes=[NumaNode(0, list(range(n_cpus)))])


def rank_plan(roles: dict[str, list[int]], memory: str = "bind", topo: Optional[Topology] = None) -> RankPlan:
    """A rank's plan; with `topo`, the cores of its share as the planner lists them (RankPlan.cores)."""
    plan = RankPlan(local_rank=0, gpu=None, numa=[0], memory=MemoryPolicy(memory, [0]),
                    roles={ThreadRole(r): RoleAssignment(list(c), "test") for r, c in roles.items()})
    if topo is not None:
        plan.cores = share_cores(topo, plan.share())
    return plan


def record(step: int, step_ms: float = 10.0, *, data_ms: float = 0.0, comm_ms: float = 0.0,
           roles: Optional[dict[str, dict[str, Any]]] = None) -> StepRecord:
    return StepRecord(rank=0, step=step, t=float(step), step_ms=step_ms, data_ms=data_ms, comm_ms=comm_ms,
                      roles={name: RoleSample(**{"threads": 1, **fields}) for name, fields in (roles or {}).items()})


def window(n: int, start: int = 0, *, step_ms: float = 10.0, jitter: float = 0.0, seed: int = 0,
           **kw: Any) -> list[StepRecord]:
    """n records; role figures given as fractions of step time are scaled per step."""
    rng = random.Random(seed + start)
    out = []
    for i in range(n):
        ms = step_ms * (1.0 + rng.uniform(-jitter, jitter))
        roles = {name: {k: (v * ms if k in ("cpu_ms", "runq_ms") else v) for k, v in f.items()}
                 for name, f in (kw.get("roles") or {}).items()}
        out.append(record(start + i, ms, data_ms=kw.get("data_frac", 0.0) * ms,
                          comm_ms=kw.get("comm_frac", 0.0) * ms, roles=roles))
    return out


@dataclass
class FakeFacts:
    foreign: list[ForeignThread] = field(default_factory=list)
    mhz: dict[int, float] = field(default_factory=dict)
    balancing: Optional[int] = 0
    counters: list[dict[str, int]] = field(default_factory=list)  # one per call, last repeats
    policy: Optional[str] = "bind"
    foreign_calls: int = 0

    def foreign_threads(self, cpus: frozenset[int]) -> list[ForeignThread]:
        self.foreign_calls += 1
        return [t for t in self.foreign if t.last_cpu in cpus or t.pinned_within(cpus)]

    def cpu_mhz(self, cpu: int) -> Optional[float]:
        return self.mhz.get(cpu)

    def numa_balancing(self) -> Optional[int]:
        return self.balancing

    def numa_counters(self) -> dict[str, int]:
        if not self.counters:
            return {}
        return self.counters.pop(0) if len(self.counters) > 1 else self.counters[0]

    def memory_policy(self) -> Optional[str]:
        return self.policy


def hog(cpu: int, pid: int = 4242) -> ForeignThread:
    return ForeignThread(pid=pid, tid=pid, name="hog", last_cpu=cpu, affinity=frozenset({cpu}))


class FakeBinder:
    """Records set_role_cpus calls; every live thread of the role 'moves' (ok). Owns each role's
    set as RoleBinder does: the plan's (`rank_plan`, set before use), then what it was asked."""

    def __init__(self, threads: Optional[list[ThreadInfo]] = None, refuse: bool = False,
                 rank_plan: Optional[RankPlan] = None):
        self.calls: list[tuple[ThreadRole, frozenset[int], str]] = []
        self._threads = threads or [ThreadInfo(1, 1, "python", ThreadRole.MAIN)]
        self.refuse = refuse
        self.rank_plan = rank_plan
        self._moved: dict[ThreadRole, frozenset[int]] = {}

    def role_cpus(self, role: ThreadRole) -> frozenset[int]:
        return self._moved[role] if role in self._moved else self.rank_plan.cpus(role)

    def set_role_cpus(self, role: ThreadRole, cpus, reason: str) -> list[BindResult]:
        cpus = frozenset(cpus)
        self.calls.append((role, cpus, reason))
        self._moved[role] = cpus
        return [BindResult(t.pid, t.tid, t.name, role, cpus, frozenset() if self.refuse else cpus,
                           not self.refuse, "EINVAL refused" if self.refuse else None)
                for t in self._threads if t.role is role]

    def threads(self) -> list[ThreadInfo]:
        return list(self._threads)


class ListEvents:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        rec = {"type": kind, **fields}
        self.records.append(rec)
        return rec

    def of(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        return [r for r in self.records if r["type"] == kind and all(r.get(k) == v for k, v in match.items())]


def tune_cfg(**kw: Any) -> TuneConfig:
    # window_min_s 0: these runs are counted in windows of `window` steps of a few ms each;
    # windows paced in time have tests of their own (test_tune_window.py)
    base = dict(window=10, window_min_s=0.0, cooldown_windows=1, max_backoff_windows=16, background_nice=0)
    base.update(kw)
    return TuneConfig(**base)
