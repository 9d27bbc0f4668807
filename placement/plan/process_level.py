"""Policies `node`, `socket`, `exclusive`, `core-complex`: one CPU set for the whole process,
computed exactly as torchrun --numa-binding (torch/numa/binding.py) computes it, so the two can
be compared like for like. Every role gets that set.

torch's rules, restated over the Topology:
- the GPU's node is its PCI numa_node, -1 read as node 0;
- node: the node's allowed CPUs; socket: the allowed CPUs of every node whose lowest allowed
  CPU sits in the package of the GPU node's lowest allowed CPU;
- exclusive: the node's physical cores (ordered by lowest sibling id) cut into equal slices,
  one per visible GPU on that node in CUDA index order, the first ones one core larger;
- core-complex: the node's last-level-cache groups ordered by (-allowed CPUs, lowest id);
  the k-th visible GPU on the node takes group k modulo the number of groups.
Differences, by design: reserved_cpus are removed first; a rank without GPU (CPU training)
takes a node by balance and counts as one more participant on it; torch would fail there.
"""
from __future__ import annotations

from placement.cpuset import format_cpulist
from placement.config import Policy
from placement.plan.context import PlanContext, RankSlot
from placement.plan.cores import Core, physical_cores
from placement.plan.gpus import visible_gpus
from placement.plan.memory import memory_policy
from placement.plan.model import GpuRef, JobSpec, RankPlan, RoleAssignment
from placement.plan.nodes import assign_nodes
from placement.roles import ThreadRole
from placement.topology.model import Gpu


def plan_process_level(ctx: PlanContext, slots: list[RankSlot], job: JobSpec) -> list[RankPlan]:
    cores = physical_cores(ctx.topo, ctx.usable)
    by_node: dict[int, list[Core]] = {}
    for c in cores:
        by_node.setdefault(c.node, []).append(c)
    fallback = min(by_node)

    def torch_node(g: Gpu) -> int:
        # torch reads numa_node -1 as node 0, without looking at the GPU's local CPUs.
        n = 0 if g.numa is None else g.numa
        if n in by_node:
            return n
        ctx.warn(f"GPU {g.index}'s node {n} has no usable CPU (all reserved or outside the allowed set); "
                 f"its rank uses node {fallback}")
        return fallback

    for s in slots:
        if s.gpu is not None:
            s.node = torch_node(s.gpu)
            s.why_node = f"GPU {s.gpu.index}'s node"
    assign_nodes(ctx, slots, by_node, relieve_crowded=False)
    visible = visible_gpus(ctx.topo, job)
    policy = ctx.cfg.policy
    out = []
    for s in slots:
        node_cpus = _cpus(by_node[s.node])
        if policy == Policy.NODE:
            cpus = node_cpus
            why = f"all usable CPUs of node {s.node}, {s.why_node}"
        elif policy == Policy.SOCKET:
            cpus, why = _socket(ctx, s, by_node)
        else:
            gpu_peers = [g.index for g in visible if torch_node(g) == s.node]
            if s.gpu is not None and s.gpu.index not in gpu_peers:
                gpu_peers.append(s.gpu.index)
            cpu_peers = [t.local_rank for t in slots if t.gpu is None and t.node == s.node]
            count = len(gpu_peers) + len(cpu_peers)
            slot_index = (gpu_peers.index(s.gpu.index) if s.gpu is not None
                          else len(gpu_peers) + cpu_peers.index(s.local_rank))
            peers = (f"{count} participant(s) on node {s.node}: GPUs {gpu_peers}" if not cpu_peers else
                     f"{count} participant(s) on node {s.node}: GPUs {gpu_peers}, CPU-only ranks {cpu_peers}")
            if policy == Policy.EXCLUSIVE:
                cpus, why = _exclusive(ctx, s, by_node[s.node], slot_index, count, peers)
            else:
                cpus, why = _core_complex(ctx, s, by_node[s.node], slot_index, count, peers)
        reason = f"policy {policy} (as torchrun --numa-binding={policy}): {why}"
        nodes = sorted({c.node for c in cores if c.cpus & cpus})
        out.append(RankPlan(
            local_rank=s.local_rank,
            gpu=None if s.gpu is None else GpuRef(s.gpu.index, s.gpu.pci),
            numa=nodes,
            memory=memory_policy(ctx, nodes),
            env={},
            roles={role: RoleAssignment(sorted(cpus), reason) for role in ThreadRole},
        ))
    return out


def _cpus(cores: list[Core]) -> frozenset[int]:
    out: frozenset[int] = frozenset()
    for c in cores:
        out |= c.cpus
    return out


def _socket(ctx: PlanContext, s: RankSlot, by_node: dict[int, list[Core]]) -> tuple[frozenset[int], str]:
    by_id = {c.id: c for c in ctx.topo.cpus}

    def package(node: int):
        return by_id[min(_cpus(by_node[node]))].package

    pkg = package(s.node)
    nodes = sorted(n for n in by_node if package(n) == pkg)
    cpus = frozenset().union(*(_cpus(by_node[n]) for n in nodes))
    return cpus, f"usable CPUs of node(s) {', '.join(map(str, nodes))} in package {pkg} of node {s.node}, {s.why_node}"


def _exclusive(ctx: PlanContext, s: RankSlot, node_cores: list[Core], index: int, count: int,
               peers: str) -> tuple[frozenset[int], str]:
    ordered = sorted(node_cores, key=lambda c: c.key)
    base, extra = divmod(len(ordered), count)
    if base < 1:
        ctx.shortfall(f"policy exclusive: node {s.node} has {len(ordered)} physical core(s) for {count} "
                      f"GPUs/ranks ({peers})",
                      f"local rank {s.local_rank} shares a core with other ranks")
        core = ordered[index % len(ordered)]
        return core.cpus, f"core {core.key} of node {s.node}, shared: too few cores for {peers}"
    start = index * base + min(index, extra)
    mine = ordered[start:start + base + (1 if index < extra else 0)]
    cpus = _cpus(mine)
    return cpus, (f"slice {index + 1} of {count} of node {s.node}'s {len(ordered)} physical cores "
                  f"({len(mine)} cores: CPUs {format_cpulist(cpus)}); {peers}")


def _core_complex(ctx: PlanContext, s: RankSlot, node_cores: list[Core], index: int, count: int,
                  peers: str) -> tuple[frozenset[int], str]:
    groups: dict[int, frozenset[int]] = {}
    for c in node_cores:
        groups[c.l3] = groups.get(c.l3, frozenset()) | c.cpus
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    if count > len(ordered):
        ctx.warn(f"policy core-complex: node {s.node} has {len(ordered)} L3 group(s) for {count} "
                 f"GPUs/ranks; ranks share L3 groups (torchrun's rule: index modulo groups)")
    key, cpus = ordered[index % len(ordered)]
    return cpus, (f"L3 group {index % len(ordered) + 1} of {len(ordered)} on node {s.node} (lowest CPU {key}, "
                  f"{len(cpus)} usable CPUs); {peers}")
