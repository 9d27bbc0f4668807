"""Read-only discovery of CPUs, NUMA nodes, GPUs, NICs and kernel facts from a root dir."""
from placement.topology.model import Cpu, Gpu, KernelFacts, Nic, NumaNode, Topology, PATH_CLASSES, SCHEMA

__all__ = ["Cpu", "Gpu", "KernelFacts", "Nic", "NumaNode", "Topology", "PATH_CLASSES", "SCHEMA", "discover"]


def discover(root: str = "/", nccl_topo_file: str | None = None, live: bool | None = None) -> Topology:
    """Discover the topology under `root` (see placement.topology.discover)."""
    from placement.topology.discover import discover as _discover

    return _discover(root=root, nccl_topo_file=nccl_topo_file, live=live)
