"""PCI devices from sysfs: address, class, NUMA node, local CPUs and place in the PCI tree, and the
GPU<->NIC path class (`nvidia-smi topo -m` vocabulary) from two devices' shared ancestors.

A device's real sysfs path (sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0/...) is its
ancestry: the host bridge, then every bridge down to the device.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from placement.topology._sysfs import SysfsReader
from placement.topology.model import NumaNode
from placement.topology.numa import node_of_cpus

BUS_DIR = "sys/bus/pci/devices"
PCI_ADDRESS = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_HOST_BRIDGE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")


def normalize_bdf(bdf: str) -> str:
    """Lower case with a 4-digit domain: NVML's "00000000:18:00.0" -> "0000:18:00.0"."""
    bdf = bdf.strip().lower()
    domain, sep, rest = bdf.partition(":")
    if sep and len(domain) > 4:
        domain = domain[-4:] if domain[:-4].strip("0") == "" else domain
    return f"{domain.rjust(4, '0')}:{rest}" if sep else bdf


@dataclass(frozen=True)
class PciDevice:
    bdf: str
    host_bridge: Optional[str]  # "pci0000:17"; None when the tree hides it
    chain: tuple[str, ...]  # BDFs from the root port down to this device, itself last
    cls: Optional[int] = None  # 24-bit class code, e.g. 0x030200
    numa: Optional[int] = None  # numa_node, or resolved through local_cpulist when it says -1
    local_cpus: frozenset[int] = field(default_factory=frozenset)


def device_at(fs: SysfsReader, rel: str, nodes: list[NumaNode]) -> Optional[PciDevice]:
    """The PCI device whose sysfs directory `rel` is (or links to); None if it is not a PCI device."""
    real = fs.resolve(rel)
    if real is None:
        return None
    parts = real.split("/")
    chain = tuple(p for p in parts if PCI_ADDRESS.match(p))
    if not chain or not PCI_ADDRESS.match(parts[-1]):
        return None
    host = next((p for p in parts if _HOST_BRIDGE.match(p)), None)
    cls = fs.integer(f"{real}/class", 16)
    local = fs.cpus(f"{real}/local_cpulist", f"{real}/local_cpus") or frozenset()
    numa = fs.integer(f"{real}/numa_node")
    known = {n.id for n in nodes}
    if numa is None or numa < 0 or numa not in known:
        numa = node_of_cpus(nodes, local) if local else (nodes[0].id if len(nodes) == 1 else None)
    return PciDevice(bdf=normalize_bdf(chain[-1]), host_bridge=host, chain=tuple(map(normalize_bdf, chain)),
                     cls=cls, numa=numa, local_cpus=local)


def path_class(a: PciDevice, b: PciDevice) -> str:
    """PIX: at most one PCIe switch between them; PXB: several switches, no host bridge;
    PHB: through their common host bridge; NODE: across host bridges of one NUMA node;
    SYS: across NUMA nodes."""
    if a.host_bridge is None or a.host_bridge != b.host_bridge:
        return "NODE" if a.numa is not None and a.numa == b.numa else "SYS"
    shared = 0
    for x, y in zip(a.chain[:-1], b.chain[:-1]):
        if x != y:
            break
        shared += 1
    if shared == 0:
        return "PHB"
    # Below the deepest shared bridge each device sits behind at most a switch's downstream port.
    if len(a.chain) - shared <= 2 and len(b.chain) - shared <= 2:
        return "PIX"
    return "PXB"
