"""The Plan as data: schema `placement.plan/1` (docs/design.md).

Per local rank: its GPU, NUMA node(s), memory policy, env to set, a CPU set per thread role
with a one-line reason, and the physical cores of its share with each CPU's perf_rank (what the
tuner moves roles between, so no worker needs the node's Topology). A plan of policy `none` has
no roles (no binding).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from placement.roles import ThreadRole

SCHEMA = "placement.plan/1"


@dataclass
class GpuRef:
    index: int
    pci: str


@dataclass
class MemoryPolicy:
    mode: str  # bind | preferred | interleave | none
    nodes: list[int] = field(default_factory=list)


@dataclass
class RoleAssignment:
    cpus: list[int]
    reason: str


@dataclass(frozen=True)
class PlannedCore:
    """One physical core of a rank's share: its usable hardware threads there (SMT siblings) and
    the perf_rank of each (0 = fastest; absent where the machine gives no speed evidence)."""
    cpus: frozenset[int]
    perf_rank: tuple[tuple[int, int], ...] = ()  # (cpu, perf_rank) pairs, in CPU order

    def to_dict(self) -> dict[str, Any]:
        return {"cpus": sorted(self.cpus), "perf_rank": {str(c): r for c, r in self.perf_rank}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PlannedCore":
        ranks = d.get("perf_rank") or {}
        return cls(frozenset(d["cpus"]), tuple(sorted((int(c), int(r)) for c, r in ranks.items())))


@dataclass
class RankPlan:
    local_rank: int
    gpu: Optional[GpuRef]
    numa: list[int]
    memory: MemoryPolicy
    env: dict[str, str] = field(default_factory=dict)
    roles: dict[ThreadRole, RoleAssignment] = field(default_factory=dict)
    # The physical cores of share() (plan/cores.py share_cores); empty when the plan was made
    # without a topology, and then every CPU counts as its own core of unknown speed.
    cores: list[PlannedCore] = field(default_factory=list)

    def share(self) -> frozenset[int]:
        """Every CPU this rank may use: the union of its role sets (the stage-1 process mask)."""
        out: set[int] = set()
        for a in self.roles.values():
            out.update(a.cpus)
        return frozenset(out)

    def cpus(self, role: ThreadRole) -> frozenset[int]:
        a = self.roles.get(role)
        return frozenset(a.cpus) if a else frozenset()

    def to_dict(self) -> dict[str, Any]:
        return {
            "local_rank": self.local_rank,
            "gpu": None if self.gpu is None else {"index": self.gpu.index, "pci": self.gpu.pci},
            "numa": list(self.numa),
            "memory": {"mode": str(self.memory.mode), "nodes": list(self.memory.nodes)},
            "env": dict(self.env),
            "roles": {r.value: {"cpus": sorted(a.cpus), "reason": a.reason}
                      for r, a in sorted(self.roles.items(), key=lambda kv: list(ThreadRole).index(kv[0]))},
            "cores": [c.to_dict() for c in self.cores],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RankPlan":
        gpu = d.get("gpu")
        return cls(
            local_rank=d["local_rank"],
            gpu=None if gpu is None else GpuRef(gpu["index"], gpu["pci"]),
            numa=list(d.get("numa", [])),
            memory=MemoryPolicy(d["memory"]["mode"], list(d["memory"].get("nodes", []))),
            env=dict(d.get("env", {})),
            roles={ThreadRole(r): RoleAssignment(list(a["cpus"]), a.get("reason", ""))
                   for r, a in (d.get("roles") or {}).items()},
            cores=[PlannedCore.from_dict(c) for c in d.get("cores") or []],
        )


@dataclass(frozen=True)
class Shortfall:
    """What a plan could not meet, and what the degraded plan it ran instead gives up (under
    placement.strict the problem is a PlanError instead)."""

    problem: str
    given_up: str

    def warning(self) -> str:
        return f"{self.problem}; degraded plan: {self.given_up}"

    def to_dict(self) -> dict[str, str]:
        return {"problem": self.problem, "given_up": self.given_up}


@dataclass
class Plan:
    policy: str
    ranks: list[RankPlan]
    warnings: list[str] = field(default_factory=list)  # every warning, the shortfall's included
    shortfall: Optional[Shortfall] = None  # the first shortfall the plan ran through

    def for_local_rank(self, local_rank: int) -> RankPlan:
        for r in self.ranks:
            if r.local_rank == local_rank:
                return r
        raise KeyError(f"plan has no local rank {local_rank} (ranks: {[r.local_rank for r in self.ranks]})")

    def to_dict(self) -> dict[str, Any]:
        out = {"schema": SCHEMA, "policy": str(self.policy), "warnings": list(self.warnings),
               "ranks": [r.to_dict() for r in self.ranks]}
        if self.shortfall is not None:
            out["shortfall"] = self.shortfall.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        if d.get("schema", SCHEMA) != SCHEMA:
            raise ValueError(f"plan schema {d.get('schema')!r} is not {SCHEMA!r}")
        short = d.get("shortfall")
        return cls(policy=d["policy"], ranks=[RankPlan.from_dict(r) for r in d["ranks"]],
                   warnings=list(d.get("warnings", [])),
                   shortfall=None if short is None else Shortfall(short["problem"], short["given_up"]))


@dataclass
class JobSpec:
    """What the planner must place on this node."""

    nproc_per_node: int
    # Physical GPU index (Topology.gpus[].index) per local rank, in local-rank order; None means
    # resolve from CUDA_VISIBLE_DEVICES (placement.topology.gpu_for_local_rank) or, with no GPU
    # in the topology, plan CPU-only ranks. An entry of None plans that rank CPU-only; an empty
    # list means the job sees no GPU at all (CPU training on a GPU machine).
    gpus: Optional[list[Optional[int]]] = None
    dataloader_workers: int = 2
    # Every GPU the job can see, in CUDA index order (CUDA_VISIBLE_DEVICES order); None = all GPUs
    # of the topology by index. Only the process-level policies `exclusive` and `core-complex`
    # need it: like torchrun, they divide a node among all visible GPUs on it, used or not.
    visible_gpus: Optional[list[int]] = None
    # torchrun's --numa-binding mode (node, socket, exclusive, core-complex) given to placerun with
    # policy `auto`: each rank's per-role plan is made inside the CPU set that mode gives it.
    within: Optional[str] = None
