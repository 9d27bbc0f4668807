"""`allowed` from the cgroup cpuset, v1 and v2, read through proc/self/cgroup + proc/mounts."""
from __future__ import annotations

from pathlib import Path

from placement.cpuset import parse_cpulist
from placement.topology import discover
from placement.topology._sysfs import SysfsReader
from placement.topology.cgroup import cgroup_cpus, mounts
from sysfs_builder import CgroupFacts, Machine, make_machine_tree, smp_cpus


def machine_with(cgroup: CgroupFacts | None) -> Machine:
    return Machine(smp_cpus(1, 8, 2), {0: 1_000_000}, {0: {0: 10}}, cgroup=cgroup)


def test_cgroup_v1_cpuset(tmp_path):
    allowed = parse_cpulist("2-5,10-13")
    root = make_machine_tree(tmp_path, machine_with(CgroupFacts(1, "/slurm/uid_1/job_7/step_0", allowed, frozenset({0}))))
    assert discover(root).usable() == allowed


def test_cgroup_v2_cpuset(tmp_path):
    allowed = parse_cpulist("0,8")
    topo = discover(make_machine_tree(tmp_path, machine_with(CgroupFacts(2, "/kubepods/pod1/c1", allowed, frozenset({0})))))
    assert topo.usable() == allowed
    assert [c.id for c in topo.cpus if not c.allowed] == sorted(set(range(16)) - allowed)


def test_v2_leaf_without_cpuset_file_inherits_from_parent(tmp_path):
    root = Path(make_machine_tree(tmp_path, machine_with(CgroupFacts(2, "/kubepods/pod1", parse_cpulist("4-7"),
                                                                      frozenset({0})))))
    (root / "proc/self/cgroup").write_text("0::/kubepods/pod1/inner\n")
    (root / "sys/fs/cgroup/kubepods/pod1/inner").mkdir()
    assert discover(str(root)).usable() == parse_cpulist("4-7")


def test_legacy_proc_self_cpuset_when_proc_self_cgroup_is_missing(tmp_path):
    root = Path(make_machine_tree(tmp_path, machine_with(CgroupFacts(2, "/job/step", parse_cpulist("1-2"),
                                                                      frozenset({0})))))
    (root / "proc/self/cgroup").unlink()
    (root / "proc/self/cpuset").write_text("/job/step\n")
    assert discover(str(root)).usable() == parse_cpulist("1-2")


def test_no_cpuset_anywhere_allows_every_online_cpu(tmp_path):
    assert discover(make_machine_tree(tmp_path, machine_with(None)), live=False).usable() == frozenset(range(16))


def test_mount_points_with_escaped_spaces(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/mounts").write_text("cgroup2 /my\\040cgroup cgroup2 rw 0 0\n")
    (tmp_path / "proc/self").mkdir()
    (tmp_path / "proc/self/cgroup").write_text("0::/a\n")
    (tmp_path / "my cgroup/a").mkdir(parents=True)
    (tmp_path / "my cgroup/a/cpuset.cpus.effective").write_text("3\n")
    fs = SysfsReader(str(tmp_path))
    assert [m.point for m in mounts(fs)] == ["/my cgroup"]
    assert cgroup_cpus(fs) == frozenset({3})


def test_v1_takes_precedence_over_v2_when_cpuset_is_bound_to_v1(tmp_path):
    root = Path(make_machine_tree(tmp_path, machine_with(CgroupFacts(1, "/a", parse_cpulist("6-7"), frozenset({0})))))
    with open(root / "proc/mounts", "a") as f:
        f.write("cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n")
    (root / "sys/fs/cgroup/unified").mkdir(parents=True)
    (root / "sys/fs/cgroup/unified/cpuset.cpus.effective").write_text("0-15\n")
    assert discover(str(root)).usable() == parse_cpulist("6-7")
