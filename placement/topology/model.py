"""The topology as data: schema `placement.topology/1` (docs/topology.md).

Group keys (package, die, cluster, core, compute_unit, l3, numa) are ids such that CPUs
with an equal key share that object; None where the machine has no such object or the
CPU is offline. Discovery chooses keys that are unique machine-wide (e.g. the lowest
CPU id of the group), so a key never needs its package to be told apart.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from placement.vocab import Vocabulary

SCHEMA = "placement.topology/1"

# GPU<->NIC PCI path classes, closest first (the `nvidia-smi topo -m` vocabulary).
PATH_CLASSES = ("PIX", "PXB", "PHB", "NODE", "SYS")


@dataclass
class Cpu:
    id: int
    online: bool = True
    allowed: bool = True
    package: Optional[int] = None
    die: Optional[int] = None
    cluster: Optional[int] = None
    core: Optional[int] = None
    # AMD family 15h: the two cores sharing one front end, L1i and L2 (each is a `core` of its own).
    compute_unit: Optional[int] = None
    l3: Optional[int] = None
    numa: Optional[int] = None
    max_khz: Optional[int] = None
    base_khz: Optional[int] = None
    highest_perf: Optional[int] = None
    prefcore_ranking: Optional[int] = None  # amd-pstate preferred-core ranking
    perf_rank: Optional[int] = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Cpu":
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__ if k in d})


class NodeKind(Vocabulary):
    """What a NUMA node is."""

    CPU = "cpu"  # it holds CPUs (their local memory)
    GPU = "gpu"  # a GPU's memory onlined as a node (Grace Hopper/Blackwell, POWER9+V100)
    MEMORY = "memory"  # a CPU-less memory tier (CXL, HBM, persistent memory, or an unknown one)


@dataclass
class NumaNode:
    id: int
    cpus: list[int] = field(default_factory=list)  # the CPUs the node holds (empty for a memory-only node)
    memory_bytes: Optional[int] = None
    distances: dict[int, int] = field(default_factory=dict)
    kind: NodeKind = NodeKind.CPU
    # The CPUs this node's memory belongs to (hwloc's NUMA node cpuset): its own CPUs, or for a
    # memory-only node those of the CPU nodes that reach it best (local_nodes). Empty: unknown.
    local_cpus: list[int] = field(default_factory=list)
    local_nodes: list[int] = field(default_factory=list)
    # How local_cpus were found. "cpus": its own CPUs; "initiators": the HMAT initiators (access1,
    # else access0); "distances": the nodes nearest by the distance table; "gpu": the local CPUs of
    # the GPU whose memory it is; None: unknown (the whole machine reaches it alike).
    locality: Optional[str] = None
    gpu: Optional[str] = None  # PCI bus id of the GPU whose memory a "gpu" node is

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "cpus": sorted(self.cpus), "memory_bytes": self.memory_bytes,
                "distances": {str(k): v for k, v in sorted(self.distances.items())},
                "kind": str(self.kind), "local_cpus": sorted(self.local_cpus), "local_nodes": sorted(self.local_nodes),
                "locality": self.locality, "gpu": self.gpu}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NumaNode":
        """Also reads documents written before kind/local_cpus/local_nodes/locality existed: a node
        then is "cpu" when it holds CPUs, else "memory", and belongs to its own CPUs."""
        cpus = list(d.get("cpus", []))
        return cls(id=d["id"], cpus=cpus, memory_bytes=d.get("memory_bytes"),
                   distances={int(k): v for k, v in (d.get("distances") or {}).items()},
                   kind=NodeKind(d.get("kind") or (NodeKind.CPU if cpus else NodeKind.MEMORY)),
                   local_cpus=list(d["local_cpus"] if "local_cpus" in d else cpus),
                   local_nodes=list(d["local_nodes"] if "local_nodes" in d else ([d["id"]] if cpus else [])),
                   locality=d["locality"] if "locality" in d else ("cpus" if cpus else None),
                   gpu=d.get("gpu"))


@dataclass
class Gpu:
    index: int
    pci: str  # domain:bus:device.function, lower case, e.g. "0000:18:00.0"
    numa: Optional[int] = None
    cpus: list[int] = field(default_factory=list)  # the GPU's local CPUs
    nics: list[str] = field(default_factory=list)  # closest NICs, names from Topology.nics
    uuid: Optional[str] = None
    name: Optional[str] = None
    # PCI path class to every NIC by name ("PIX" ... "SYS"), for the GPU x NIC matrix.
    nic_paths: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Gpu":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class Nic:
    name: str  # e.g. "mlx5_0"; a NIC known only from an NCCL XML is named by its PCI bus id
    pci: Optional[str] = None
    numa: Optional[int] = None
    netdevs: list[str] = field(default_factory=list)
    kind: Optional[str] = None  # "infiniband" | "ethernet" | None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Nic":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class KernelFacts:
    numa_balancing: Optional[int] = None
    governor: Optional[str] = None
    turbo: Optional[bool] = None
    membind_allowed: Optional[bool] = None  # probed on the live system only

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KernelFacts":
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__})


@dataclass
class Topology:
    root: str = "/"
    cpus: list[Cpu] = field(default_factory=list)
    numa_nodes: list[NumaNode] = field(default_factory=list)
    gpus: list[Gpu] = field(default_factory=list)
    nics: list[Nic] = field(default_factory=list)
    kernel: KernelFacts = field(default_factory=KernelFacts)
    # One line per fact that could not be read (file named); discovery still succeeded.
    warnings: list[str] = field(default_factory=list)

    # ---- serialisation -------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "root": self.root,
            "cpus": [asdict(c) for c in sorted(self.cpus, key=lambda c: c.id)],
            "numa_nodes": [n.to_dict() for n in sorted(self.numa_nodes, key=lambda n: n.id)],
            "gpus": [asdict(g) for g in self.gpus],
            "nics": [asdict(n) for n in self.nics],
            "kernel": asdict(self.kernel),
            "warnings": list(self.warnings),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Topology":
        return cls(
            root=d.get("root", "/"),
            cpus=[Cpu.from_dict(c) for c in d.get("cpus", [])],
            numa_nodes=[NumaNode.from_dict(n) for n in d.get("numa_nodes", [])],
            gpus=[Gpu.from_dict(g) for g in d.get("gpus", [])],
            nics=[Nic.from_dict(n) for n in d.get("nics", [])],
            kernel=KernelFacts.from_dict(d.get("kernel") or {}),
            warnings=list(d.get("warnings", [])),
        )

    # ---- sets (hwloc style: objects hold CPU sets) ----------------------
    def cpu(self, cpu_id: int) -> Cpu:
        for c in self.cpus:
            if c.id == cpu_id:
                return c
        raise KeyError(cpu_id)

    def usable(self) -> frozenset[int]:
        """Online and allowed CPUs: the only CPUs any plan may use."""
        return frozenset(c.id for c in self.cpus if c.online and c.allowed)

    def groups(self, key: str, within: frozenset[int] | None = None) -> dict[int, frozenset[int]]:
        """CPUs grouped by a key ("core", "compute_unit", "l3", "numa", "package", "cluster", "die").

        Only online CPUs with a non-null key; `within` restricts to a subset.
        """
        out: dict[int, set[int]] = {}
        for c in self.cpus:
            k = getattr(c, key)
            if not c.online or k is None or (within is not None and c.id not in within):
                continue
            out.setdefault(k, set()).add(c.id)
        return {k: frozenset(v) for k, v in out.items()}

    def node_cpus(self, node: int) -> frozenset[int]:
        for n in self.numa_nodes:
            if n.id == node:
                return frozenset(n.cpus)
        return frozenset()

    def gpu_by_pci(self, pci: str) -> Optional[Gpu]:
        pci = pci.lower()
        for g in self.gpus:
            if g.pci.lower() == pci:
                return g
        return None
