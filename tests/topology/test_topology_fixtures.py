"""Discovery on fake trees built from machine facts: what discover() reports must equal the facts
the tree was written from (tests/sysfs_builder.py), computed here from those facts."""
from __future__ import annotations

import pytest

from placement.topology import Topology, discover
from sysfs_builder import FIXTURES, CpuFacts, Machine, machine, make_machine_tree, make_tree, smp_cpus


def partition(cpus: list[CpuFacts], key) -> list[list[int]]:
    groups: dict = {}
    for c in cpus:
        if c.online:
            groups.setdefault(key(c), []).append(c.id)
    return sorted(sorted(g) for g in groups.values())


def discovered_partition(topo: Topology, key: str) -> list[list[int]]:
    return sorted(sorted(g) for g in topo.groups(key).values())


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("fixtures")
    return {name: discover(make_tree(base, name)) for name in FIXTURES}


@pytest.mark.parametrize("name", list(FIXTURES))
def test_groups_match_machine_facts(trees, name):
    m, topo = machine(name), trees[name]
    # Overlapping node lists are the one fact a fixture carries that discovery must warn about.
    assert len(topo.warnings) == (1 if m.node_lists_overlap else 0), topo.warnings
    online = [c for c in m.cpus if c.online]
    assert sorted(c.id for c in topo.cpus) == sorted(c.id for c in m.cpus)
    assert sorted(c.id for c in topo.cpus if c.online) == sorted(c.id for c in online)
    assert discovered_partition(topo, "package") == partition(m.cpus, lambda c: c.package)
    assert discovered_partition(topo, "core") == partition(m.cpus, lambda c: (c.package, c.core_id))
    assert discovered_partition(topo, "l3") == partition(m.cpus, lambda c: c.l3)
    expected_nodes = partition(m.cpus, lambda c: c.node) if m.numa_dir else [sorted(c.id for c in online)]
    assert discovered_partition(topo, "numa") == expected_nodes
    # Every group key is the lowest CPU of its group, so keys never collide across packages.
    for key in ("package", "core", "l3", "die"):
        for k, members in topo.groups(key).items():
            assert k == min(members)


@pytest.mark.parametrize("name", list(FIXTURES))
def test_offline_cpus_have_no_groups_and_are_not_allowed(trees, name):
    for c in trees[name].cpus:
        if not c.online:
            assert (c.package, c.core, c.l3, c.numa, c.perf_rank, c.allowed) == (None, None, None, None, None, False)


