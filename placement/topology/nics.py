"""Network adapters backed by a PCI device: class/infiniband/* (RDMA devices, named like
mlx5_0) and class/net/* (netdevs; one whose PCI device has no RDMA device is a NIC of its
own, named after the netdev). Virtual devices (lo, bridges, veth) have no PCI device and
are left out.
"""
from __future__ import annotations

import re
from typing import Optional

from placement.topology._sysfs import SysfsReader
from placement.topology.model import Nic, NumaNode
from placement.topology.pci import PciDevice, device_at

_DIGITS = re.compile(r"(\d+)")
ARPHRD_ETHER = 1
ARPHRD_INFINIBAND = 32


def natural_key(name: str) -> list:
    """mlx5_2 before mlx5_10."""
    return [int(p) if p.isdigit() else p for p in _DIGITS.split(name)]


def _kind_of_netdev(fs: SysfsReader, netdev: str, dev: PciDevice) -> Optional[str]:
    link_type = fs.integer(f"sys/class/net/{netdev}/type")
    if link_type == ARPHRD_INFINIBAND or (dev.cls is not None and dev.cls >> 8 == 0x0207):
        return "infiniband"
    if link_type == ARPHRD_ETHER or (dev.cls is not None and dev.cls >> 8 == 0x0200):
        return "ethernet"
    return None


def discover_nics(fs: SysfsReader, nodes: list[NumaNode]) -> list[tuple[Nic, PciDevice]]:
    by_pci: dict[str, tuple[Nic, PciDevice]] = {}
    for name in sorted(fs.listdir("sys/class/infiniband") or [], key=natural_key):
        dev = device_at(fs, f"sys/class/infiniband/{name}/device", nodes)
        if dev is not None and dev.bdf not in by_pci:
            by_pci[dev.bdf] = (Nic(name=name, pci=dev.bdf, numa=dev.numa, kind="infiniband"), dev)
    for netdev in sorted(fs.listdir("sys/class/net") or [], key=natural_key):
        dev = device_at(fs, f"sys/class/net/{netdev}/device", nodes)
        if dev is None:
            continue
        if dev.bdf in by_pci:
            by_pci[dev.bdf][0].netdevs.append(netdev)
        else:
            nic = Nic(name=netdev, pci=dev.bdf, numa=dev.numa, netdevs=[netdev],
                      kind=_kind_of_netdev(fs, netdev, dev))
            by_pci[dev.bdf] = (nic, dev)
    return list(by_pci.values())
