"""What every policy needs while planning: the usable CPUs, the knobs, and the warnings so far.

A shortfall is raised as PlanError under `strict`, else recorded as a warning that says what
the degraded plan gives up; either way the caller continues only in the degraded case.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from placement.config import PlacementConfig
from placement.cpuset import format_cpulist, parse_cpulist
from placement.errors import PlanError
from placement.plan.model import Shortfall
from placement.topology.model import Gpu, Topology


@dataclass
class RankSlot:
    """One local rank on its way through the planner."""

    local_rank: int
    gpu: Optional[Gpu]
    node: Optional[int] = None  # the node its share comes from (None until placed)
    why_node: str = ""  # how that node was chosen, for the reasons
    nic: Optional[str] = None  # the GPU's closest NIC, when known
    nic_node: Optional[int] = None  # that NIC's node when it differs from the GPU's node


@dataclass
class PlanContext:
    topo: Topology
    cfg: PlacementConfig
    reserved: frozenset[int] = frozenset()
    usable: frozenset[int] = frozenset()
    warnings: list[str] = field(default_factory=list)
    shortfalls: list[Shortfall] = field(default_factory=list)

    @classmethod
    def create(cls, topo: Topology, cfg: PlacementConfig) -> "PlanContext":
        reserved = parse_cpulist(cfg.reserved_cpus)
        ctx = cls(topo=topo, cfg=cfg, reserved=reserved, usable=topo.usable() - reserved)
        unknown = reserved - frozenset(c.id for c in topo.cpus)
        if unknown:
            ctx.warn(f"placement.reserved_cpus names CPUs {format_cpulist(unknown)} that this machine "
                     f"does not have (CPUs {format_cpulist(c.id for c in topo.cpus)}); ignored")
        return ctx

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def shortfall(self, problem: str, given_up: str) -> None:
        """Raise PlanError for `problem` under strict; else warn that the plan gives up `given_up`."""
        if self.cfg.strict:
            raise PlanError(f"{problem}; set placement.strict=false to run a degraded plan")
        s = Shortfall(problem, given_up)
        self.shortfalls.append(s)
        self.warn(s.warning())

    def node_distance(self, a: int, b: int) -> int:
        if a == b:
            return 10
        for n in self.topo.numa_nodes:
            if n.id == a and b in n.distances:
                return n.distances[b]
        return 1 << 20  # unknown distance: after every known one
