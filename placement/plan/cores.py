"""Physical cores as the planner sees them: the usable hardware threads of each core, with the
groups (NUMA node, L3, cluster) and speed evidence the placement rules need.

Group ids are the lowest online CPU id of the group, the same representative torch's
--numa-binding uses (min of thread_siblings_list / of the last-level cache's shared_cpu_list),
so orderings here match torch's where the policies must.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from placement.config import SmtMode
from placement.plan.model import PlannedCore
from placement.topology.model import Topology

# perf_rank of a core without speed evidence: after every ranked core.
_UNRANKED = 1 << 30


@dataclass(frozen=True)
class Core:
    key: int  # lowest online thread id of the core
    cpus: frozenset[int]  # its usable threads (online, allowed, not reserved)
    threads: frozenset[int]  # all its online threads
    node: int
    l3: int  # lowest online CPU id of its L3 group (its own key when the L3 is unknown)
    cluster: int  # lowest online CPU id of its cluster group (its L3 when unknown)
    perf: int  # best perf_rank among its usable threads; _UNRANKED without evidence
    # The speed evidence of that thread, in perf_rank's order (CPPC highest_perf, amd-pstate
    # prefcore ranking, max kHz, base kHz); None where unknown. Says how much faster, not only which.
    peak: tuple[Optional[int], ...] = ()
    # AMD family 15h: the compute unit whose front end, L1i and L2 it shares with its twin core
    # (lowest online CPU id of the unit); its own key on every other machine.
    compute_unit: int = -1

    @property
    def whole(self) -> bool:
        """No thread of the core is reserved or outside the allowed set (no housekeeping sibling)."""
        return self.cpus == self.threads

    @property
    def compact_order(self) -> tuple[int, int, int]:
        """Sort key that keeps L3 groups, then clusters, together."""
        return (self.l3, self.cluster, self.key)

    def hot_order(self, prefer_fast: bool) -> tuple:
        """Sort key for hot roles: whole cores first, then (when asked) lowest perf_rank."""
        return (not self.whole, self.perf if prefer_fast else 0) + self.compact_order

    def use(self, smt: SmtMode) -> frozenset[int]:
        """The threads a role placed on this core gets: the first thread only when SMT is avoided."""
        return self.cpus if smt == SmtMode.USE else frozenset({min(self.cpus)})

    def gain_over(self, other: "Core") -> Optional[float]:
        """How much faster this core is expected to run one thread than `other`, as a fraction
        (0.1 = 10%), on the first kind of evidence both have and that differs; 0.0 when all
        they share is equal; None when they share no evidence."""
        shared = [(a, b) for a, b in zip(self.peak, other.peak) if a is not None and b is not None and b > 0]
        for a, b in shared:
            if a != b:
                return a / b - 1.0
        return 0.0 if shared else None

    def describe_perf(self) -> str:
        return "perf_rank unknown" if self.perf == _UNRANKED else f"perf_rank {self.perf}"


def _group_min(topo: Topology, key: str) -> dict[int, int]:
    """CPU id -> lowest online CPU id sharing its `key` group."""
    out: dict[int, int] = {}
    for members in topo.groups(key).values():
        low = min(members)
        for cpu in members:
            out[cpu] = low
    return out


def cpu_node(topo: Topology) -> dict[int, int]:
    """CPU id -> NUMA node id, from the CPU's own key or else the node lists (a kernel without
    NUMA is one node 0)."""
    out = {c.id: c.numa for c in topo.cpus if c.numa is not None}
    for n in topo.numa_nodes:
        for cpu in n.cpus:
            out.setdefault(cpu, n.id)
    for c in topo.cpus:
        out.setdefault(c.id, 0)
    return out


def physical_cores(topo: Topology, usable: frozenset[int]) -> list[Core]:
    """Every physical core holding at least one usable CPU, in compact order."""
    core_of = _group_min(topo, "core")
    l3_of = _group_min(topo, "l3")
    cluster_of = _group_min(topo, "cluster")
    unit_of = _group_min(topo, "compute_unit")
    node_of = cpu_node(topo)
    by_id = {c.id: c for c in topo.cpus}
    threads: dict[int, set[int]] = {}
    for c in topo.cpus:
        if c.online:
            threads.setdefault(core_of.get(c.id, c.id), set()).add(c.id)
    cores = []
    for key, members in threads.items():
        mine = frozenset(members) & usable
        if not mine:
            continue
        ranks = [by_id[c].perf_rank for c in mine if by_id[c].perf_rank is not None]
        best = by_id[min(mine, key=lambda c: (by_id[c].perf_rank is None, by_id[c].perf_rank or 0, c))]
        l3 = l3_of.get(key, key)
        cores.append(Core(
            key=key, cpus=mine, threads=frozenset(members), node=node_of[key],
            l3=l3, cluster=cluster_of.get(key, l3),
            perf=min(ranks) if ranks else _UNRANKED,
            peak=(best.highest_perf, best.prefcore_ranking, best.max_khz, best.base_khz),
            compute_unit=unit_of.get(key, key),
        ))
    return sorted(cores, key=lambda c: c.compact_order)


def threads_of(cores: list[Core] | tuple[Core, ...], smt: SmtMode) -> frozenset[int]:
    out: frozenset[int] = frozenset()
    for c in cores:
        out |= c.use(smt)
    return out


def share_cores(topo: Topology, share: frozenset[int]) -> list[PlannedCore]:
    """The physical cores of a rank's share, cut to its usable CPUs, each CPU with its perf_rank:
    what RankPlan.cores hands the tuner. Without CPUs in the topology, every CPU is its own core."""
    if not topo.cpus:
        return [PlannedCore(frozenset({c})) for c in sorted(share)]
    by_id = {c.id: c for c in topo.cpus}
    return [PlannedCore(core.cpus, tuple((c, by_id[c].perf_rank) for c in sorted(core.cpus)
                                         if by_id[c].perf_rank is not None))
            for core in physical_cores(topo, frozenset(share) & topo.usable())]
