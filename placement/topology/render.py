"""The human view of a Topology: per NUMA node its CPUs, physical cores, fastest cores, GPUs and
NICs, then a GPU x NIC matrix in the `nvidia-smi topo -m` vocabulary."""
from __future__ import annotations

from placement.cpuset import format_cpulist
from placement.topology.model import Topology

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


def _node_cpu_lines(topo: Topology, cpus: frozenset[int], usable: frozenset[int]) -> list[str]:
    if not cpus:
        return ["  CPUs      none (memory only)"]
    cores = topo.groups("core", within=cpus)
    threads = sorted({len(v) for v in cores.values()})
    allowed = "" if cpus <= usable else f"  (allowed: {format_cpulist(cpus & usable) or 'none'})"
    return [f"  CPUs      {format_cpulist(cpus)}{allowed}",
            f"  cores     {len(cores)} physical, {'/'.join(map(str, threads))} thread(s) each, "
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
            lines += _node_cpu_lines(topo, frozenset(node.cpus), usable)
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
