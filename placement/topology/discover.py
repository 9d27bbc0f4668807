"""discover(root) -> Topology: one read-only pass over sysfs/procfs under `root`, plus NVML and
an NCCL topology XML when given. Per-file problems become Topology.warnings; only a root
that is not a sysfs tree, or an unusable XML file, raises TopologyError.
"""
from __future__ import annotations

import os
from typing import Optional

from placement.errors import TopologyError
from placement.topology._sysfs import SysfsReader
from placement.topology.cgroup import cgroup_cpus
from placement.topology.cpus import CPU_DIR, cpu_ids, discover_cpus
from placement.topology.gpus import nvml_gpus, sysfs_gpu_bdfs
from placement.topology.kernel import kernel_facts
from placement.topology.model import Gpu, Nic, NumaNode, Topology
from placement.topology.nccl_xml import NcclXml, XmlDevice, nccl_host_hash, read_nccl_xml, xml_path_class
from placement.topology.nics import discover_nics, natural_key
from placement.topology.numa import cpu_to_node, discover_nodes
from placement.topology.pci import BUS_DIR, PciDevice, device_at, path_class


def _check_root(root: str) -> None:
    if not os.path.exists(root):
        raise TopologyError(f"topology root {root} does not exist")
    if not os.path.isdir(root):
        raise TopologyError(f"topology root {root} is not a directory")
    if not os.path.isdir(os.path.join(root, CPU_DIR)):
        raise TopologyError(f"topology root {root} has no {CPU_DIR}: expected a tree holding sys/ and proc/, like /")


def _allowed(fs: SysfsReader, online: frozenset[int], live: bool) -> frozenset[int]:
    allowed = cgroup_cpus(fs)
    allowed = online if allowed is None else allowed & online
    if live:
        allowed &= frozenset(os.sched_getaffinity(0))
    return allowed


def _gpus(fs: SysfsReader, nodes: list[NumaNode], online: frozenset[int],
          live: bool) -> tuple[list[Gpu], dict[str, PciDevice]]:
    nvml = nvml_gpus() if live else None
    named = {g.pci: g for g in nvml} if nvml is not None else {}
    bdfs = list(named) if nvml is not None else sysfs_gpu_bdfs(fs)
    gpus, devices = [], {}
    for bdf in bdfs:
        dev = device_at(fs, f"{BUS_DIR}/{bdf}", nodes)
        gpu = Gpu(index=-1, pci=bdf, uuid=named[bdf].uuid if bdf in named else None,
                  name=named[bdf].name if bdf in named else None)
        if dev is not None:
            devices[bdf] = dev
            gpu.numa = dev.numa
            local = dev.local_cpus & online
            if not local and dev.numa is not None:
                local = frozenset(next(n.cpus for n in nodes if n.id == dev.numa))
            gpu.cpus = sorted(local)
        gpus.append(gpu)
    return gpus, devices


def _apply_xml(xml: NcclXml, gpus: list[Gpu], nics: list[Nic], devices: dict[str, PciDevice],
               nodes: list[NumaNode]) -> tuple[dict[str, XmlDevice], dict[str, XmlDevice]]:
    """The XML wins over sysfs for the devices it names or whose upstream bridge it places (see
    placement.topology.nccl_xml for NCCL's rules); NICs only it knows are added, GPUs only when
    NCCL would count them (<gpu rank>). Returns the XML entry placing each GPU (by PCI bus id)
    and each NIC (by name), for path classes."""
    node_cpus = {n.id: sorted(n.cpus) for n in nodes}
    gpu_by_pci = {g.pci: g for g in gpus}
    nic_by_pci = {n.pci: n for n in nics if n.pci}
    by_gpu: dict[str, XmlDevice] = {}
    by_nic: dict[str, XmlDevice] = {}

    def cpus_of(numa: Optional[int], cpus: frozenset[int]) -> list[int]:
        return sorted(cpus) if cpus else node_cpus.get(numa, []) if numa is not None else []

    for x in xml.devices:
        if x.kind == "gpu":
            gpu = gpu_by_pci.get(x.pci)
            if gpu is None:
                if not x.ranked:
                    continue  # NCCL ignores it; counting it would shift every GPU index
                gpu = gpu_by_pci[x.pci] = Gpu(index=-1, pci=x.pci)
                gpus.append(gpu)
            gpu.numa, gpu.cpus = x.numa, cpus_of(x.numa, x.cpus)
            by_gpu[gpu.pci] = x
            continue
        nic = nic_by_pci.get(x.pci) if x.pci else None
        if nic is None and x.net_names:
            nic = next((n for n in nics if n.name in x.net_names or set(n.netdevs) & set(x.net_names)), None)
        if nic is None:
            kind = {0x0207: "infiniband", 0x0200: "ethernet"}.get(x.cls >> 8 if x.cls is not None else -1)
            nic = Nic(name=x.pci or x.net_names[0], pci=x.pci, kind=kind)
            nics.append(nic)
            if x.pci:
                nic_by_pci[x.pci] = nic
        nic.numa = x.numa
        by_nic[nic.name] = x
    bridges = {b.pci: b for b in xml.bridges}
    for dev_pci, dev in devices.items():
        bridge = next((bridges[bdf] for bdf in reversed(dev.chain[:-1]) if bdf in bridges), None)
        if bridge is None:
            continue
        gpu = gpu_by_pci.get(dev_pci)
        if gpu is not None and gpu.pci not in by_gpu:
            gpu.numa, gpu.cpus = bridge.numa, cpus_of(bridge.numa, bridge.cpus)
        nic = nic_by_pci.get(dev_pci)
        if nic is not None and nic.name not in by_nic:
            nic.numa = bridge.numa
    return by_gpu, by_nic


