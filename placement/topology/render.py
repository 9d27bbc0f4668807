"""The human view of a Topology: per NUMA node its CPUs, physical cores, fastest cores, memory
tiers, GPUs and NICs, then a GPU x NIC matrix in the `nvidia-smi topo -m` vocabulary."""
from __future__ import annotations

from placement.cpuset import format_cpulist
from placement.topology.model import NodeKind, NumaNode, Topology

_HOW = {"initiators": "HMAT initiators", "distances": "nearest by distance", "gpu": "the GPU's local CPUs"}

LEGEND = ("PIX = at most one PCIe switch between them, PXB = several PCIe switches, "
          "PHB = through a PCIe host bridge, NODE = across host bridges of one NUMA node, "
          "SYS = across NUMA nodes")


def _on_off(value) -> str:
    return "unknown" if value is None else ("on" if value else "off")


def _bytes(n) -> str:
    return "memory unknown" if n is None else f"{n / 2**30:.1f} GiB"


def _fastest(topo: Topology, cpus: frozenset[int]) -> str:
    ranked = [topo.cpu(c) for c in cpus if topo.cpu(c).perf_rank is not None]
    if not ranked:
        return "unknown"
    best = min(c.perf_rank for c in ranked)
    fastest = [c for c in ranked if c.perf_rank == best]
    if len(fastest) == len(ranked):
        return f"all equal (perf_rank {best})"
    ghz = {c.max_khz for c in fastest if c.max_khz}
    cores = {c.core for c in fastest}
    peak = f", {max(ghz) / 1e6:.2f} GHz" if ghz else ""
    return f"{format_cpulist(c.id for c in fastest)} ({len(cores)} cores, perf_rank {best}{peak})"


def _kind(node: NumaNode) -> str:
    return f"memory of GPU {node.gpu}" if node.kind == NodeKind.GPU else "memory-only tier"


def _tier_distance(node: NumaNode, topo: Topology) -> str:
    """The distance from the node(s) it belongs to (their own row, as numactl -H shows it)."""
    rows = {n.id: n.distances for n in topo.numa_nodes}
    seen = sorted({rows[h][node.id] for h in node.local_nodes if node.id in rows.get(h, {})})
    return "distance " + ("/".join(map(str, seen)) if seen else "unknown")


def _tier_lines(topo: Topology, node: NumaNode) -> list[str]:
    """Under a CPU node: the memory-only nodes that belong to its CPUs."""
    return [f"  tier      node {t.id}: {_kind(t)}, {_bytes(t.memory_bytes)}, {_tier_distance(t, topo)} "
            f"({_HOW.get(t.locality, 'unknown')})"
            for t in topo.numa_nodes if t.kind != NodeKind.CPU and t.memory_bytes != 0 and node.id in t.local_nodes]


def _memory_only_lines(topo: Topology, node: NumaNode) -> list[str]:
    if node.memory_bytes == 0:
        return ["  CPUs      none, and no memory: an empty node"]
    if not node.local_cpus:
        return [f"  CPUs      none: {_kind(node)}, no CPUs nearer than others (the whole machine reaches it alike)"]
    homes = ", ".join(map(str, node.local_nodes)) or "unknown"
    return [f"  CPUs      none: {_kind(node)}, belongs to node(s) {homes} (CPUs {format_cpulist(node.local_cpus)}), "
            f"{_tier_distance(node, topo)} ({_HOW.get(node.locality, 'unknown')})"]


def _node_cpu_lines(topo: Topology, cpus: frozenset[int], usable: frozenset[int]) -> list[str]:
    cores = topo.groups("core", within=cpus)
    threads = sorted({len(v) for v in cores.values()})
    allowed = "" if cpus <= usable else f"  (allowed: {format_cpulist(cpus & usable) or 'none'})"
    units = topo.groups("compute_unit", within=cpus)
    in_units = f" in {len(units)} AMD compute unit(s)" if units else ""
    return [f"  CPUs      {format_cpulist(cpus)}{allowed}",
            f"  cores     {len(cores)} physical{in_units}, {'/'.join(map(str, threads))} thread(s) each, "
            f"{len(topo.groups('l3', within=cpus))} L3 group(s)",
            f"  fastest   {_fastest(topo, cpus)}"]


def format_topology(topo: Topology) -> str:
    online = frozenset(c.id for c in topo.cpus if c.online)
    usable = topo.usable()
    k = topo.kernel
    lines = [f"topology of {topo.root}: {len(topo.numa_nodes)} NUMA node(s), {len(online)} CPUs online, "
             f"{len(usable)} allowed, {len(topo.gpus)} GPU(s), {len(topo.nics)} NIC(s)",
             f"kernel: numa_balancing={'unknown' if k.numa_balancing is None else k.numa_balancing} "
             f"governor={k.governor or 'unknown'} turbo={_on_off(k.turbo)} "
             f"membind={'unknown' if k.membind_allowed is None else ('allowed' if k.membind_allowed else 'refused')}"]
    known = {n.id: n for n in topo.numa_nodes}
    elsewhere = {d.numa for d in [*topo.gpus, *topo.nics] if d.numa is not None and d.numa not in known}
    for node_id in sorted(set(known) | elsewhere):
        node = known.get(node_id)
        if node is None:
            lines += ["", f"NUMA node {node_id}  (named by the NCCL topology file, not in this tree)"]
        else:
            lines += ["", f"NUMA node {node.id}  {_bytes(node.memory_bytes)}  distances "
                      + (",".join(str(v) for _, v in sorted(node.distances.items())) or "unknown")]
            if node.kind == NodeKind.CPU and node.cpus:
                lines += _node_cpu_lines(topo, frozenset(node.cpus), usable) + _tier_lines(topo, node)
            else:
                lines += _memory_only_lines(topo, node)
        gpus = [g for g in topo.gpus if g.numa == node_id]
        nics = [n for n in topo.nics if n.numa == node_id]
        lines.append("  GPUs      " + (", ".join(f"{g.index} ({g.pci})" for g in gpus) or "none"))
        lines.append("  NICs      " + (", ".join(f"{n.name} ({n.kind or 'unknown kind'}"
                                                  + (f", {'/'.join(n.netdevs)}" if n.netdevs else "") + ")"
                                                  for n in nics) or "none"))
    homeless = [f"GPU {g.index} ({g.pci})" for g in topo.gpus if g.numa is None]
    homeless += [n.name for n in topo.nics if n.numa is None]
    if homeless:
        lines += ["", "NUMA node unknown: " + ", ".join(homeless)]
    if topo.gpus and topo.nics:
        names = [n.name for n in topo.nics]
        width = max(6, *(len(n) for n in names))
        lines += ["", "GPU x NIC".ljust(10) + "".join(n.rjust(width + 2) for n in names)]
        for g in topo.gpus:
            row = "".join(g.nic_paths.get(n, "?").rjust(width + 2) for n in names)
            lines.append(f"GPU{g.index}".ljust(10) + row + f"   closest: {','.join(g.nics)}")
        lines += ["", LEGEND]
    return "\n".join(lines)
