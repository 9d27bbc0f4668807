"""NCCL topology XML (NCCL_TOPO_FILE): GPU and NIC facts for clouds that hide the PCI tree.

<system><cpu numaid=".." affinity="hex mask"><pci busid=".." class="0x060400"> (a switch)
<pci busid=".." class="0x030200"/> (a GPU) <pci class="0x020700"/> (a NIC) ... Each device gets its NUMA node and CPUs from its <cpu>
element and its switches from the <pci> elements above it.
"""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Mapping, Optional

from placement._procfs import read_bounded
from placement.cpuset import parse_cpumask
from placement.errors import TopologyError
from placement.topology.pci import PCI_ADDRESS, normalize_bdf

XML_MAX = 16 * 1024 * 1024  # NCCL's own topology dumps are a few KiB; a larger file is refused


def topo_file_for(root: str, *given: Optional[str], environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The NCCL topology XML to read: the first file given, else $NCCL_TOPO_FILE, but only for
    the live system (a gathered tree is another machine: this one's env says nothing of it)."""
    for path in given:
        if path:
            return path
    if os.path.realpath(root) == "/":
        return environ.get("NCCL_TOPO_FILE") or None
    return None


@dataclass(frozen=True)
class XmlDevice:
    pci: str
    kind: str  # "gpu" | "nic"
    cls: Optional[int]
    cpu_element: int  # which <cpu> it hangs under (position in the file)
    numa: Optional[int]
    cpus: frozenset[int]
    switches: tuple[str, ...]  # bus ids of the <pci> elements above it, top first


def _int(text: Optional[str], base: int) -> Optional[int]:
    try:
        return int(text, base) if text is not None else None
    except ValueError:
        return None


def _kind(el: ET.Element, cls: Optional[int]) -> Optional[str]:
    if el.find("gpu") is not None or (cls is not None and cls >> 8 in (0x0300, 0x0302)):
        return "gpu"
    if el.find("nic") is not None or (cls is not None and cls >> 16 == 0x02):
        return "nic"
    return None


def read_nccl_xml(path: str) -> list[XmlDevice]:
    """GPUs and NICs of an NCCL topology file. TopologyError (one line, naming the path) when the
    file cannot be read or is not such a file."""
    try:
        root = ET.fromstring(read_bounded(path, XML_MAX))  # bounded; a FIFO or device is refused
    except OSError as e:
        raise TopologyError(f"NCCL topology file {path}: {e.strerror or e}") from None
    except ET.ParseError as e:
        raise TopologyError(f"NCCL topology file {path}: malformed XML ({e})") from None
    if root.tag != "system":
        raise TopologyError(f"NCCL topology file {path}: root element is <{root.tag}>, expected <system>")
    devices: list[XmlDevice] = []
    for position, cpu in enumerate(root.iter("cpu")):
        numa = _int(cpu.get("numaid"), 10)
        affinity = cpu.get("affinity", "")
        try:
            cpus = parse_cpumask(affinity)
        except ValueError as e:
            shown = affinity if len(affinity) <= 40 else affinity[:40] + "..."
            raise TopologyError(f"NCCL topology file {path}: bad cpu affinity {shown!r} ({e}); "
                                "valid: a hex cpu mask such as ffff,ffffffff") from None

        def walk(el: ET.Element, switches: tuple[str, ...]) -> None:
            for pci in el.findall("pci"):
                busid = pci.get("busid")
                if busid is None:
                    continue
                bdf = normalize_bdf(busid)
                if not PCI_ADDRESS.match(bdf):
                    shown = busid if len(busid) <= 40 else busid[:40] + "..."
                    raise TopologyError(f"NCCL topology file {path}: busid {shown!r} is not a PCI address; "
                                        "valid: DDDD:BB:DD.F, e.g. 0000:18:00.0")
                cls = _int(pci.get("class"), 16)
                kind = _kind(pci, cls)
                if kind is not None:
                    devices.append(XmlDevice(bdf, kind, cls, position, numa, cpus, switches))
                else:
                    walk(pci, switches + (bdf,))

        walk(cpu, ())
    return devices


def xml_path_class(a: XmlDevice, b: XmlDevice) -> str:
    """PIX under the same switch, PXB under a shared upper switch, PHB through the same CPU,
    NODE across CPU elements of one NUMA node, SYS across NUMA nodes."""
    if a.cpu_element != b.cpu_element:
        return "NODE" if a.numa is not None and a.numa == b.numa else "SYS"
    if not a.switches or not b.switches or a.switches[0] != b.switches[0]:
        return "PHB"
    return "PIX" if a.switches == b.switches else "PXB"
