"""NUMA nodes: the CPUs each holds, memory, distance rows, and where a memory-only node belongs.

A distance row lists one value per online node in ascending id order (the kernel prints it with
for_each_online_node), so with sparse ids the columns are the sorted online node list, not
0..n-1. A kernel without NUMA (no node/ directory) is one node 0 holding every online CPU.

Follows hwloc's reading (hwloc/topology-linux.c, `look_sysfsnode`):
- a node's CPUs are its `cpumap` (`cpulist` where the mask is missing);
- firmware that lists CPUs in several nodes (a known BIOS bug): a node whose CPUs meet those of
  an earlier node is ignored, with one warning; its CPUs stay with the first node listing them;
- a node whose memory belongs to a GPU (proc/driver/nvidia/gpus/<bus id>/numa_status names it)
  belongs to that GPU's local CPUs (kind "gpu"; hwloc drops such nodes on POWER, we keep and mark
  them so the planner can avoid them);
- any other CPU-less node (kind "memory": CXL, HBM, persistent memory) belongs to the CPUs of its
  HMAT initiators (`read_node_initiators`: access1/initiators, which leaves out generic
  initiators, else access0/initiators), else to the nodes strictly nearest to it by distance
  unless every other node is equally far (`fixup_cpuless_node_locality_from_distances`), else to
  no CPUs in particular (hwloc attaches it to the whole machine; our local_cpus stay empty).
CPU-less nodes are resolved in id order after the CPU nodes, each seeing those resolved before
it, as in hwloc. `cpus` stays the CPUs the node holds; where its memory belongs is `local_cpus`.
"""
from __future__ import annotations

import re
from typing import Optional

from placement.cpuset import format_cpulist
from placement.topology._sysfs import NODE_DIR, SysfsReader
from placement.topology.caches import read_set
from placement.topology.model import NodeKind, NumaNode

_NODE_NAME = re.compile(r"node(\d+)$")
NVIDIA_GPUS_DIR = "proc/driver/nvidia/gpus"


def node_memory_bytes(fs: SysfsReader, node: int) -> Optional[int]:
    rel = f"{NODE_DIR}/node{node}/meminfo"
    text = fs.text(rel)
    if text is None:
        return None
    for line in text.splitlines():
        # "Node 0 MemTotal:       131868528 kB"
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "MemTotal:":
            try:
                return int(parts[3]) * (1024 if parts[-1] == "kB" else 1)
            except ValueError:
                break
    fs.warn(rel, "no MemTotal line")
    return None


def node_distances(fs: SysfsReader, node: int, columns: list[int]) -> dict[int, int]:
    rel = f"{NODE_DIR}/node{node}/distance"
    text = fs.text(rel)
    if text is None:
        return {}
    try:
        row = [int(v) for v in text.split()]
    except ValueError:
        fs.warn(rel, f"not a distance row: {text[:40]!r}")
        return {}
    if len(row) != len(columns):
        fs.warn(rel, f"{len(row)} distances for {len(columns)} online nodes")
        return {}
    return dict(zip(columns, row))


def total_memory_bytes(fs: SysfsReader) -> Optional[int]:
    text = fs.text("proc/meminfo")
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "MemTotal:":
            try:
                return int(parts[1]) * 1024
            except ValueError:
                return None
    return None


def gpu_memory_nodes(fs: SysfsReader) -> dict[int, str]:
    """Node id -> PCI bus id of the NVIDIA GPU whose memory that node is (the driver's numa_status)."""
    out: dict[int, str] = {}
    for bdf in sorted(fs.listdir(NVIDIA_GPUS_DIR) or ()):
        text = fs.text(f"{NVIDIA_GPUS_DIR}/{bdf}/numa_status") or ""
        m = re.search(r"Node:\s*(-?\d+)", text)
        if m and int(m.group(1)) >= 0:
            out[int(m.group(1))] = bdf.lower()
    return out


def _initiators(fs: SysfsReader, node: int) -> Optional[set[int]]:
    """Initiator nodes other than itself from HMAT (access1 leaves out generic initiators); None
    when the kernel gives no access class at all."""
    for access in ("access1", "access0"):
        names = fs.listdir(f"{NODE_DIR}/node{node}/{access}/initiators")
        if names is not None:
            return {int(m.group(1)) for m in map(_NODE_NAME.match, names) if m} - {node}
    return None


