"""Read-only discovery of CPUs, NUMA nodes, GPUs, NICs and kernel facts from a root dir."""
from placement.topology.discover import discover
from placement.topology.gpus import gpu_for_local_rank
from placement.topology.model import Cpu, Gpu, KernelFacts, Nic, NumaNode, Topology, PATH_CLASSES, SCHEMA

__all__ = ["Cpu", "Gpu", "KernelFacts", "Nic", "NumaNode", "Topology", "PATH_CLASSES", "SCHEMA", "discover",
           "gpu_for_local_rank"]
