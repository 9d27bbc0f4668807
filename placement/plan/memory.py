"""The memory policy of a rank: the configured mode over the rank's node(s).

Only nodes that hold CPUs are chosen for a rank's memory. A memory-only node (a GPU's memory on
Grace Hopper, a CXL or HBM tier; Topology NumaNode.kind) is never picked as a stand-in: it may be
nearer by distance than the other socket's DRAM, but binding there is a choice the user makes.
"""
from __future__ import annotations

from placement.config import MemoryMode
from placement.plan.context import PlanContext
from placement.plan.model import MemoryPolicy
from placement.topology.model import NodeKind


def _package_of_node(ctx: PlanContext, node: int):
    cpus = [c for c in ctx.topo.cpus if c.online and c.numa == node]
    return min(cpus, key=lambda c: c.id).package if cpus else None


def _has_memory(ctx: PlanContext, node: int) -> bool:
    for n in ctx.topo.numa_nodes:
        if n.id == node:
            return n.memory_bytes != 0  # None: unknown, assume it has memory
    return True


def _holds_cpus(ctx: PlanContext, node: int) -> bool:
    return any(n.id == node and n.kind == NodeKind.CPU for n in ctx.topo.numa_nodes)


def memory_policy(ctx: PlanContext, nodes: list[int]) -> MemoryPolicy:
    """`bind`/`preferred` to the given nodes, `interleave` over every node of their package(s)
    (the design's "two nodes of one package"), `none` for no policy. Memory-less nodes are
    replaced by the nearest node that holds CPUs and has memory; without one, no policy."""
    mode = ctx.cfg.memory
    if mode == MemoryMode.NONE or not nodes:
        return MemoryPolicy(MemoryMode.NONE, [])
    if ctx.topo.kernel.membind_allowed is False and mode == MemoryMode.BIND:
        ctx.warn("this container refuses membind (probed at discovery): memory bind will step down "
                 "to preferred when applied")
    chosen = set(nodes)
    if mode == MemoryMode.INTERLEAVE:
        packages = {_package_of_node(ctx, n) for n in nodes} - {None}
        chosen |= {n.id for n in ctx.topo.numa_nodes if _package_of_node(ctx, n.id) in packages}
    with_memory = {n for n in chosen if _has_memory(ctx, n)}
    if not with_memory:
        candidates = [n.id for n in ctx.topo.numa_nodes if _holds_cpus(ctx, n.id) and _has_memory(ctx, n.id)]
        if not candidates:
            ctx.warn(f"node(s) {', '.join(map(str, sorted(chosen)))} have no memory and no other node with "
                     f"CPUs has any (memory-only nodes are not chosen for a rank); no memory policy")
            return MemoryPolicy(MemoryMode.NONE, [])
        origin = min(nodes)
        near = min(candidates, key=lambda n: (ctx.node_distance(origin, n), n))
        ctx.warn(f"node(s) {', '.join(map(str, sorted(chosen)))} have no memory; "
                 f"memory {mode} uses the nearest node with CPUs and memory, {near}")
        with_memory = {near}
    return MemoryPolicy(mode, sorted(with_memory))
