"""Damaged trees: a missing, unreadable or malformed file makes that fact null with one warning
naming the file; only a root that is not a sysfs tree fails discovery as a whole."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from placement.errors import TopologyError
from placement.topology import discover
from sysfs_builder import CpuFacts, Machine, make_machine_tree, make_tree

CPU = "sys/devices/system/cpu"


@pytest.fixture
def small(tmp_path) -> Path:
    return Path(make_tree(tmp_path, "small_cpu"))


def test_malformed_value_is_null_with_one_warning_naming_the_file(small):
    bad = small / CPU / "cpu3/cpufreq/cpuinfo_max_freq"
    bad.write_text("fast\n")
    topo = discover(str(small))
    assert topo.cpu(3).max_khz is None
    assert topo.cpu(2).max_khz is not None
    assert len(topo.warnings) == 1
    assert str(bad) in topo.warnings[0] and "fast" in topo.warnings[0]


def test_unreadable_file_is_null_with_one_warning(small):
    bad = small / "proc/sys/kernel/numa_balancing"
    bad.unlink()
    bad.mkdir()  # reading a directory fails with EISDIR, as a permission error would
    topo = discover(str(small))
    assert topo.kernel.numa_balancing is None
    assert len(topo.warnings) == 1 and str(bad) in topo.warnings[0] and "unreadable" in topo.warnings[0]


def test_missing_files_are_unknown_without_warnings(small):
    for cpu in range(16):
        (small / CPU / f"cpu{cpu}/acpi_cppc/highest_perf").unlink()
    (small / "proc/sys/kernel/numa_balancing").unlink()
    topo = discover(str(small))
    assert topo.warnings == []
    assert all(c.highest_perf is None for c in topo.cpus)
    assert topo.kernel.numa_balancing is None
    # Max frequency is the remaining evidence: the favoured cores still rank first.
    assert {c.id for c in topo.cpus if c.perf_rank == 0} == {2, 5, 10, 13}


def test_malformed_sibling_mask_falls_back_to_the_list(small):
    """The mask is what hwloc reads, so it comes first; a malformed one still leaves the list."""
    mask = small / CPU / "cpu1/topology/core_cpus"
    mask.write_text("xyz\n")
    topo = discover(str(small))
    assert topo.cpu(1).core == topo.cpu(9).core == 1
    assert len(topo.warnings) == 1 and str(mask) in topo.warnings[0]


def test_missing_topology_dir_falls_back_to_siblings_read_elsewhere(small):
    # cpu9's own files are gone; cpu1's sibling list still places it.
    for f in (small / CPU / "cpu9/topology").iterdir():
        f.unlink()
    topo = discover(str(small))
    assert topo.cpu(9).core == topo.cpu(1).core == 1


def test_nul_bytes_and_huge_sparse_cpu_ids(tmp_path):
    ids = [0, 1, 4094, 4095]
    cpus = [CpuFacts(i, package=0 if i < 2 else 7, core_id=i, node=0 if i < 2 else 5, l3=i // 2) for i in ids]
    topo = discover(make_machine_tree(tmp_path, Machine(cpus, {0: 1000, 5: 1000}, {0: {0: 10, 5: 40}, 5: {0: 40, 5: 10}},
                                                        nul_bytes=True)))
    assert topo.warnings == []
    assert [c.id for c in topo.cpus] == ids
    assert topo.groups("package") == {0: frozenset({0, 1}), 4094: frozenset({4094, 4095})}
    assert {n.id: n.distances for n in topo.numa_nodes} == {0: {0: 10, 5: 40}, 5: {0: 40, 5: 10}}


def test_distance_row_of_wrong_length_is_dropped_with_a_warning(tmp_path):
    root = Path(make_tree(tmp_path, "numa_balancing_on"))
    bad = root / "sys/devices/system/node/node1/distance"
    bad.write_text("21 10 10\n")
    topo = discover(str(root))
    assert {n.id: n.distances for n in topo.numa_nodes}[1] == {}
    assert len(topo.warnings) == 1 and str(bad) in topo.warnings[0]


def test_root_that_does_not_exist(tmp_path):
    with pytest.raises(TopologyError, match=f"topology root {tmp_path / 'nope'} does not exist"):
        discover(str(tmp_path / "nope"))


def test_root_without_cpu_dir(tmp_path):
    (tmp_path / "sys").mkdir()
    with pytest.raises(TopologyError) as e:
        discover(str(tmp_path))
    assert "has no sys/devices/system/cpu" in str(e.value) and str(tmp_path) in str(e.value)
    assert "\n" not in str(e.value)


def test_root_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(TopologyError, match="is not a directory"):
        discover(str(f))


def test_cpu_dir_without_cpus(tmp_path):
    os.makedirs(tmp_path / CPU)
    with pytest.raises(TopologyError, match="has no CPUs"):
        discover(str(tmp_path))
