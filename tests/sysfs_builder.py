"""Fake sysfs/procfs trees, built by code from machine facts, for tests and benchmarks.

`make_tree(tmp_path, name)` writes the tree of one machine in FIXTURES under
tmp_path/name and returns that root (it holds sys/ and proc/, like "/"). The files
are those the kernel writes: cpu/cpuN/topology/*, cache/index*/{level,
shared_cpu_list,shared_cpu_map}, cpufreq, acpi_cppc, node/nodeN/{cpulist,cpumap,
distance,meminfo}, cpu/online, PCI devices under devices/pci0000:xx/... with
bus/pci/devices/* links, class/infiniband, class/net, proc/self/cgroup,
proc/mounts, cgroup cpuset files and proc/sys/kernel/numa_balancing.

`shared_trees()` extracts the real machine trees of ../shared/topologies (or skips).

Machine facts of each fixture (CPU ids use Linux's numbering: first thread of every
core, package by package, then the SMT siblings in the same order):
- dgx_h100: 2 packages x 56 cores x 2 threads = 224 CPUs, node = package, one L3 per
  package; 8 H100 GPUs (0000:18, 2a, 3a, 5d on node 0; 9a, ab, ba, db on node 1), each
  with one ConnectX-7 (mlx5_N, netdev ibN) as a pair under its own PCIe switch behind
  its own host bridge (GPU N <-> mlx5_N is PIX, same node NODE, other node SYS); one
  ethernet NIC eno1 on node 0. numa_balancing 0, governor performance, turbo on.
- epyc_nps4: 2 packages x 64 cores x 2 threads = 256 CPUs, 8 NUMA nodes (NPS4: 16
  cores each), one L3 per 8-core CCD, amd-pstate: equal highest_perf, prefcore
  ranking higher on the first two cores of every CCD. No GPU.
- container_cgroup2: 2 packages x 16 cores x 2 threads = 64 CPUs on 2 nodes; a
  cgroup v2 cpuset allows cores 8-15 of node 0 and their siblings (8-15,40-47);
  membind is refused there (a live-only fact: `membind_allowed` below).
- vm_numa_minus_one: 16 vCPUs, no SMT, 2 nodes (0-7, 8-15); 2 GPUs on a flat PCI
  bus whose numa_node files say -1 (local_cpulist 0-7 and 8-15) and a virtio NIC
  (numa_node -1, local_cpulist 0-15).
- gpu_nic_cross_node: 2 packages x 8 cores x 2 threads = 32 CPUs on 2 nodes; 2 GPUs
  on node 0 and the only InfiniBand NIC (mlx5_0) on node 1.
- numa_balancing_on: 2 packages x 8 cores x 2 threads on 2 nodes, numa_balancing 1,
  governor powersave, turbo off.
- small_cpu: 1 node, 8 cores x 2 threads = 16 CPUs, no GPU, no NIC; favoured cores
  2 and 5 (CPUs 2,5,10,13: higher highest_perf and max frequency).
- legacy_masks: old sysfs with hex masks only (no *_list files), NUL bytes after
  values, no cpu/online file; 2 packages x 4 cores x 2 threads, 2 nodes.
- sparse_offline: sparse ids: CPUs 0-3 and 8-11 present, 10 and 11 offline;
  packages 0 and 3, nodes 0 and 2 plus node 3 without CPUs but with memory (distance
  columns follow the online node list 0,2,3).
- no_numa_dir: a kernel without NUMA (no node/ directory), 4 CPUs.
- prefcore_two_ccd: 1 node, 16 cores without SMT in two 8-core L3 groups (CCDs), amd-pstate
  prefcore: equal CPPC highest_perf, every core its own prefcore ranking (196 + core: the
  second CCD 1-7% ahead); `prefcore_two_ccd(boosted=...)` lifts the named cores to 250.

Machines of the classes discovery once read wrongly (issue 17; the facts, not anyone's tree):
- cgroup1_noprefix: cgroup v1 cpuset mounted with `noprefix` on /dev/cpuset (files cpus, mems).
- legacy_cpuset_fs: the cpuset filesystem (`none /dev/cpuset cpuset`), set named in proc/self/cpuset.
- cgroup1_effective_differs: v1 cpuset.cpus = package 0, cpuset.effective_cpus narrower.
- l3_id_repeats: 8 packages x 8 cores, every package's L3 has cache id 0.
- ia64_empty_l3_maps: L3 shared_cpu_map of zeros and no list (ia64): the L3 is the core's.
- firmware_node_overlap: 8 nodes each listing all 8 CPUs (a BIOS bug).
- memory_tiers: DRAM nodes 0-1, a CXL node 2 with HMAT initiator node 0, an HBM-like node 3
  placed by distances only (nearest node 1).
- grace_hopper: 72 cores on node 0, the GPU's memory as node 1, memory-less MIG nodes 2-8.
- cpufreq_policy_owner: two cpufreq policies (CPUs 0-3, 4-7); only CPUs 0 and 4 have cpufreq/.
- amd_compute_units: AMD family 15h, 2 packages x 2 nodes x 4 compute units of 2 cores.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import pytest

from placement.cpuset import format_cpulist, format_cpumask

SHARED = Path(__file__).resolve().parents[2] / "shared"

NVIDIA = 0x10DE
MELLANOX = 0x15B3
INTEL = 0x8086
REDHAT_VIRTIO = 0x1AF4
CLASS_3D = 0x030200
CLASS_VGA = 0x030000
CLASS_IB = 0x020700
CLASS_ETH = 0x020000
CLASS_BRIDGE = 0x060400


@dataclass(frozen=True)
class CpuFacts:
    id: int
    package: int  # physical_package_id as the kernel prints it
    core_id: int
    node: int
    l3: int  # CPUs with an equal value share one L3
    die: int = 0
    cluster: int = -1  # -1: no cluster object
    online: bool = True
    max_khz: Optional[int] = 3_000_000
    base_khz: Optional[int] = 2_000_000
    highest_perf: Optional[int] = None
    prefcore_ranking: Optional[int] = None
    # AMD family 15h: CPUs with an equal value are the cores of one compute unit, which the kernel
    # lists as thread siblings although each has its own core_id. None: siblings are SMT threads.
    compute_unit: Optional[int] = None
    l3_id: Optional[int] = None  # the L3's cache/indexN/id file (None: no id file, as old kernels)
    freq_policy: Optional[int] = None  # cpufreq policy shared with CPUs of equal value (None: its own)


@dataclass(frozen=True)
class PciFacts:
    bdf: str  # "0000:18:00.0"
    host_bridge: str  # "pci0000:17"
    parent: Optional[str]  # bdf of the upstream bridge; None: directly on the host bridge
    cls: int
    vendor: int
    device: int = 0
    numa_node: int = -1
    local_cpus: frozenset[int] = frozenset()


@dataclass(frozen=True)
class NicFacts:
    name: str  # class/infiniband name, or the netdev name of an ethernet NIC
    pci: str
    kind: str  # "infiniband" | "ethernet"
    netdevs: tuple[str, ...] = ()


@dataclass(frozen=True)
class CgroupFacts:
    version: int  # 1 or 2
    path: str  # the process's cgroup path, "/kubepods/pod1/ctr"
    cpus: frozenset[int]
    mems: frozenset[int]
    # v1 only: "cgroup" (files cpuset.cpus), "noprefix" (a cgroup mount with the noprefix option:
    # files cpus), "cpuset_fs" (the legacy cpuset filesystem: files cpus, no proc/self/cgroup line).
    v1_mount: str = "cgroup"
    mount_point: Optional[str] = None  # default /sys/fs/cgroup/cpuset (v1), /dev/cpuset (noprefix, cpuset_fs)
    effective_cpus: Optional[frozenset[int]] = None  # v1: a cpuset.effective_cpus that differs from cpus


@dataclass
class Machine:
    cpus: list[CpuFacts]
    node_memory_kb: dict[int, int] = field(default_factory=dict)  # also CPU-less nodes
    distances: dict[int, dict[int, int]] = field(default_factory=dict)
    pci: list[PciFacts] = field(default_factory=list)
    nics: list[NicFacts] = field(default_factory=list)
    cgroup: Optional[CgroupFacts] = None
    numa_balancing: Optional[int] = 0
    governor: Optional[str] = "performance"
    turbo_driver: Optional[str] = "intel_pstate"  # intel_pstate (no_turbo) | boost | None
    turbo: bool = True
    mask_only: bool = False  # old kernels: thread_siblings/core_siblings/shared_cpu_map/cpumap only
    nul_bytes: bool = False  # a NUL byte after each cpu list/mask, as some kernels write
    cpu_online_file: bool = True
    numa_dir: bool = True
    membind_allowed: Optional[bool] = True  # live-only fact, for tests that emulate the machine
    cpu_vendor: Optional[tuple[str, int]] = ("GenuineIntel", 6)  # proc/cpuinfo vendor_id, cpu family
    # Every node's cpulist names every CPU (a firmware bug); CpuFacts.node is then the first node.
    node_lists_overlap: bool = False
    # Caches: CPUs that have a cache/ directory (None: all); an L3 shared_cpu_map of zeros and no
    # shared_cpu_list (ia64); L3 `_list` files that name every CPU while the masks are right.
    cache_dirs: Optional[frozenset[int]] = None
    empty_l3_maps: bool = False
    l3_lists_name_every_cpu: bool = False
    # cpufreq: "per_cpu" (a cpufreq/ directory in every CPU), or "policy_owner" (only the first CPU
    # of each policy has one, its related_cpus naming the others, as on some ARM boards).
    cpufreq_layout: str = "per_cpu"
    # Memory-only nodes: HMAT initiators per node (access0; access1 when `initiators_access1`
    # differs, e.g. without a generic initiator), and GPU memory nodes (node -> GPU bus id,
    # named by proc/driver/nvidia/gpus/<bus id>/numa_status).
    initiators: dict[int, tuple[int, ...]] = field(default_factory=dict)
    initiators_access1: dict[int, tuple[int, ...]] = field(default_factory=dict)
    gpu_memory_nodes: dict[int, str] = field(default_factory=dict)
    description: str = ""


# ---------------------------------------------------------------- machine facts


def smp_cpus(packages: int, cores: int, threads: int, *,
             node_of: Callable[[int, int], int] = lambda pkg, core: pkg,
             l3_of: Callable[[int, int], int] = lambda pkg, core: pkg,
             package_ids: Optional[list[int]] = None, **per_cpu) -> list[CpuFacts]:
    """CPUs of an SMP machine in Linux order; per_cpu values may be callables of (pkg, core)."""
    out = []
    for t in range(threads):
        for pkg in range(packages):
            for core in range(cores):
                cpu_id = (t * packages + pkg) * cores + core
                extra = {k: (v(pkg, core) if callable(v) else v) for k, v in per_cpu.items()}
                out.append(CpuFacts(id=cpu_id, package=(package_ids or list(range(packages)))[pkg],
                                    core_id=core, node=node_of(pkg, core), l3=l3_of(pkg, core), **extra))
    return sorted(out, key=lambda c: c.id)


def two_level_distances(nodes: list[int], same_package: Callable[[int, int], bool],
                        near: int, far: int) -> dict[int, dict[int, int]]:
    return {a: {b: 10 if a == b else (near if same_package(a, b) else far) for b in nodes} for a in nodes}


def gpu_nic_pairs(gpu_bus: list[int], node_of_gpu: Callable[[int], int],
                  cpus_of_node: Callable[[int], frozenset[int]]) -> tuple[list[PciFacts], list[NicFacts]]:
    """Per GPU bus B, its own host bridge and PCIe switch holding the GPU (B) and a NIC (B+1):
    root port (B-3) -> switch upstream port (B-2) -> 2 downstream ports (B-1) -> GPU, NIC."""
    pci, nics = [], []
    for i, bus in enumerate(gpu_bus):
        node = node_of_gpu(i)
        local = cpus_of_node(node)
        hb = f"pci0000:{bus - 3:02x}"
        rp, usp = f"0000:{bus - 3:02x}:01.0", f"0000:{bus - 2:02x}:00.0"
        dsp_gpu, dsp_nic = f"0000:{bus - 1:02x}:00.0", f"0000:{bus - 1:02x}:01.0"
        gpu, nic = f"0000:{bus:02x}:00.0", f"0000:{bus + 1:02x}:00.0"
        bridge = dict(host_bridge=hb, cls=CLASS_BRIDGE, vendor=INTEL, numa_node=node, local_cpus=local)
        pci += [PciFacts(rp, parent=None, **bridge), PciFacts(usp, parent=rp, **bridge),
                PciFacts(dsp_gpu, parent=usp, **bridge), PciFacts(dsp_nic, parent=usp, **bridge),
                PciFacts(gpu, hb, dsp_gpu, CLASS_3D, NVIDIA, 0x2330, node, local),
                PciFacts(nic, hb, dsp_nic, CLASS_IB, MELLANOX, 0x1021, node, local)]
        nics.append(NicFacts(f"mlx5_{i}", nic, "infiniband", (f"ib{i}",)))
    return pci, nics


def cpus_where(cpus: list[CpuFacts], pred: Callable[[CpuFacts], bool]) -> frozenset[int]:
    return frozenset(c.id for c in cpus if pred(c))


def dgx_h100() -> Machine:
    cpus = smp_cpus(2, 56, 2, max_khz=3_800_000, base_khz=2_000_000, highest_perf=170)
    node_cpus = {n: cpus_where(cpus, lambda c, n=n: c.node == n) for n in (0, 1)}
    pci, nics = gpu_nic_pairs([0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb],
                              lambda i: 0 if i < 4 else 1, node_cpus.__getitem__)
    pci.append(PciFacts("0000:03:00.0", "pci0000:00", None, CLASS_ETH, INTEL, 0x1533, 0, node_cpus[0]))
    nics.append(NicFacts("eno1", "0000:03:00.0", "ethernet", ("eno1",)))
    return Machine(cpus, {0: 1_056_000_000, 1: 1_056_000_000},
                   two_level_distances([0, 1], lambda a, b: a == b, 10, 21), pci, nics,
                   description="DGX H100-like: 2x56 cores SMT, 8 GPUs + 8 IB NICs in PIX pairs")


def epyc_nps4() -> Machine:
    cpus = smp_cpus(2, 64, 2, node_of=lambda pkg, core: pkg * 4 + core // 16,
                    l3_of=lambda pkg, core: pkg * 8 + core // 8,
                    max_khz=3_700_000, base_khz=2_400_000, highest_perf=166,
                    prefcore_ranking=lambda pkg, core: 236 if core % 8 < 2 else 196)
    nodes = list(range(8))
    return Machine(cpus, {n: 192_000_000 for n in nodes},
                   two_level_distances(nodes, lambda a, b: a // 4 == b // 4, 12, 32),
                   turbo_driver="boost", description="AMD EPYC 2P NPS4: 8 nodes, L3 per 8-core CCD")


def container_cgroup2() -> Machine:
    cpus = smp_cpus(2, 16, 2)
    allowed = cpus_where(cpus, lambda c: c.package == 0 and c.core_id >= 8)
    return Machine(cpus, {0: 128_000_000, 1: 128_000_000},
                   two_level_distances([0, 1], lambda a, b: a == b, 10, 21),
                   cgroup=CgroupFacts(2, "/kubepods.slice/pod42/ctr", allowed, frozenset({0})),
                   membind_allowed=False, description="container: cgroup v2 cpuset 8-15,40-47, membind refused")


def vm_numa_minus_one() -> Machine:
    cpus = smp_cpus(2, 8, 1, max_khz=None, base_khz=None)
    halves = [cpus_where(cpus, lambda c, n=n: c.node == n) for n in (0, 1)]
    pci = [PciFacts("0000:00:05.0", "pci0000:00", None, CLASS_3D, NVIDIA, 0x20B5, -1, halves[0]),
           PciFacts("0000:00:06.0", "pci0000:00", None, CLASS_3D, NVIDIA, 0x20B5, -1, halves[1]),
           PciFacts("0000:00:03.0", "pci0000:00", None, CLASS_ETH, REDHAT_VIRTIO, 0x1041, -1, halves[0] | halves[1])]
    return Machine(cpus, {0: 64_000_000, 1: 64_000_000},
                   two_level_distances([0, 1], lambda a, b: a == b, 10, 20), pci,
                   [NicFacts("eth0", "0000:00:03.0", "ethernet", ("eth0",))],
                   governor=None, turbo_driver=None, description="VM: PCI numa_node -1 everywhere")


def gpu_nic_cross_node() -> Machine:
    cpus = smp_cpus(2, 8, 2)
    node_cpus = {n: cpus_where(cpus, lambda c, n=n: c.node == n) for n in (0, 1)}
    gpus_pci, _ = gpu_nic_pairs([0x18, 0x2a], lambda i: 0, node_cpus.__getitem__)
    nics_pci, nics = gpu_nic_pairs([0x9a], lambda i: 1, node_cpus.__getitem__)
    pci = [p for p in gpus_pci if p.cls != CLASS_IB] + [p for p in nics_pci if p.cls != CLASS_3D]
    return Machine(cpus, {0: 256_000_000, 1: 256_000_000},
                   two_level_distances([0, 1], lambda a, b: a == b, 10, 21), pci, nics,
                   description="GPUs on node 0, the only NIC on node 1")


def numa_balancing_on() -> Machine:
    cpus = smp_cpus(2, 8, 2)
    return Machine(cpus, {0: 64_000_000, 1: 64_000_000},
                   two_level_distances([0, 1], lambda a, b: a == b, 10, 21),
                   numa_balancing=1, governor="powersave", turbo=False,
                   description="kernel.numa_balancing=1, powersave, turbo off")


def small_cpu() -> Machine:
    favoured = {2, 5}
    cpus = smp_cpus(1, 8, 2,
                    highest_perf=lambda pkg, core: 67 if core in favoured else 64,
                    max_khz=lambda pkg, core: 5_200_000 if core in favoured else 5_000_000,
                    base_khz=1_900_000)
    return Machine(cpus, {0: 32_000_000}, {0: {0: 10}}, description="1 node, 8 cores SMT, favoured cores 2 and 5")


def legacy_masks() -> Machine:
    return Machine(smp_cpus(2, 4, 2, max_khz=None, base_khz=None), {0: 8_000_000, 1: 8_000_000},
                   two_level_distances([0, 1], lambda a, b: a == b, 10, 20),
                   mask_only=True, nul_bytes=True, cpu_online_file=False, governor=None, turbo_driver=None,
                   description="old sysfs: masks only, NUL bytes, no cpu/online")


def sparse_offline() -> Machine:
    cpus = [CpuFacts(i, package=0 if i < 8 else 3, core_id=i % 4, node=0 if i < 8 else 2, l3=0 if i < 8 else 3)
            for i in (0, 1, 2, 3, 8, 9, 10, 11)]
    cpus = [replace(c, online=c.id not in (10, 11)) for c in cpus]
    dist = {0: {0: 10, 2: 20, 3: 30}, 2: {0: 20, 2: 10, 3: 25}, 3: {0: 30, 2: 25, 3: 10}}
    return Machine(cpus, {0: 4_000_000, 2: 4_000_000, 3: 2_000_000}, dist,
                   description="sparse cpu/package/node ids, offline CPUs 10-11, CPU-less node 3")


def no_numa_dir() -> Machine:
    return Machine(smp_cpus(1, 4, 1), numa_dir=False, description="kernel without NUMA")


def cloud_vm_flat(nodes: int, cores_per_node: int, gpu_bdfs: list[str], threads: int = 1) -> Machine:
    """A Hyper-V-style cloud VM (Azure NC/ND): every GPU alone on its own host bridge
    (pciDDDD:BB, the domain carries the device), numa_node -1 and every CPU local, so sysfs says
    nothing of locality; the NIC used for sockets (hv_netvsc eth0) is no PCI device at all."""
    cpus = smp_cpus(1, nodes * cores_per_node, threads, node_of=lambda pkg, core: core // cores_per_node,
                    l3_of=lambda pkg, core: core // cores_per_node)
    every = frozenset(c.id for c in cpus)
    pci = [PciFacts(b, f"pci{b.split(':')[0]}:{b.split(':')[1]}", None, CLASS_3D, NVIDIA, 0x20B5, -1, every)
           for b in gpu_bdfs]
    return Machine(cpus, {n: 220_000_000 for n in range(nodes)},
                   two_level_distances(list(range(nodes)), lambda a, b: False, 10, 32), pci,
                   governor=None, turbo_driver=None, description="cloud VM: flat PCI, numa_node -1")


def cloud_vm_bridged(nodes: int, cores_per_node: int, bridges: list[str], threads: int = 2) -> Machine:
    """A Nitro-style cloud VM (AWS g5.48xlarge): one host bridge, each GPU behind its own root
    port `bridges[i]` on bus 0, numa_node -1 everywhere; only a partial NCCL topology file that
    pins those root ports to nodes tells where the GPUs sit."""
    cpus = smp_cpus(nodes, cores_per_node, threads)
    every = frozenset(c.id for c in cpus)
    pci = []
    for i, bridge in enumerate(bridges):
        pci.append(PciFacts(bridge, "pci0000:00", None, CLASS_BRIDGE, INTEL, 0, -1, every))
        pci.append(PciFacts(f"0000:{0x30 + i:02x}:00.0", "pci0000:00", bridge, CLASS_3D, NVIDIA, 0x2237, -1, every))
    return Machine(cpus, {n: 384_000_000 for n in range(nodes)},
                   two_level_distances(list(range(nodes)), lambda a, b: False, 10, 21), pci,
                   governor=None, turbo_driver=None, description="cloud VM: GPUs behind root ports, numa_node -1")


def prefcore_two_ccd(boosted: frozenset[int] = frozenset()) -> Machine:
    cpus = smp_cpus(1, 16, 1, l3_of=lambda pkg, core: core // 8, max_khz=5_000_000, base_khz=3_000_000,
                    highest_perf=166, prefcore_ranking=lambda pkg, core: 250 if core in boosted else 196 + core)
    return Machine(cpus, {0: 64_000_000}, {0: {0: 10}}, turbo_driver="boost",
                   description="2 CCDs, amd-pstate prefcore: every core its own ranking")


# ---- machines that discovery once read wrongly (issue 17), one per class

def cgroup1_noprefix() -> Machine:
    cpus = smp_cpus(1, 8, 2)
    allowed = cpus_where(cpus, lambda c: c.core_id in (2, 3, 4, 5))
    return Machine(cpus, {0: 16_000_000}, {0: {0: 10}},
                   cgroup=CgroupFacts(1, "/foreground", allowed, frozenset({0}), v1_mount="noprefix"),
                   description="cgroup v1 cpuset mounted with noprefix on /dev/cpuset: files cpus/mems")


def legacy_cpuset_fs() -> Machine:
    cpus = smp_cpus(2, 4, 1)
    allowed = cpus_where(cpus, lambda c: c.package == 1)
    return Machine(cpus, {0: 8_000_000, 1: 8_000_000}, two_level_distances([0, 1], lambda a, b: a == b, 10, 20),
                   cgroup=CgroupFacts(1, "/batch/job42", allowed, frozenset({1}), v1_mount="cpuset_fs"),
                   description="the legacy cpuset filesystem on /dev/cpuset, set named in proc/self/cpuset")


def cgroup1_effective_differs() -> Machine:
    cpus = smp_cpus(2, 8, 2)
    allowed = cpus_where(cpus, lambda c: c.package == 0)
    return Machine(cpus, {0: 64_000_000, 1: 64_000_000}, two_level_distances([0, 1], lambda a, b: a == b, 10, 21),
                   cgroup=CgroupFacts(1, "/slurm/uid_1/job_9", allowed, frozenset({0}),
                                      effective_cpus=cpus_where(cpus, lambda c: c.package == 0 and c.core_id < 2)),
                   description="cgroup v1: cpuset.cpus (package 0) and a narrower cpuset.effective_cpus disagree")


def l3_id_repeats() -> Machine:
    return Machine(smp_cpus(8, 8, 1, node_of=lambda pkg, core: 0, l3_id=0), {0: 8_000_000}, {0: {0: 10}},
                   description="8 packages x 8 cores, each package's L3 has cache id 0")


def ia64_empty_l3_maps() -> Machine:
    return Machine(smp_cpus(2, 2, 2, l3_of=lambda pkg, core: pkg * 2 + core, max_khz=None, base_khz=None),
                   {0: 4_000_000, 1: 4_000_000}, two_level_distances([0, 1], lambda a, b: a == b, 10, 15),
                   cpu_vendor=None, governor=None, turbo_driver=None, empty_l3_maps=True,
                   description="ia64: L3 shared_cpu_map all zeros and no list: the L3 is the core's")


def firmware_node_overlap() -> Machine:
    cpus = smp_cpus(2, 2, 2, node_of=lambda pkg, core: 0)
    nodes = list(range(8))
    return Machine(cpus, {n: 2_000_000 for n in nodes}, two_level_distances(nodes, lambda a, b: False, 10, 20),
                   node_lists_overlap=True, description="BIOS bug: each of 8 nodes lists all 8 CPUs")


def memory_tiers() -> Machine:
    """Two sockets with DRAM (nodes 0, 1), a CXL expander attached to socket 0 that HMAT names
    (node 2, initiator node 0), and an HBM-like tier that only the distance table places (node 3,
    nearest to node 1)."""
    cpus = smp_cpus(2, 8, 2)
    dist = {0: {0: 10, 1: 21, 2: 14, 3: 31}, 1: {0: 21, 1: 10, 2: 24, 3: 13},
            2: {0: 14, 1: 24, 2: 10, 3: 34}, 3: {0: 31, 1: 13, 2: 34, 3: 10}}
    return Machine(cpus, {0: 128_000_000, 1: 128_000_000, 2: 256_000_000, 3: 64_000_000}, dist,
                   initiators={2: (0,)}, initiators_access1={2: (0,)},
                   description="DRAM nodes 0-1, CXL node 2 (HMAT initiator node 0), HBM-like node 3 (distances)")


def grace_hopper() -> Machine:
    """GH200-like: 72 Arm cores with LPDDR on node 0, the H100's HBM onlined as node 1 (named by
    the driver's numa_status), MIG nodes 2-8 without memory; the GPU sits on node 0."""
    cpus = smp_cpus(1, 72, 1, max_khz=3_438_000, base_khz=None)
    node0 = frozenset(c.id for c in cpus)
    gpu = "0009:01:00.0"
    nodes = list(range(9))
    dist = {a: {b: 10 if a == b else (80 if 0 in (a, b) else 120) for b in nodes} for a in nodes}
    memory = {0: 480_000_000, 1: 96_000_000, **{n: 0 for n in range(2, 9)}}
    return Machine(cpus, memory, dist, [PciFacts(gpu, "pci0009:00", None, CLASS_3D, NVIDIA, 0x2342, 0, node0)],
                   cpu_vendor=None, turbo_driver=None, gpu_memory_nodes={1: gpu},
                   description="Grace Hopper: CPU node 0, GPU memory node 1, empty MIG nodes 2-8")


