"""NCCL topology XML (NCCL_TOPO_FILE): GPU and NIC facts for clouds that hide the PCI tree.

<system><cpu numaid=".." affinity="hex mask"><pci busid=".." class="0x060400"> (a switch)
<pci busid=".." class="0x030200"/> (a GPU) <pci class="0x020700"/> (a NIC) ... Each device gets
its NUMA node and CPUs from its <cpu> element and its switches from the <pci> elements above it.
Read as NCCL reads it (NVIDIA/nccl v2.28.9-1, src/graph/topo.cc):
- A GPU is a <pci> with a <gpu> child that has a `rank` attribute (ncclTopoAddPci, topo.cc:440-447:
  xmlGetAttrIndex(xmlGpu, "rank") == -1 returns without a GPU). NCCL fills that child in for the
  GPUs its process really has (ncclTopoFillGpu), so a GPU-class <pci> without it only *places* a
  GPU that sysfs/NVML found; it never adds one (an added GPU would shift every GPU index).
- A <nic> may sit directly under a <cpu>, with only <net name=".."> inside (Azure NCv4's file;
  ncclTopoAddCpu, topo.cc:547-557): it names the NIC (an IB device or a netdev) and its node.
- A partial file may hold only bridges: <cpu numaid="0"><pci busid="0000:00:16.0"/> with no class,
  no affinity and nothing below (AWS g5.48xlarge). NCCL hangs the devices it finds in sysfs under
  the <pci> of their upstream bridge (ncclTopoGetXmlFromSys walks a device's sysfs parents and
  looks each busid up in the XML), and fills a missing affinity from the node's cpumap
  (src/graph/xml.cc:489). So devices under those bridges take that <cpu>'s node and CPUs.
- host_hash: a multi-host dump (MNNVL) marks every <cpu> with its host's hash (xml.cc:673/699,
  getHostHash of `$(hostname)$(cat /proc/sys/kernel/random/boot_id)`, or NCCL_HOSTID,
  src/misc/utils.cc:79-108, hashed by getHash, src/include/bitops.h). NCCL itself overwrites every
  host_hash with its own when it loads a file (topo.cc:1429-1436); placement keeps only this
  host's <cpu> elements of a file naming several hosts, else the first host's, with a warning.
"""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
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
    pci: Optional[str]  # None for a <nic> directly under a <cpu> (known by its net names only)
    kind: str  # "gpu" | "nic"
    cls: Optional[int]
    cpu_element: int  # which <cpu> it hangs under (position in the file)
    numa: Optional[int]
    cpus: frozenset[int]  # empty when the <cpu> has no affinity (then: the node's CPUs)
    switches: tuple[str, ...]  # bus ids of the <pci> elements above it, top first
    net_names: tuple[str, ...] = ()  # <net name=".."> under its <nic>
    ranked: bool = False  # a GPU with <gpu rank=..>: one NCCL counts even when sysfs lacks it

    @property
    def key(self) -> str:
        return self.pci if self.pci is not None else "net:" + ",".join(self.net_names)


@dataclass(frozen=True)
class XmlBridge:
    """A <pci> element that is neither GPU nor NIC: devices below it in sysfs hang under its <cpu>."""

    pci: str
    cpu_element: int
    numa: Optional[int]
    cpus: frozenset[int]


@dataclass
class NcclXml:
    devices: list[XmlDevice] = field(default_factory=list)
    bridges: list[XmlBridge] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


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


_MASK64 = (1 << 64) - 1


def nccl_hash(data: bytes) -> int:
    """NCCL's getHash (src/include/bitops.h, v2.28.9-1): two 64-bit accumulators eating 8-byte
    little-endian chunks."""
    acc0, acc1 = 1 ^ len(data), 1
    for pos in range(0, len(data), 8):
        acc0 = (acc0 + acc1) & _MASK64
        acc1 ^= acc0
        acc0 ^= acc0 >> 31
        acc0 = (acc0 * 0x9DE62BBC8CEF3CE3) & _MASK64
        acc1 ^= acc1 >> 32
        acc1 = (acc1 * 0x485CD6311B599E79) & _MASK64
        acc0 = (acc0 + int.from_bytes(data[pos:pos + 8], "little")) & _MASK64
    h = acc0
    h ^= h >> 31
    h = (h * 0xBAC3BD562846DE6B) & _MASK64
    h = (h + acc1) & _MASK64
    h ^= h >> 32
    return (h * 0x995A187A14E7B445) & _MASK64


