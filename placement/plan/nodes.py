"""Which NUMA node each local rank's CPUs come from.

A GPU rank lives on its GPU's node. A CPU-only rank (or a GPU without a NUMA node) goes to the
node with the most free physical cores per rank so far, so ranks spread over nodes in proportion
to their cores. A node given more ranks than it has free physical cores hands the extra ranks to
the nearest node with room, so that no rank has to straddle two nodes.
"""
from __future__ import annotations

from placement.plan.context import PlanContext, RankSlot
from placement.plan.cores import Core
from placement.plan.gpus import gpu_node, unplaced_gpu_warning


def assign_nodes(ctx: PlanContext, slots: list[RankSlot], cores_by_node: dict[int, list[Core]],
                 *, relieve_crowded: bool) -> None:
    """Set slot.node and slot.why_node for every slot.

    relieve_crowded: move ranks off a node with fewer free physical cores than ranks (the `auto`
    and `exclusive` splits need a core per rank); the sharing policies keep the GPU's node.
    """
    room = {n: len(cs) for n, cs in cores_by_node.items() if cs}
    load = {n: 0 for n in room}
    pending: list[RankSlot] = []
    for s in slots:
        if s.node is not None:  # placed by the caller's own rule
            load[s.node] = load.get(s.node, 0) + 1
            continue
        home = gpu_node(ctx, s.gpu) if s.gpu is not None else None
        if s.gpu is not None and home is None and len(room) > 1:
            ctx.warn(unplaced_gpu_warning(ctx, s.gpu))
        if home is None:
            pending.append(s)
        elif home not in room:
            near = _nearest(ctx, home, room, load, need_room=False)
            ctx.warn(f"GPU {s.gpu.index}'s node {home} has no usable CPU (all reserved or outside the "
                     f"allowed set); local rank {s.local_rank} placed on node {near} "
                     f"(distance {ctx.node_distance(home, near)})")
            s.node, s.why_node = near, f"nearest node with CPUs to GPU {s.gpu.index}'s node {home}"
            load[near] += 1
        else:
            s.node, s.why_node = home, f"GPU {s.gpu.index}'s node"
            load[home] += 1
    for s in pending:
        best = min(room, key=lambda n: (-room[n] / (load[n] + 1), n))
        s.node = best
        how = "the only node with usable CPUs" if len(room) == 1 else "node with the most free cores per rank"
        s.why_node = (f"CPU-only rank, {how}" if s.gpu is None else f"GPU {s.gpu.index} has no NUMA node; {how}")
        load[best] += 1
    if not relieve_crowded:
        return
    for s in sorted(slots, key=lambda s: -s.local_rank):
        if load[s.node] <= room[s.node]:
            continue
        spare = {n: room[n] for n in room if load[n] < room[n]}
        if not spare:
            return  # every node is full: the split degrades to shared cores (warned there)
        near = _nearest(ctx, s.node, spare, load, need_room=True)
        ctx.warn(f"node {s.node} has {room[s.node]} free physical core(s) for {load[s.node]} ranks; "
                 f"local rank {s.local_rank} moved to node {near} (distance {ctx.node_distance(s.node, near)})")
        load[s.node] -= 1
        load[near] += 1
        s.why_node = f"moved from crowded node {s.node} ({s.why_node})"
        s.node = near


def _nearest(ctx: PlanContext, origin: int, candidates: dict[int, int], load: dict[int, int],
             *, need_room: bool) -> int:
    def key(n: int) -> tuple:
        return (ctx.node_distance(origin, n), load[n] / max(candidates[n], 1), n)

    return min((n for n in candidates if not need_room or load[n] < candidates[n]), key=key)