def cpufreq_policy_owner() -> Machine:
    """An Arm board with two clusters; cpufreq has one policy per cluster and only its first CPU
    (0, 4) carries the cpufreq/ directory, whose related_cpus names the others."""
    cpus = smp_cpus(1, 8, 1, cluster=lambda pkg, core: core // 4, freq_policy=lambda pkg, core: core // 4 * 4,
                    max_khz=lambda pkg, core: 1_800_000 if core < 4 else 2_400_000, base_khz=None)
    return Machine(cpus, {0: 4_000_000}, {0: {0: 10}}, cpu_vendor=None, turbo_driver=None,
                   cpufreq_layout="policy_owner", description="cpufreq policy directory on its first CPU only")


def amd_compute_units() -> Machine:
    """Opteron 6200-like (family 15h): 2 packages x 2 dies (one node each) x 4 compute units of 2
    cores; Linux numbers a compute unit's cores consecutively and lists them as thread siblings."""
    cpus = []
    for pkg in range(2):
        for die in range(2):
            for cu in range(4):
                for k in range(2):
                    cpu_id = pkg * 16 + die * 8 + cu * 2 + k
                    cpus.append(CpuFacts(cpu_id, package=pkg, core_id=die * 8 + cu * 2 + k, node=pkg * 2 + die,
                                         l3=pkg * 2 + die, die=0, compute_unit=(pkg * 2 + die) * 4 + cu,
                                         max_khz=2_100_000, base_khz=None))
    nodes = [0, 1, 2, 3]
    return Machine(cpus, {n: 16_000_000 for n in nodes}, two_level_distances(nodes, lambda a, b: a // 2 == b // 2, 16, 22),
                   cpu_vendor=("AuthenticAMD", 21), turbo_driver="boost",
                   description="AMD family 15h: compute units of 2 cores listed as thread siblings")


FIXTURES: dict[str, Callable[[], Machine]] = {
    "dgx_h100": dgx_h100,
    "epyc_nps4": epyc_nps4,
    "container_cgroup2": container_cgroup2,
    "vm_numa_minus_one": vm_numa_minus_one,
    "gpu_nic_cross_node": gpu_nic_cross_node,
    "numa_balancing_on": numa_balancing_on,
    "small_cpu": small_cpu,
    "legacy_masks": legacy_masks,
    "sparse_offline": sparse_offline,
    "no_numa_dir": no_numa_dir,
    "cgroup1_noprefix": cgroup1_noprefix,
    "legacy_cpuset_fs": legacy_cpuset_fs,
    "cgroup1_effective_differs": cgroup1_effective_differs,
    "l3_id_repeats": l3_id_repeats,
    "ia64_empty_l3_maps": ia64_empty_l3_maps,
    "firmware_node_overlap": firmware_node_overlap,
    "memory_tiers": memory_tiers,
    "grace_hopper": grace_hopper,
    "cpufreq_policy_owner": cpufreq_policy_owner,
    "amd_compute_units": amd_compute_units,
    "prefcore_two_ccd": prefcore_two_ccd,
}


# ---------------------------------------------------------------- writing the tree


class _Tree:
    """Collects the tree as (path, text) files and (path, target) links; `materialize` writes them."""

    def __init__(self, machine: Machine):
        self.m = machine
        self.files: list[tuple[str, str]] = []
        self.links: list[tuple[str, str]] = []
        self.dirs: list[str] = []

    def write(self, rel: str, text: str) -> None:
        self.files.append((rel, text))

    def link(self, rel: str, target: str) -> None:
        self.links.append((rel, target))

    def mkdir(self, rel: str) -> None:
        self.dirs.append(rel)

    def cpuset(self, rel_base: str, cpus: frozenset[int], *, mask_name: Optional[str] = None) -> None:
        """Write a set as `<base>_list` and/or the mask file, the way the machine's kernel would."""
        tail = "\n\x00" if self.m.nul_bytes else "\n"
        self.write(mask_name or rel_base, format_cpumask(cpus) + tail)
        if not self.m.mask_only:
            self.write(rel_base + "_list", format_cpulist(cpus) + tail)

    def materialize(self, root: Path) -> None:
        made: set[str] = set()

        def parent_of(rel: str) -> None:
            d = os.path.dirname(rel)
            if d not in made:
                os.makedirs(root / d, exist_ok=True)
                made.add(d)

        for rel in self.dirs:
            os.makedirs(root / rel, exist_ok=True)
        for rel, text in self.files:
            parent_of(rel)
            with open(root / rel, "w") as f:
                f.write(text)
        for rel, target in self.links:
            parent_of(rel)
            os.symlink(target, root / rel)


def _plan_tree(machine: Machine) -> _Tree:
    t = _Tree(machine)
    online = [c for c in machine.cpus if c.online]
    present = frozenset(c.id for c in machine.cpus)
    on_ids = frozenset(c.id for c in online)

    def groups_by(key: Callable[[CpuFacts], object]) -> dict[object, frozenset[int]]:
        out: dict[object, set[int]] = {}
        for o in online:
            out.setdefault(key(o), set()).add(o.id)
        return {k: frozenset(v) for k, v in out.items()}

    def core_key(o: CpuFacts) -> tuple:
        # A compute unit's cores are listed as thread siblings of each other.
        return ("cu", o.package, o.compute_unit) if o.compute_unit is not None else (o.package, o.die, o.core_id)

    cores = groups_by(core_key)
    own_cores = groups_by(lambda o: (o.package, o.die, o.core_id))
    packages = groups_by(lambda o: o.package)
    dies = groups_by(lambda o: (o.package, o.die))
    clusters = groups_by(lambda o: o.cluster)
    l3s = groups_by(lambda o: o.l3)
    nodes_cpus = groups_by(lambda o: o.node)
    policies = groups_by(lambda o: ("own", o.id) if o.freq_policy is None else o.freq_policy)

    sysc = "sys/devices/system/cpu"
    for c in machine.cpus:
        d = f"{sysc}/cpu{c.id}"
        if c.id != 0 or not c.online:
            t.write(f"{d}/online", "1\n" if c.online else "0\n")
        if not c.online:
            continue  # the kernel removes topology/ and cache/ of an offline CPU
        core = cores[core_key(c)]
        pkg = packages[c.package]
        t.write(f"{d}/topology/physical_package_id", f"{c.package}\n")
        t.write(f"{d}/topology/core_id", f"{c.core_id}\n")
        t.cpuset(f"{d}/topology/thread_siblings", core)
        t.cpuset(f"{d}/topology/core_siblings", pkg)
        if not machine.mask_only:
            t.write(f"{d}/topology/die_id", f"{c.die}\n")
            t.write(f"{d}/topology/cluster_id", f"{c.cluster}\n")
            t.cpuset(f"{d}/topology/core_cpus", core)
            t.cpuset(f"{d}/topology/package_cpus", pkg)
            t.cpuset(f"{d}/topology/die_cpus", dies[(c.package, c.die)])
            t.cpuset(f"{d}/topology/cluster_cpus", clusters[c.cluster] if c.cluster != -1 else core)
        if machine.cache_dirs is None or c.id in machine.cache_dirs:
            _write_caches(t, machine, d, c, own_cores[(c.package, c.die, c.core_id)], core, l3s[c.l3], on_ids)
        members = policies[("own", c.id) if c.freq_policy is None else c.freq_policy]
        if machine.cpufreq_layout == "per_cpu" or c.id == min(members):
            f = f"{d}/cpufreq"
            if c.max_khz is not None:
                t.write(f"{f}/cpuinfo_max_freq", f"{c.max_khz}\n")
            if c.base_khz is not None:
                t.write(f"{f}/base_frequency", f"{c.base_khz}\n")
            if machine.governor is not None:
                t.write(f"{f}/scaling_governor", f"{machine.governor}\n")
            if c.prefcore_ranking is not None:
                t.write(f"{f}/amd_pstate_prefcore_ranking", f"{c.prefcore_ranking}\n")
            if machine.cpufreq_layout == "policy_owner":
                # related_cpus/affected_cpus print CPU numbers separated by spaces, not a cpu list.
                t.write(f"{f}/related_cpus", " ".join(map(str, sorted(members))) + "\n")
                t.write(f"{f}/affected_cpus", " ".join(map(str, sorted(members))) + "\n")
        if c.highest_perf is not None:
            t.write(f"{d}/acpi_cppc/highest_perf", f"{c.highest_perf}\n")
    if machine.cpu_vendor is not None:
        vendor, family = machine.cpu_vendor
        t.write("proc/cpuinfo", "".join(f"processor\t: {c.id}\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
                                        f"physical id\t: {c.package}\ncore id\t\t: {c.core_id}\n\n" for c in online))
    if machine.cpu_online_file:
        t.write(f"{sysc}/online", format_cpulist(on_ids) + "\n")
        t.write(f"{sysc}/present", format_cpulist(present) + "\n")
        t.write(f"{sysc}/possible", format_cpulist(present) + "\n")
        t.write(f"{sysc}/offline", format_cpulist(present - on_ids) + "\n")
    if machine.turbo_driver == "intel_pstate":
        t.write(f"{sysc}/intel_pstate/no_turbo", "0\n" if machine.turbo else "1\n")
    elif machine.turbo_driver == "boost":
        t.write(f"{sysc}/cpufreq/boost", "1\n" if machine.turbo else "0\n")

    if machine.numa_dir:
        nodes = sorted(set(machine.node_memory_kb) | {c.node for c in machine.cpus})
        for n in nodes:
            d = f"sys/devices/system/node/node{n}"
            # The node's list file is `cpulist` (not `cpu_list`), beside the mask `cpumap`.
            node_set = on_ids if machine.node_lists_overlap else nodes_cpus.get(n, frozenset())
            tail = "\n\x00" if machine.nul_bytes else "\n"
            t.write(f"{d}/cpumap", format_cpumask(node_set) + tail)
            if not machine.mask_only:
                t.write(f"{d}/cpulist", format_cpulist(node_set) + tail)
            row = machine.distances.get(n, {n: 10})
            t.write(f"{d}/distance", " ".join(str(row[b]) for b in sorted(row)) + "\n")
            kb = machine.node_memory_kb.get(n, 0)
            t.write(f"{d}/meminfo", f"Node {n} MemTotal:       {kb} kB\nNode {n} MemFree:        {kb // 2} kB\n")
            for access, table in (("access0", machine.initiators), ("access1", machine.initiators_access1)):
                if n in table:
                    t.mkdir(f"{d}/{access}/initiators")
                    t.write(f"{d}/{access}/initiators/read_latency", "100\n")
                    for m in table[n]:
                        t.link(f"{d}/{access}/initiators/node{m}", f"../../../node{m}")
        if not machine.mask_only:
            t.write("sys/devices/system/node/online", format_cpulist(nodes) + "\n")
            t.write("sys/devices/system/node/possible", format_cpulist(nodes) + "\n")
    for n, bdf in machine.gpu_memory_nodes.items():
        t.write(f"proc/driver/nvidia/gpus/{bdf}/numa_status",
                f"Node:                                 {n}\nStatus:                               online\n")

    _write_pci(t, machine)
    _write_proc(t, machine)
    return t


def _write_caches(t: _Tree, machine: Machine, d: str, c: CpuFacts, own_core: frozenset[int],
                  core: frozenset[int], l3: frozenset[int], on_ids: frozenset[int]) -> None:
    """cache/index0-3: L1d of the CPU's own core, L1i and L2 of its core as the kernel lists it
    (a compute unit's two cores share them), the L3."""
    for index, level, kind, shared in ((0, 1, "Data", own_core), (1, 1, "Instruction", core),
                                       (2, 2, "Unified", core), (3, 3, "Unified", l3)):
        base = f"{d}/cache/index{index}"
        t.write(f"{base}/level", f"{level}\n")
        t.write(f"{base}/type", f"{kind}\n")
        if level == 3 and c.l3_id is not None:
            t.write(f"{base}/id", f"{c.l3_id}\n")
        if level == 3 and machine.empty_l3_maps:
            t.write(f"{base}/shared_cpu_map", format_cpumask(frozenset()) + "\n")
            continue
        if level == 3 and machine.l3_lists_name_every_cpu:
            t.write(f"{base}/shared_cpu_map", format_cpumask(shared) + "\n")
            t.write(f"{base}/shared_cpu_list", format_cpulist(on_ids) + "\n")
            continue
        t.cpuset(f"{base}/shared_cpu", shared, mask_name=f"{base}/shared_cpu_map")


def _pci_dir(machine: Machine, bdf: str) -> str:
    by_bdf = {p.bdf: p for p in machine.pci}
    chain = []
    p: Optional[PciFacts] = by_bdf[bdf]
    while p is not None:
        chain.append(p.bdf)
        p = by_bdf[p.parent] if p.parent else None
    return "/".join(["sys/devices", by_bdf[bdf].host_bridge] + chain[::-1])


def _write_pci(t: _Tree, machine: Machine) -> None:
    for p in machine.pci:
        d = _pci_dir(machine, p.bdf)
        t.write(f"{d}/class", f"0x{p.cls:06x}\n")
        t.write(f"{d}/vendor", f"0x{p.vendor:04x}\n")
        t.write(f"{d}/device", f"0x{p.device:04x}\n")
        t.write(f"{d}/numa_node", f"{p.numa_node}\n")
        t.write(f"{d}/local_cpulist", format_cpulist(p.local_cpus) + "\n")
        t.write(f"{d}/local_cpus", format_cpumask(p.local_cpus) + "\n")
        t.link(f"sys/bus/pci/devices/{p.bdf}", "../../../" + d.removeprefix("sys/"))
    for nic in machine.nics:
        d = _pci_dir(machine, nic.pci).removeprefix("sys/")
        if nic.kind == "infiniband":
            t.link(f"sys/class/infiniband/{nic.name}", f"../../{d}/infiniband/{nic.name}")
            t.link(f"sys/{d}/infiniband/{nic.name}/device", f"../../../{nic.pci}")
        for netdev in nic.netdevs:
            t.link(f"sys/class/net/{netdev}", f"../../{d}/net/{netdev}")
            t.link(f"sys/{d}/net/{netdev}/device", f"../../../{nic.pci}")
            t.write(f"sys/{d}/net/{netdev}/type", "32\n" if nic.kind == "infiniband" else "1\n")
    t.link("sys/class/net/lo", "../../devices/virtual/net/lo")
    t.mkdir("sys/devices/virtual/net/lo")


def _write_proc(t: _Tree, machine: Machine) -> None:
    if machine.numa_balancing is not None:
        t.write("proc/sys/kernel/numa_balancing", f"{machine.numa_balancing}\n")
    mounts = ["sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0",
              "proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0"]
    cg = machine.cgroup
    every = frozenset(c.id for c in machine.cpus if c.online)
    if cg is None or cg.version == 2:
        mounts.append("cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0")
        path = cg.path if cg else "/"
        t.write("proc/self/cgroup", f"0::{path}\n")
        if cg is not None:
            t.write("proc/self/cpuset", f"{path}\n")
            t.write("sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n")
            t.write("sys/fs/cgroup/cpuset.cpus.effective", format_cpulist(every) + "\n")
            t.write(f"sys/fs/cgroup{cg.path}/cpuset.cpus.effective", format_cpulist(cg.cpus) + "\n")
            t.write(f"sys/fs/cgroup{cg.path}/cpuset.mems.effective", format_cpulist(cg.mems) + "\n")
    else:
        noprefix = cg.v1_mount in ("noprefix", "cpuset_fs")
        point = cg.mount_point or ("/dev/cpuset" if noprefix else "/sys/fs/cgroup/cpuset")
        prefix = "" if noprefix else "cpuset."
        if cg.v1_mount == "cpuset_fs":
            # The cpuset filesystem of kernels before cgroups: the set is named in proc/self/cpuset only.
            mounts.append(f"none {point} cpuset rw,relatime 0 0")
            t.write("proc/self/cpuset", f"{cg.path}\n")
        else:
            opts = "cpuset,noprefix,release_agent=/sbin/cpuset_release_agent" if noprefix else "cpuset"
            mounts += ["tmpfs /sys/fs/cgroup tmpfs ro,nosuid,nodev,noexec,mode=755 0 0",
                       f"cgroup {point} cgroup rw,nosuid,nodev,noexec,relatime,{opts} 0 0",
                       "cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0"]
            t.write("proc/self/cgroup", f"4:memory:{cg.path}\n3:cpuset:{cg.path}\n0::/\n")
        root, leaf = point.strip("/"), point.strip("/") + cg.path
        t.write(f"{root}/{prefix}cpus", format_cpulist(every) + "\n")
        t.write(f"{leaf}/{prefix}cpus", format_cpulist(cg.cpus) + "\n")
        t.write(f"{leaf}/{prefix}mems", format_cpulist(cg.mems) + "\n")
        if cg.effective_cpus is not None:
            t.write(f"{leaf}/{prefix}effective_cpus", format_cpulist(cg.effective_cpus) + "\n")
    t.write("proc/mounts", "\n".join(mounts) + "\n")


_planned: dict[str, _Tree] = {}
_fast_dir: list[str] = []


def _fast_base() -> Optional[str]:
    """A per-process directory on tmpfs (/dev/shm) when there is one: creating thousands of small
    files there takes a fraction of the time it takes on a disk-backed /tmp."""
    if not _fast_dir:
        shm = "/dev/shm"
        if not (os.path.isdir(shm) and os.access(shm, os.W_OK)):
            return None
        _fast_dir.append(tempfile.mkdtemp(prefix="placement-trees-", dir=shm))
        atexit.register(shutil.rmtree, _fast_dir[0], True)
    return _fast_dir[0]


def make_tree(tmp_path, name: str) -> str:
    """Write fixture `name` as a fresh, writable tree and return its root (holding sys/ and proc/).

    The tree lies on tmpfs when the machine has one (tmp_path/name then links to it), else
    under tmp_path/name. Each call writes a new tree, so a test may change its files.
    """
    if name not in FIXTURES:
        raise KeyError(f"unknown fixture {name!r}; choose from {', '.join(FIXTURES)}")
    if name not in _planned:
        _planned[name] = _plan_tree(FIXTURES[name]())
    return _materialize(_planned[name], tmp_path, name)


def make_machine_tree(tmp_path, machine: Machine, name: str = "machine") -> str:
    """Like make_tree, for a Machine a test describes itself."""
    return _materialize(_plan_tree(machine), tmp_path, name)


def _materialize(tree: _Tree, tmp_path, name: str) -> str:
    link = Path(tmp_path) / name
    base = _fast_base()
    root = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base)) if base else link
    tree.materialize(root)
    if base:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(root, target_is_directory=True)
    return str(root)


