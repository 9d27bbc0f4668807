"""The nine classes of machine that discovery once read wrongly (issue 17), each on a tree built
from its facts by tests/sysfs_builder.py, checked against hwloc's reading of such a machine
(hwloc/topology-linux.c) and, where the plan depends on it, through make_plan."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from placement.cli import main
from placement.config import load_config
from placement.plan import JobSpec, make_plan
from placement.roles import ThreadRole
from placement.topology import Topology, discover
from sysfs_builder import machine, make_machine_tree, make_tree


def partition(topo: Topology, key: str) -> list[list[int]]:
    return sorted(sorted(g) for g in topo.groups(key).values())


def plan(topo: Topology, nproc: int, *overrides: str, **job):
    return make_plan(topo, JobSpec(nproc, **job), load_config(list(overrides)))


# ---- 1-3: the cpuset, wherever and however it is mounted

def test_cgroup_v1_noprefix_reads_cpus_not_cpuset_cpus(tmp_path):
    m = machine("cgroup1_noprefix")
    topo = discover(make_tree(tmp_path, "cgroup1_noprefix"), live=False)
    assert topo.usable() == m.cgroup.cpus != frozenset(c.id for c in m.cpus)


def test_cgroup_v1_noprefix_found_through_proc_mounts(tmp_path):
    """Not at a standard place: only proc/mounts' `cpuset,noprefix` option says how files are named."""
    m = machine("cgroup1_noprefix")
    m.cgroup = replace(m.cgroup, mount_point="/sys/fs/cgroup/cpuset")
    root = Path(make_machine_tree(tmp_path, m))
    assert not (root / "dev/cpuset").exists() and (root / "sys/fs/cgroup/cpuset/foreground/cpus").exists()
    assert discover(str(root), live=False).usable() == m.cgroup.cpus


def test_legacy_cpuset_filesystem(tmp_path):
    m = machine("legacy_cpuset_fs")
    root = Path(make_tree(tmp_path, "legacy_cpuset_fs"))
    assert not (root / "proc/self/cgroup").exists()
    assert discover(str(root), live=False).usable() == m.cgroup.cpus


def test_legacy_cpuset_filesystem_beside_cgroups_of_other_controllers(tmp_path):
    m = machine("legacy_cpuset_fs")
    root = Path(make_tree(tmp_path, "legacy_cpuset_fs"))
    (root / "proc/self/cgroup").write_text("2:cpuacct,cpu:/\n1:memory:/\n")
    assert discover(str(root), live=False).usable() == m.cgroup.cpus


def test_cgroup_v1_reads_cpuset_cpus_not_effective_cpus(tmp_path):
    """hwloc reads cpuset.cpus on v1 and removes offline CPUs itself; so do we."""
    m = machine("cgroup1_effective_differs")
    assert m.cgroup.effective_cpus < m.cgroup.cpus
    assert discover(make_tree(tmp_path, "cgroup1_effective_differs"), live=False).usable() == m.cgroup.cpus


def test_cgroup_v1_offline_cpus_of_the_cpuset_are_not_allowed(tmp_path):
    m = machine("cgroup1_effective_differs")
    offline = max(m.cgroup.cpus)
    m.cpus = [replace(c, online=c.id != offline) for c in m.cpus]
    topo = discover(make_machine_tree(tmp_path, m), live=False)
    assert topo.usable() == m.cgroup.cpus - {offline}


# ---- 4-5: L3 groups

def test_l3_groups_by_shared_cpus_when_cache_ids_repeat(tmp_path):
    m = machine("l3_id_repeats")
    root = Path(make_tree(tmp_path, "l3_id_repeats"))
    assert {(root / f"sys/devices/system/cpu/cpu{c}/cache/index3/id").read_text() for c in (0, 8, 63)} == {"0\n"}
    topo = discover(str(root))
    assert partition(topo, "l3") == [list(range(p * 8, p * 8 + 8)) for p in range(8)]


