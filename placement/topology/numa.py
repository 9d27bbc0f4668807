"""NUMA nodes: CPUs (CPU-less nodes too), memory and distance rows.

A distance row lists one value per online node in ascending id order (the kernel prints
it with for_each_online_node), so with sparse ids the columns are the sorted online
node list, not 0..n-1. A kernel without NUMA (no node/ directory) is one node 0 holding
every online CPU.
"""
from __future__ import annotations

import re
from typing import Optional

from placement.topology._sysfs import SysfsReader
from placement.topology.model import NumaNode

NODE_DIR = "sys/devices/system/node"
_NODE_NAME = re.compile(r"node(\d+)$")


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


def discover_nodes(fs: SysfsReader, online: frozenset[int]) -> list[NumaNode]:
    names = fs.listdir(NODE_DIR)
    ids = sorted(int(m.group(1)) for m in map(_NODE_NAME.match, names or []) if m)
    if not ids:
        return [NumaNode(id=0, cpus=sorted(online), memory_bytes=total_memory_bytes(fs), distances={0: 10})]
    listed_online = fs.cpus(f"{NODE_DIR}/online")
    columns = sorted(listed_online) if listed_online else ids
    nodes = []
    for n in ids:
        d = f"{NODE_DIR}/node{n}"
        cpus = fs.cpus(f"{d}/cpulist", f"{d}/cpumap")
        nodes.append(NumaNode(id=n, cpus=sorted((cpus or frozenset()) & online),
                              memory_bytes=node_memory_bytes(fs, n),
                              distances=node_distances(fs, n, columns)))
    return nodes


def cpu_to_node(nodes: list[NumaNode]) -> dict[int, int]:
    return {cpu: n.id for n in nodes for cpu in n.cpus}


def node_of_cpus(nodes: list[NumaNode], cpus: frozenset[int]) -> Optional[int]:
    """The one node whose CPUs meet `cpus` (a device's local CPUs); None if none or several."""
    touching = [n.id for n in nodes if cpus & frozenset(n.cpus)]
    return touching[0] if len(touching) == 1 else None
