"""Which GPU each local rank drives, which NUMA node that GPU hangs off, and where its NIC is."""
from __future__ import annotations

from collections import Counter
from typing import Optional

from placement.cpuset import format_cpulist
from placement.errors import PlanError
from placement.plan.context import PlanContext, RankSlot
from placement.plan.model import JobSpec
from placement.topology.model import Gpu, Topology


def describe_gpus(topo: Topology) -> str:
    if not topo.gpus:
        return "no GPU found"
    return ", ".join(f"{g.index} ({g.pci})" for g in sorted(topo.gpus, key=lambda g: g.index))


def visible_gpus(topo: Topology, job: JobSpec) -> list[Gpu]:
    """The GPUs the job can see, in CUDA index order."""
    by_index = {g.index: g for g in topo.gpus}
    if job.visible_gpus is not None:
        return [by_index[i] for i in job.visible_gpus if i in by_index]
    if job.gpus is not None:
        # Without the full visible list, the ranks' own GPUs are what is known to be visible.
        return [by_index[i] for i in dict.fromkeys(job.gpus) if i is not None and i in by_index]
    return sorted(topo.gpus, key=lambda g: g.index)


def rank_slots(ctx: PlanContext, job: JobSpec) -> list[RankSlot]:
    """One slot per local rank with its GPU (None: CPU-only rank).

    A GPU index the topology lacks is always an error (it is a wrong value, not a shortfall);
    more ranks than GPUs is a shortfall (degraded: the extra ranks run CPU-only).
    """
    topo = ctx.topo
    n = job.nproc_per_node
    by_index = {g.index: g for g in topo.gpus}
    if job.gpus is not None:
        for rank, index in enumerate(job.gpus[:n]):
            if index is not None and index not in by_index:
                raise PlanError(f"GPU index {index} for local rank {rank} is not on this machine; "
                                f"GPUs: {describe_gpus(topo)}")
        chosen: list[Optional[Gpu]] = [None if i is None else by_index[i] for i in job.gpus[:n]]
        if not job.gpus:
            return [RankSlot(r, None) for r in range(n)]
    else:
        chosen = sorted(topo.gpus, key=lambda g: g.index)[:n]
        if not topo.gpus:
            return [RankSlot(r, None) for r in range(n)]
    if len(chosen) < n:
        extra = f"{len(chosen)}-{n - 1}" if n - len(chosen) > 1 else str(len(chosen))
        ctx.shortfall(f"nproc_per_node={n} but only {len(chosen)} GPU(s) are visible: {describe_gpus(topo)} "
                      "(for CPU-only ranks set CUDA_VISIBLE_DEVICES=)",
                      f"local rank(s) {extra} get no GPU and are planned as CPU-only ranks")
        chosen = chosen + [None] * (n - len(chosen))
    shared = [i for i, c in Counter(g.index for g in chosen if g is not None).items() if c > 1]
    if shared:
        ctx.warn(f"GPU(s) {', '.join(map(str, sorted(shared)))} are driven by more than one local rank")
    return [RankSlot(r, g) for r, g in enumerate(chosen)]


def gpu_node(ctx: PlanContext, gpu: Gpu) -> Optional[int]:
    """The GPU's NUMA node; when the firmware reports none (numa_node -1), the node holding most
    of the GPU's local CPUs, else None (the caller places the rank by balance)."""
    node_ids = {n.id for n in ctx.topo.numa_nodes}
    if gpu.numa is not None and (gpu.numa in node_ids or not node_ids):
        return gpu.numa
    local = frozenset(gpu.cpus) & ctx.usable
    if local:
        counts = Counter(n.id for n in ctx.topo.numa_nodes for _ in frozenset(n.cpus) & local)
        if counts:
            return min(counts, key=lambda k: (-counts[k], k))
    return None


def attach_nics(ctx: PlanContext, slot: RankSlot) -> None:
    """Record the GPU's closest NIC, and that NIC's node when it is not the GPU's node."""
    gpu = slot.gpu
    if gpu is None or not gpu.nics:
        return
    nics = {n.name: n for n in ctx.topo.nics}
    closest = [nics[name] for name in gpu.nics if name in nics]
    if not closest:
        slot.nic = gpu.nics[0]
        return
    local = [n for n in closest if n.numa == slot.node]
    chosen = local[0] if local else closest[0]
    slot.nic = chosen.name
    if chosen.numa is not None and chosen.numa != slot.node:
        slot.nic_node = chosen.numa


def unplaced_gpu_warning(ctx: PlanContext, gpu: Gpu) -> str:
    local = format_cpulist(gpu.cpus) or "none"
    return (f"GPU {gpu.index} ({gpu.pci}) reports no NUMA node (numa_node -1) and its local CPUs "
            f"({local}) are not usable; its rank is placed by balance")