def test_dgx_h100_gpus_nics_and_pix_pairs(trees):
    topo, m = trees["dgx_h100"], machine("dgx_h100")
    assert len(topo.cpus) == 224 and len(topo.groups("core")) == 112
    assert [g.pci for g in topo.gpus] == sorted(p.bdf for p in m.pci if p.cls >> 8 == 0x0302)
    assert [g.index for g in topo.gpus] == list(range(8))
    assert [g.numa for g in topo.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    for g in topo.gpus:
        assert frozenset(g.cpus) == topo.node_cpus(g.numa)
        pair = f"mlx5_{g.index}"
        assert g.nics == [pair]
        assert g.nic_paths[pair] == "PIX"
        for nic in topo.nics:
            if nic.name == pair:
                continue
            assert g.nic_paths[nic.name] == ("NODE" if nic.numa == g.numa else "SYS")
    ib = [n for n in topo.nics if n.kind == "infiniband"]
    assert [n.name for n in ib] == [f"mlx5_{i}" for i in range(8)]
    assert [n.netdevs for n in ib] == [[f"ib{i}"] for i in range(8)]
    eth = [n for n in topo.nics if n.kind == "ethernet"]
    assert [(n.name, n.numa, n.netdevs) for n in eth] == [("eno1", 0, ["eno1"])]
    assert topo.kernel.numa_balancing == 0 and topo.kernel.governor == "performance" and topo.kernel.turbo is True
    assert topo.kernel.membind_allowed is None  # not the live system: never probed


def test_epyc_nps4_eight_nodes_l3_per_ccd_and_prefcore_rank(trees):
    topo = trees["epyc_nps4"]
    assert len(topo.numa_nodes) == 8
    for l3 in topo.groups("l3").values():
        assert len(l3) == 16  # 8 cores x 2 threads
        assert len({topo.cpu(c).numa for c in l3}) == 1  # a CCD never spans nodes
    for node in topo.numa_nodes:
        assert len(topo.groups("l3", within=frozenset(node.cpus))) == 2
        assert node.distances[node.id] == 10
        assert sorted(node.distances) == list(range(8))
    # Equal CPPC highest_perf: the amd-pstate prefcore ranking decides.
    m = machine("epyc_nps4")
    best = max(c.prefcore_ranking for c in m.cpus)
    assert {c.id for c in topo.cpus if c.perf_rank == 0} == {c.id for c in m.cpus if c.prefcore_ranking == best}
    assert {c.perf_rank for c in topo.cpus} == {0, 1}
    assert topo.kernel.turbo is True  # cpufreq/boost


def test_container_cgroup2_restricts_allowed(trees):
    topo, m = trees["container_cgroup2"], machine("container_cgroup2")
    assert topo.usable() == m.cgroup.cpus
    assert len(topo.usable()) < len(topo.cpus)
    # The cgroup file is the only thing that says so: every CPU is still online.
    assert all(c.online for c in topo.cpus)


def test_vm_numa_minus_one_resolved_through_local_cpulist(trees):
    topo = trees["vm_numa_minus_one"]
    assert [(g.pci, g.numa, g.cpus) for g in topo.gpus] == [
        ("0000:00:05.0", 0, list(range(0, 8))), ("0000:00:06.0", 1, list(range(8, 16)))]
    [nic] = topo.nics
    assert nic.numa is None  # local CPUs span both nodes: no single home
    assert all(g.nic_paths == {"eth0": "PHB"} for g in topo.gpus)  # flat bus under one host bridge


def test_gpu_nic_cross_node_falls_back_to_any_nic(trees):
    topo = trees["gpu_nic_cross_node"]
    assert [g.numa for g in topo.gpus] == [0, 0]
    [nic] = topo.nics
    assert nic.numa == 1
    for g in topo.gpus:
        assert g.nic_paths == {"mlx5_0": "SYS"}
        assert g.nics == ["mlx5_0"]


def test_numa_balancing_on_kernel_facts(trees):
    k = trees["numa_balancing_on"].kernel
    assert (k.numa_balancing, k.governor, k.turbo) == (1, "powersave", False)


def test_small_cpu_favoured_cores_rank_first(trees):
    topo, m = trees["small_cpu"], machine("small_cpu")
    assert topo.gpus == [] and topo.nics == [] and len(topo.numa_nodes) == 1
    best = max(c.highest_perf for c in m.cpus)
    assert {c.id for c in topo.cpus if c.perf_rank == 0} == {c.id for c in m.cpus if c.highest_perf == best}
    for c in topo.cpus:
        assert c.highest_perf == m.cpus[c.id].highest_perf and c.max_khz == m.cpus[c.id].max_khz


def test_legacy_masks_with_nul_bytes_read_like_lists(trees):
    topo = trees["legacy_masks"]
    assert topo.warnings == []
    assert all(c.die is None and c.cluster is None for c in topo.cpus)  # old kernels have neither
    assert topo.kernel.governor is None and topo.kernel.turbo is None


def test_sparse_ids_and_cpu_less_node(trees):
    topo = trees["sparse_offline"]
    nodes = {n.id: n for n in topo.numa_nodes}
    assert sorted(nodes) == [0, 2, 3]
    assert nodes[3].cpus == [] and nodes[3].memory_bytes == 2_000_000 * 1024
    # Columns follow the online node list 0,2,3, not 0,1,2.
    assert nodes[2].distances == {0: 20, 2: 10, 3: 25}
    assert topo.cpu(8).package == 8 and topo.cpu(8).numa == 2
    assert [c.id for c in topo.cpus if not c.online] == [10, 11]


def test_kernel_without_numa_is_one_node(trees):
    topo = trees["no_numa_dir"]
    assert [(n.id, n.cpus) for n in topo.numa_nodes] == [(0, [0, 1, 2, 3])]


def test_topology_json_round_trip(trees):
    for name, topo in trees.items():
        assert Topology.from_dict(topo.to_dict()).to_dict() == topo.to_dict(), name


def test_perf_rank_base_frequency_breaks_equal_max(tmp_path):
    """SST-BF: equal max frequency, high-priority cores have the higher base frequency."""
    hp = {1, 3}
    cpus = smp_cpus(1, 4, 1, max_khz=3_500_000, base_khz=lambda pkg, core: 2_700_000 if core in hp else 2_100_000)
    topo = discover(make_machine_tree(tmp_path, Machine(cpus, {0: 1_000_000}, {0: {0: 10}})))
    assert {c.id: c.perf_rank for c in topo.cpus} == {0: 1, 1: 0, 2: 1, 3: 0}
    assert {c.base_khz for c in topo.cpus} == {2_700_000, 2_100_000}


def test_perf_rank_cppc_outranks_frequency(tmp_path):
    """CPPC highest_perf is the stronger evidence: it decides even against a higher max frequency."""
    cpus = smp_cpus(1, 3, 1, highest_perf=lambda p, core: [60, 70, 70][core],
                    max_khz=lambda p, core: [5_000_000, 4_000_000, 4_500_000][core])
    topo = discover(make_machine_tree(tmp_path, Machine(cpus, {0: 1_000_000}, {0: {0: 10}})))
    assert {c.id: c.perf_rank for c in topo.cpus} == {0: 2, 1: 1, 2: 0}


def test_cluster_groups_when_the_kernel_reports_them(tmp_path):
    """Kunpeng-style CCL clusters of 4 cores; x86's cluster_id 65535 and arm's -1 mean none."""
    cpus = smp_cpus(1, 8, 1, cluster=lambda pkg, core: core // 4)
    topo = discover(make_machine_tree(tmp_path, Machine(cpus, {0: 1_000_000}, {0: {0: 10}}), "ccl"))
    assert discovered_partition(topo, "cluster") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    x86 = make_machine_tree(tmp_path, Machine(smp_cpus(1, 4, 1, cluster=0xFFFF), {0: 1_000_000}, {0: {0: 10}}), "x86")
    assert discover(x86).groups("cluster") == {}