def _nearest_by_distance(node: NumaNode, others: list[NumaNode]) -> list[NumaNode]:
    """The other nodes strictly nearest to `node`, unless all are equally far or none is nearer
    than the node to itself (hwloc's fixup_cpuless_node_locality_from_distances)."""
    row = node.distances
    known = [o for o in others if o.id in row]
    if not known or node.id not in row:
        return []
    near = min(row[o.id] for o in known)
    nearest = [o for o in known if row[o.id] == near]
    if near <= row[node.id] or len(nearest) == len(others):
        return []
    return nearest


def _place_memory_only(fs: SysfsReader, node: NumaNode, nodes: list[NumaNode], online: frozenset[int],
                       gpus: dict[int, str]) -> None:
    """Set kind, local_cpus, local_nodes and locality of a CPU-less node."""
    by_id = {n.id: n for n in nodes}

    def belong_to(sources: list[NumaNode], cpus: frozenset[int], how: str) -> None:
        node.local_cpus = sorted(cpus & online)
        node.local_nodes = sorted({m for s in sources for m in s.local_nodes})
        node.locality = how if node.local_cpus else None

    if node.id in gpus:
        node.kind, node.gpu = NodeKind.GPU, gpus[node.id]
        local = read_set(fs, f"sys/bus/pci/devices/{node.gpu}", ("local_cpus", "local_cpulist")) or frozenset()
        belong_to([n for n in nodes if n.cpus and local & frozenset(n.cpus)], local, "gpu")
        return
    node.kind = NodeKind.MEMORY
    initiators = _initiators(fs, node.id)
    sources = [by_id[i] for i in sorted(initiators or ()) if i in by_id]
    cpus = frozenset().union(*(s.local_cpus for s in sources))
    if cpus:
        belong_to(sources, cpus, "initiators")
        return
    nearest = _nearest_by_distance(node, [n for n in nodes if n.id != node.id])
    belong_to(nearest, frozenset().union(*(n.local_cpus for n in nearest)), "distances")


def discover_nodes(fs: SysfsReader, online: frozenset[int]) -> list[NumaNode]:
    names = fs.listdir(NODE_DIR)
    ids = sorted(int(m.group(1)) for m in map(_NODE_NAME.match, names or []) if m)
    if not ids:
        cpus = sorted(online)
        return [NumaNode(id=0, cpus=cpus, memory_bytes=total_memory_bytes(fs), distances={0: 10},
                         local_cpus=cpus, local_nodes=[0], locality="cpus")]
    listed_online = fs.cpus(f"{NODE_DIR}/online")
    columns = sorted(listed_online) if listed_online else ids
    nodes: list[NumaNode] = []
    held: frozenset[int] = frozenset()
    ignored: list[int] = []
    for n in ids:
        d = f"{NODE_DIR}/node{n}"
        listed = read_set(fs, d, ("cpumap", "cpulist"), empty_ok=True) or frozenset()
        if listed & held:
            ignored.append(n)
            continue
        held |= listed
        cpus = sorted(listed & online)
        nodes.append(NumaNode(id=n, cpus=cpus, memory_bytes=node_memory_bytes(fs, n),
                              distances=node_distances(fs, n, columns),
                              local_cpus=cpus, local_nodes=[n] if listed else [], locality="cpus" if listed else None))
    if ignored:
        fs.warn(NODE_DIR, f"node(s) {format_cpulist(ignored)} list CPUs an earlier node already holds "
                          "(overlapping node CPU lists, a firmware bug): ignored, as hwloc does")
        for node in nodes:
            node.distances = {k: v for k, v in node.distances.items() if k not in ignored}
    gpus = gpu_memory_nodes(fs) if any(not n.local_nodes for n in nodes) else {}
    for node in nodes:
        if not node.local_nodes:
            _place_memory_only(fs, node, nodes, online, gpus)
    return nodes


def cpu_to_node(nodes: list[NumaNode]) -> dict[int, int]:
    return {cpu: n.id for n in nodes for cpu in n.cpus}


def node_of_cpus(nodes: list[NumaNode], cpus: frozenset[int]) -> Optional[int]:
    """The one node whose CPUs meet `cpus` (a device's local CPUs); None if none or several."""
    touching = [n.id for n in nodes if cpus & frozenset(n.cpus)]
    return touching[0] if len(touching) == 1 else None