def nccl_host_hash(root: str = "/", environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """This host's hash as NCCL computes it (getHostHashOnce, src/misc/utils.cc:79-108): NCCL_HOSTID
    when set (live system only), else hostname followed by the first word of boot_id, both read
    under `root`. None when the hostname cannot be read."""
    if os.path.realpath(root) == "/" and environ.get("NCCL_HOSTID"):
        return nccl_hash(environ["NCCL_HOSTID"].encode()[:1023])
    try:
        text = read_bounded(os.path.join(root, "proc/sys/kernel/hostname"), 4096)[:1024].split(b"\0")[0].strip()
    except OSError:
        return None
    try:
        words = read_bounded(os.path.join(root, "proc/sys/kernel/random/boot_id"), 4096)[:1024].split()
        text += words[0] if words else b""
    except OSError:
        pass  # NCCL falls back to the hostname alone
    return nccl_hash(text[:1023])


# Elements nested deeper than this are refused before the PCI walk recurses through them: a real
# dump nests a few PCI switches deep (system > cpu > pci ... > gpu), a file 5,000 deep would take
# the walk past Python's recursion limit.
XML_MAX_DEPTH = 64


def _depth(root: ET.Element) -> int:
    """How deep elements nest under `root` (root alone: 1), without recursion."""
    deepest, stack = 0, [(root, 1)]
    while stack:
        el, d = stack.pop()
        deepest = max(deepest, d)
        if d <= XML_MAX_DEPTH:  # no need to walk further down than the limit
            stack.extend((child, d + 1) for child in el)
    return deepest


def read_nccl_xml(path: str, host_hash: Optional[int] = None) -> NcclXml:
    """GPUs, NICs and bridges of an NCCL topology file. TopologyError (one line, naming the path)
    when the file cannot be read or is not such a file. host_hash: this host's (nccl_host_hash),
    to pick its own <cpu> elements out of a multi-host dump."""
    try:
        root = ET.fromstring(read_bounded(path, XML_MAX))  # bounded; a FIFO or device is refused
    except OSError as e:
        raise TopologyError(f"NCCL topology file {path}: {e.strerror or e}") from None
    except ET.ParseError as e:
        raise TopologyError(f"NCCL topology file {path}: malformed XML ({e})") from None
    if root.tag != "system":
        raise TopologyError(f"NCCL topology file {path}: root element is <{root.tag}>, expected <system>")
    if _depth(root) > XML_MAX_DEPTH:
        raise TopologyError(f"NCCL topology file {path}: elements nested more than {XML_MAX_DEPTH} deep; "
                            "valid: NCCL's topology dump (system > cpu > pci switches > pci > gpu/nic)")
    out = NcclXml()
    cpus_elements = list(root.iter("cpu"))
    for position, cpu in _this_hosts(path, cpus_elements, host_hash, out.warnings):
        numa = _int(cpu.get("numaid"), 10)
        affinity = cpu.get("affinity", "")
        try:
            cpus = parse_cpumask(affinity)
        except ValueError as e:
            shown = affinity if len(affinity) <= 40 else affinity[:40] + "..."
            raise TopologyError(f"NCCL topology file {path}: bad cpu affinity {shown!r} ({e}); "
                                "valid: a hex cpu mask such as ffff,ffffffff") from None
        for nic in cpu.findall("nic"):
            names = tuple(n.get("name") for n in nic.iter("net") if n.get("name"))
            if names:
                out.devices.append(XmlDevice(None, "nic", None, position, numa, cpus, (), names))

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
                    gpu = pci.find("gpu")
                    names = tuple(n.get("name") for n in pci.iter("net") if n.get("name"))
                    out.devices.append(XmlDevice(bdf, kind, cls, position, numa, cpus, switches, names,
                                                 ranked=gpu is not None and gpu.get("rank") is not None))
                else:
                    out.bridges.append(XmlBridge(bdf, position, numa, cpus))
                    walk(pci, switches + (bdf,))

        walk(cpu, ())
    return out


def _this_hosts(path: str, cpus: list[ET.Element], host_hash: Optional[int],
                warnings: list[str]) -> list[tuple[int, ET.Element]]:
    """The <cpu> elements of this host, with their positions in the file."""
    hashes = []
    for cpu in cpus:
        h = _int(cpu.get("host_hash"), 16) if cpu.get("host_hash") else None
        if h not in hashes:
            hashes.append(h)
    if len(hashes) <= 1:  # one host (or none marked): all of it, as NCCL takes it
        return list(enumerate(cpus))
    pick = host_hash if host_hash in hashes else hashes[0]
    if pick != host_hash:
        ours = "unknown" if host_hash is None else f"{host_hash:#x}"
        warnings.append(f"NCCL topology file {path} describes {len(hashes)} hosts "
                        f"({', '.join('unmarked' if h is None else f'{h:#x}' for h in hashes)}) and none is this "
                        f"host (host_hash {ours}: hostname + boot_id, which change per boot); using the first "
                        "host's elements")
    return [(i, cpu) for i, cpu in enumerate(cpus) if (_int(cpu.get("host_hash"), 16)
                                                       if cpu.get("host_hash") else None) == pick]


def xml_path_class(a: XmlDevice, b: XmlDevice) -> str:
    """PIX under the same switch, PXB under a shared upper switch, PHB through the same CPU,
    NODE across CPU elements of one NUMA node, SYS across NUMA nodes."""
    if a.cpu_element != b.cpu_element:
        return "NODE" if a.numa is not None and a.numa == b.numa else "SYS"
    if not a.switches or not b.switches or a.switches[0] != b.switches[0]:
        return "PHB"
    return "PIX" if a.switches == b.switches else "PXB"
