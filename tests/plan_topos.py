"""Topology objects built directly from machine shapes, for the planner's tests.

Used where a shape is needed that the sysfs fixtures (tests/sysfs_builder.py) do not have, and
to test make_plan without discovery. CPU numbering follows Linux on x86: first hardware thread
of every core first (0..cores-1 across packages), then the SMT siblings.
"""
from __future__ import annotations

from typing import Callable, Optional

from placement.topology.model import Cpu, Gpu, KernelFacts, Nic, NumaNode, Topology


def synth(*, packages: int = 1, nodes_per_package: int = 1, cores_per_node: int = 8, smt: int = 1,
          l3_per_node: int = 1, clusters_per_l3: int = 1, gpu_nodes: tuple[int, ...] = (),
          nic_nodes: Optional[tuple[int, ...]] = None, perf: Optional[Callable[[int], int]] = None,
          allowed: Optional[frozenset[int]] = None, offline: frozenset[int] = frozenset(),
          node_memory: Optional[dict[int, int]] = None, gpu_numa_unknown: bool = False) -> Topology:
    """perf: core index (0-based, machine-wide) -> perf_rank, with max_khz 100 MHz lower per rank
    below 3 GHz (the magnitude the L3 rule weighs). gpu_nodes: the node of each GPU.
    nic_nodes: the node of each GPU's closest NIC (default: the GPU's own node)."""
    nodes = packages * nodes_per_package
    cores = nodes * cores_per_node
    cpus: list[Cpu] = []
    per_l3 = cores_per_node // l3_per_node
    per_cluster = max(per_l3 // clusters_per_l3, 1)
    for t in range(smt):
        for core in range(cores):
            cid = t * cores + core
            node = core // cores_per_node
            in_node = core % cores_per_node
            l3 = node * cores_per_node + (in_node // per_l3) * per_l3
            cluster = l3 + ((in_node % per_l3) // per_cluster) * per_cluster
            online = cid not in offline
            cpus.append(Cpu(
                id=cid, online=online, allowed=online and (allowed is None or cid in allowed),
                package=node // nodes_per_package if online else None, die=None,
                cluster=cluster if online else None, core=core if online else None,
                l3=l3 if online else None, numa=node if online else None,
                max_khz=3_000_000 - 100_000 * (perf(core) if perf else 0),
                perf_rank=(perf(core) if perf else 0) if online else None,
            ))
    numa_nodes = []
    for n in range(nodes):
        dist = {m: 10 if m == n else (12 if m // nodes_per_package == n // nodes_per_package else 21)
                for m in range(nodes)}
        numa_nodes.append(NumaNode(id=n, cpus=sorted(c.id for c in cpus if c.numa == n),
                                   memory_bytes=(node_memory or {}).get(n, 1 << 36), distances=dist))
    gpus, nics = [], []
    for i, node in enumerate(gpu_nodes):
        nic_node = node if nic_nodes is None else nic_nodes[i]
        nic = Nic(name=f"mlx5_{i}", pci=f"0000:{0x20 + i:02x}:00.0", numa=nic_node, kind="infiniband")
        nics.append(nic)
        gpus.append(Gpu(index=i, pci=f"0000:{0x10 + i:02x}:00.0", numa=None if gpu_numa_unknown else node,
                        cpus=sorted(c.id for c in cpus if c.numa == node), nics=[nic.name],
                        uuid=f"GPU-0000000{i}-1111-2222-3333-444444444444", name="Synthetic GPU",
                        nic_paths={nic.name: "PIX" if nic_node == node else "SYS"}))
    return Topology(root="(synthetic)", cpus=cpus, numa_nodes=numa_nodes, gpus=gpus, nics=nics,
                    kernel=KernelFacts(numa_balancing=0, membind_allowed=True))


def dgx_h100_like() -> Topology:
    """2 sockets x 56 cores SMT2 (224 CPUs), 8 GPUs (0-3 node 0, 4-7 node 1), a NIC beside each
    GPU; a few favoured cores per socket (ITMT-style highest_perf) spread through the socket."""
    favoured = {3, 17, 30, 44, 59, 71, 88, 101}  # 4 per socket, not the lowest ids
    return synth(packages=2, cores_per_node=56, smt=2, gpu_nodes=(0, 0, 0, 0, 1, 1, 1, 1),
                 perf=lambda core: 0 if core in favoured else 1)