def machine(name: str) -> Machine:
    """The facts fixture `name` is built from (what tests compare discovery against)."""
    return FIXTURES[name]()


# ---------------------------------------------------------------- the real trees of ../shared

_extracted: dict[str, str] = {}


def shared_tarballs() -> list[Path]:
    return sorted((SHARED / "topologies").glob("*.tar.bz2"))


def extract_tree(tarball: Path, dest: str) -> str:
    """Extract a gathered tree (regular files, directories, symlinks) and return its root.

    Writes only contents and links, none of tarfile's per-member ownership/mode/time calls,
    which cost several times more than the data on these trees of thousands of tiny files.
    """
    with tarfile.open(tarball) as tf:
        for m in tf:
            if m.name.startswith("/") or ".." in m.name.split("/"):
                raise ValueError(f"{tarball}: member {m.name!r} leaves the tree")
            path = os.path.join(dest, m.name)
            if m.isdir():
                os.makedirs(path, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if m.isreg():
                with open(path, "wb") as f:
                    f.write(tf.extractfile(m).read())
            elif m.issym():
                os.symlink(m.linkname, path)
    entries = [e for e in os.listdir(dest) if not e.startswith(".")]
    return os.path.join(dest, entries[0]) if len(entries) == 1 else dest


def shared_trees() -> list[str]:
    """Roots of the real machine trees in ../shared/topologies, extracted once per session.

    Skips the calling test when ../shared is absent.
    """
    tarballs = shared_tarballs()
    if not tarballs:
        pytest.skip(f"no real topology trees: {SHARED / 'topologies'} is absent")
    for tarball in tarballs:
        if tarball.name not in _extracted:
            base = _fast_base()
            tmp = tempfile.mkdtemp(prefix="shared-", dir=base)
            if base is None:
                atexit.register(shutil.rmtree, tmp, True)
            _extracted[tarball.name] = extract_tree(tarball, tmp)
    return [_extracted[t.name] for t in tarballs]