def _link_gpus_to_nics(gpus: list[Gpu], nics: list[Nic], devices: dict[str, PciDevice],
                       xml_gpu: dict[str, XmlDevice], xml_nic: dict[str, XmlDevice]) -> None:
    """Gpu.nic_paths (path class to every NIC) and Gpu.nics: the NICs under its own switch (PIX),
    else under a shared upper switch (PXB), else on its NUMA node, else all."""
    for gpu in gpus:
        paths = {}
        for nic in nics:
            gx, nx = xml_gpu.get(gpu.pci), xml_nic.get(nic.name)
            if gx is not None and nx is not None:
                paths[nic.name] = xml_path_class(gx, nx)
            elif gx is None and nx is None and gpu.pci in devices and nic.pci in devices:
                paths[nic.name] = path_class(devices[gpu.pci], devices[nic.pci])
            else:
                paths[nic.name] = "NODE" if gpu.numa is not None and gpu.numa == nic.numa else "SYS"
        gpu.nic_paths = paths
        tiers = ([n for n, p in paths.items() if p == "PIX"], [n for n, p in paths.items() if p == "PXB"],
                 [n.name for n in nics if gpu.numa is not None and n.numa == gpu.numa], list(paths))
        gpu.nics = next((t for t in tiers if t), [])


def discover(root: str = "/", nccl_topo_file: Optional[str] = None, live: Optional[bool] = None) -> Topology:
    """The topology of the machine whose sys/ and proc/ lie under `root`.

    live (default: root is "/") adds what only the running system can tell: NVML GPUs,
    sched_getaffinity in `allowed`, and the membind probe.
    """
    _check_root(root)
    if live is None:
        live = os.path.realpath(root) == "/"
    xml = read_nccl_xml(nccl_topo_file, nccl_host_hash(root)) if nccl_topo_file else NcclXml()
    fs = SysfsReader(root)
    known, online = cpu_ids(fs)
    if not known:
        raise TopologyError(f"topology root {root} has no CPUs under {CPU_DIR}")
    nodes = discover_nodes(fs, online)
    cpus = discover_cpus(fs, known, online, cpu_to_node(nodes), _allowed(fs, online, live))
    nic_devices = discover_nics(fs, nodes)
    nics = [nic for nic, _ in nic_devices]
    gpus, devices = _gpus(fs, nodes, online, live)
    devices.update({dev.bdf: dev for _, dev in nic_devices})
    xml_gpu, xml_nic = _apply_xml(xml, gpus, nics, devices, nodes)
    nics.sort(key=lambda n: (n.kind != "infiniband", natural_key(n.name)))
    gpus.sort(key=lambda g: g.pci)
    for i, gpu in enumerate(gpus):
        gpu.index = i
    _link_gpus_to_nics(gpus, nics, devices, xml_gpu, xml_nic)
    kernel = kernel_facts(fs, online, live)
    return Topology(root=root, cpus=cpus, numa_nodes=nodes, gpus=gpus, nics=nics, kernel=kernel,
                    warnings=fs.warnings + xml.warnings)