def test_l3_groups_from_the_mask_when_the_list_disagrees(tmp_path):
    """hwloc reads shared_cpu_map; a tree whose shared_cpu_list names every CPU still has 8 L3s."""
    m = machine("l3_id_repeats")
    m.l3_lists_name_every_cpu = True
    root = Path(make_machine_tree(tmp_path, m))
    assert (root / "sys/devices/system/cpu/cpu0/cache/index3/shared_cpu_list").read_text() == "0-63\n"
    assert partition(discover(str(root)), "l3") == [list(range(p * 8, p * 8 + 8)) for p in range(8)]


def test_empty_l3_map_is_the_core_as_hwloc_reads_it(tmp_path):
    topo = discover(make_tree(tmp_path, "ia64_empty_l3_maps"))
    assert all(c.l3 is not None for c in topo.cpus)
    assert partition(topo, "l3") == partition(topo, "core") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_caches_described_for_some_cpus_only(tmp_path):
    """Only the second CPU of each package has cache/: its shared_cpu_map still places the others."""
    m = machine("l3_id_repeats")
    m.cache_dirs = frozenset(p * 8 + 1 for p in range(8))
    topo = discover(make_machine_tree(tmp_path, m))
    assert partition(topo, "l3") == [list(range(p * 8, p * 8 + 8)) for p in range(8)]
    assert {c.l3 for c in topo.cpus if c.id < 8} == {0}


# ---- 6: nodes that overlap

def test_overlapping_node_lists_are_ignored_with_one_warning(tmp_path):
    topo = discover(make_tree(tmp_path, "firmware_node_overlap"))
    assert [(n.id, n.cpus) for n in topo.numa_nodes] == [(0, list(range(8)))]
    assert {c.numa for c in topo.cpus} == {0}
    [warning] = topo.warnings
    assert "node(s) 1-7" in warning and "overlapping" in warning
    assert topo.numa_nodes[0].distances == {0: 10}


def test_overlapping_node_lists_plan_on_the_first_node(tmp_path):
    topo = discover(make_tree(tmp_path, "firmware_node_overlap"))
    p = plan(topo, 2)
    assert [r.memory.nodes for r in p.ranks] == [[0], [0]]
    assert [r.numa for r in p.ranks] == [[0], [0]]


# ---- 7: memory-only nodes

def test_memory_only_nodes_belong_to_the_cpus_that_reach_them_best(tmp_path):
    topo = discover(make_tree(tmp_path, "memory_tiers"))
    nodes = {n.id: n for n in topo.numa_nodes}
    cxl, hbm = nodes[2], nodes[3]
    assert (cxl.kind, cxl.cpus, cxl.local_nodes, cxl.locality) == ("memory", [], [0], "initiators")
    assert cxl.local_cpus == nodes[0].cpus
    assert (hbm.kind, hbm.local_nodes, hbm.locality, hbm.local_cpus) == ("memory", [1], "distances", nodes[1].cpus)
    assert [(n.kind, n.local_nodes, n.locality) for n in (nodes[0], nodes[1])] == [("cpu", [0], "cpus"), ("cpu", [1], "cpus")]
    assert topo.warnings == []


def test_generic_initiators_are_left_out_through_access1(tmp_path):
    """access0 may name a CPU-less generic initiator (node 3 here); access1 names the CPU initiators."""
    m = machine("memory_tiers")
    m.initiators = {2: (3,)}
    m.initiators_access1 = {2: (1,)}
    topo = discover(make_machine_tree(tmp_path, m))
    assert next(n for n in topo.numa_nodes if n.id == 2).local_nodes == [1]


def test_equally_far_memory_node_belongs_to_no_cpus_in_particular(tmp_path):
    m = machine("memory_tiers")
    m.initiators, m.initiators_access1 = {}, {}
    m.distances[2] = {0: 20, 1: 20, 2: 10, 3: 20}
    topo = discover(make_machine_tree(tmp_path, m))
    cxl = next(n for n in topo.numa_nodes if n.id == 2)
    assert (cxl.local_cpus, cxl.local_nodes, cxl.locality) == ([], [], None)


def test_gpu_memory_node_of_grace_hopper(tmp_path):
    topo = discover(make_tree(tmp_path, "grace_hopper"))
    nodes = {n.id: n for n in topo.numa_nodes}
    assert (nodes[1].kind, nodes[1].gpu, nodes[1].local_nodes) == ("gpu", "0009:01:00.0", [0])
    assert nodes[1].local_cpus == list(range(72))
    assert all(nodes[n].kind == "memory" and nodes[n].memory_bytes == 0 for n in range(2, 9))
    [gpu] = topo.gpus
    assert gpu.numa == 0


def test_topology_json_shows_each_tier_next_to_its_cpus(tmp_path, capsys):
    root = make_tree(tmp_path, "memory_tiers")
    assert main(["topo", "--root", root, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    cxl = next(n for n in doc["numa_nodes"] if n["id"] == 2)
    assert {k: cxl[k] for k in ("kind", "cpus", "local_nodes", "locality", "memory_bytes")} == {
        "kind": "memory", "cpus": [], "local_nodes": [0], "locality": "initiators", "memory_bytes": 256_000_000 * 1024}
    assert cxl["distances"]["0"] == 14
    assert Topology.from_dict(doc).to_dict() == doc
    assert main(["topo", "--root", root]) == 0
    text = capsys.readouterr().out
    node0 = text.split("NUMA node 0")[1].split("NUMA node 1")[0]
    assert "tier      node 2: memory-only tier, 244.1 GiB, distance 14 (HMAT initiators)" in node0
    node1 = text.split("NUMA node 1")[1].split("NUMA node 2")[0]
    assert "tier      node 3: memory-only tier, 61.0 GiB, distance 13 (nearest by distance)" in node1


def test_old_topology_json_without_node_kinds_still_reads(tmp_path):
    doc = discover(make_tree(tmp_path, "sparse_offline")).to_dict()
    for n in doc["numa_nodes"]:
        for k in ("kind", "local_cpus", "local_nodes", "locality", "gpu"):
            del n[k]
    nodes = {n.id: n for n in Topology.from_dict(doc).numa_nodes}
    assert (nodes[0].kind, nodes[0].local_nodes, nodes[3].kind, nodes[3].local_nodes) == ("cpu", [0], "memory", [])


@pytest.mark.parametrize("memory", ["bind", "preferred", "interleave"])
def test_plan_never_puts_rank_memory_on_a_memory_only_node(tmp_path, memory):
    for name, nproc in (("memory_tiers", 4), ("grace_hopper", 1)):
        topo = discover(make_tree(tmp_path, name))
        tiers = {n.id for n in topo.numa_nodes if n.kind != "cpu"}
        for r in plan(topo, nproc, f"placement.memory={memory}").ranks:
            assert r.memory.nodes and not set(r.memory.nodes) & tiers, (name, r.memory)


def test_memoryless_cpu_node_falls_back_to_dram_not_to_a_nearer_tier(tmp_path):
    """Node 0 has CPUs but no memory; the CXL node 2 (distance 14) is nearer than node 1's DRAM
    (21): the rank's memory goes to node 1."""
    m = machine("memory_tiers")
    m.node_memory_kb[0] = 0
    topo = discover(make_machine_tree(tmp_path, m))
    p = plan(topo, 2)
    on_node0 = [r for r in p.ranks if r.numa == [0]]
    assert on_node0 and all(r.memory.nodes == [1] for r in on_node0)
    assert any("nearest node with CPUs and memory, 1" in w for w in p.warnings)


def test_memoryless_cpu_node_never_binds_to_gpu_memory(tmp_path):
    m = machine("grace_hopper")
    m.node_memory_kb[0] = 0
    topo = discover(make_machine_tree(tmp_path, m))
    p = plan(topo, 1)
    assert p.ranks[0].memory.mode == "none" and p.ranks[0].memory.nodes == []
    assert any("memory-only nodes are not chosen" in w for w in p.warnings)


# ---- 8: cpufreq policies shared by several CPUs

def test_cpus_take_their_cpufreq_policys_evidence(tmp_path):
    root = Path(make_tree(tmp_path, "cpufreq_policy_owner"))
    assert not (root / "sys/devices/system/cpu/cpu1/cpufreq").exists()
    topo = discover(str(root))
    assert {c.id: c.max_khz for c in topo.cpus} == {c: 1_800_000 if c < 4 else 2_400_000 for c in range(8)}
    assert {c.id: c.perf_rank for c in topo.cpus} == {c: 1 if c < 4 else 0 for c in range(8)}


def test_policy_directory_under_cpu_cpufreq(tmp_path):
    """Newer kernels: cpu/cpufreq/policyN holds the files and names its CPUs."""
    root = Path(make_tree(tmp_path, "cpufreq_policy_owner"))
    cpu = root / "sys/devices/system/cpu"
    (cpu / "cpufreq").mkdir(exist_ok=True)
    for owner in (0, 4):
        (cpu / f"cpu{owner}/cpufreq").rename(cpu / f"cpufreq/policy{owner}")
    topo = discover(str(root))
    assert {c.id: c.perf_rank for c in topo.cpus} == {c: 1 if c < 4 else 0 for c in range(8)}


def test_cpu_without_any_evidence_is_not_ranked_below(tmp_path):
    m = machine("small_cpu")
    m.cpus = [replace(c, highest_perf=None, max_khz=None if c.core_id in (6, 7) else c.max_khz,
                      base_khz=None if c.core_id in (6, 7) else c.base_khz) for c in m.cpus]
    topo = discover(make_machine_tree(tmp_path, m))
    ranks = {c.id: c.perf_rank for c in topo.cpus}
    assert ranks[6] == ranks[7] == 0  # no evidence: ties with the fastest
    assert {ranks[2], ranks[5]} == {0} and {ranks[0], ranks[1]} == {1}


# ---- 9: AMD compute units

def test_amd_compute_units_are_separate_cores_in_one_unit(tmp_path):
    m = machine("amd_compute_units")
    topo = discover(make_tree(tmp_path, "amd_compute_units"))
    assert partition(topo, "core") == [[c.id] for c in m.cpus]
    assert partition(topo, "compute_unit") == [[2 * u, 2 * u + 1] for u in range(16)]
    assert partition(topo, "l3") == [list(range(n * 8, n * 8 + 8)) for n in range(4)]


def test_amd_siblings_without_cpuinfo_stay_threads(tmp_path):
    """Without proc/cpuinfo saying AMD family 15h, hwloc keeps thread siblings as one core."""
    m = machine("amd_compute_units")
    m.cpu_vendor = ("GenuineIntel", 6)
    topo = discover(make_machine_tree(tmp_path, m))
    assert len(topo.groups("core")) == 16 and topo.groups("compute_unit") == {}


def test_plan_uses_every_core_of_a_compute_unit_and_splits_hot_roles(tmp_path):
    topo = discover(make_tree(tmp_path, "amd_compute_units"))
    p = plan(topo, 4, "placement.smt=avoid")
    unit = {c.id: c.compute_unit for c in topo.cpus}
    used = set()
    for r in p.ranks:
        used |= set(r.roles[ThreadRole.OTHER].cpus) | set(r.roles[ThreadRole.MAIN].cpus) | set(r.roles[ThreadRole.NCCL].cpus)
        main, nccl = r.roles[ThreadRole.MAIN].cpus, r.roles[ThreadRole.NCCL].cpus
        assert unit[main[0]] != unit[nccl[0]], "main and nccl on two compute units"
    assert used == set(range(32)), "smt=avoid keeps both cores of a unit: they are not SMT threads"
