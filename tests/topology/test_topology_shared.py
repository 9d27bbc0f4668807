"""The six real machine trees of ../shared/topologies, judged by ../shared/tools/check_topology.py
against what hwloc's lstopo reads from the same trees. Skipped when ../shared is absent."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from placement.cpuset import parse_cpulist
from placement.topology import discover
from sysfs_builder import SHARED, shared_tarballs, shared_trees

pytestmark = pytest.mark.slow  # every test here reads the real machines' trees

CHECKER = SHARED / "tools" / "check_topology.py"


def checker():
    if not CHECKER.exists():
        pytest.skip(f"{CHECKER} is absent")
    spec = importlib.util.spec_from_file_location("check_topology", CHECKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tree_named(fragment: str) -> str:
    for tarball, root in zip(shared_tarballs(), shared_trees()):
        if tarball.name.startswith(fragment):
            return root
    pytest.skip(f"no shared tree named {fragment}*")


@pytest.mark.parametrize("index", range(6))
def test_shared_tree_matches_truth(index):
    check = checker()
    tarballs = shared_tarballs()
    roots = shared_trees()
    if index >= len(tarballs):
        pytest.skip("fewer shared trees than expected")
    tarball = tarballs[index]
    truth = json.loads(Path(str(tarball).removesuffix(".tar.bz2") + ".truth.json").read_text())
    topo = discover(roots[index])
    assert check.compare(json.loads(json.dumps(topo.to_dict())), truth) == []
    assert topo.warnings == []


def test_raptor_lake_favoured_cores_rank_first():
    topo = discover(tree_named("20em64t-hybrid"))
    assert sorted(c.id for c in topo.cpus if c.perf_rank == 0) == [4, 5, 8, 9]
    # P-cores (SMT pairs) outrank the E-cores (single-thread cores) everywhere.
    p_cores = {c.id for c in topo.cpus if len(topo.groups("core")[c.core]) == 2}
    e_cores = {c.id for c in topo.cpus} - p_cores
    assert max(topo.cpu(c).perf_rank for c in p_cores) < min(topo.cpu(c).perf_rank for c in e_cores)


def test_infiniband_hca_on_node_1_of_the_two_socket_xeon():
    topo = discover(tree_named("32em64t-2n8c"))
    ib = [n for n in topo.nics if n.kind == "infiniband"]
    assert [(n.name, n.numa, n.netdevs) for n in ib] == [("mlx4_0", 1, ["ib0"])]
    assert topo.gpus == []


def test_cgroup2_restriction_is_the_jobs_effective_cpuset():
    root = tree_named("32amd64-4s2n4c-cgroup2")
    # No proc/self/cgroup in this tree: proc/self/cpuset names the cgroup, proc/mounts the mount.
    cgroup = Path(root, "proc/self/cpuset").read_text().strip()
    effective = Path(root, "cgroup/unified" + cgroup, "cpuset.cpus.effective").read_text()
    topo = discover(root)
    assert topo.usable() == parse_cpulist(effective)
    assert len(topo.usable()) < len([c for c in topo.cpus if c.online])


def test_kunpeng_clusters_of_four():
    topo = discover(tree_named("128arm"))
    clusters = topo.groups("cluster")
    assert len(clusters) == 32 and all(len(g) == 4 for g in clusters.values())
    assert all(c.die is None for c in topo.cpus)  # die_id -1: the machine reports no dies


@pytest.mark.slow
def test_check_topology_script_passes_all_trees(tmp_path):
    """The acceptance command itself, with this checkout's CLI."""
    checker()
    tarballs = [str(t) for t in shared_tarballs()]
    env = dict(os.environ, TMPDIR="/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path))
    run = subprocess.run([sys.executable, str(CHECKER), "--cmd", f"{sys.executable} -m placement.cli", *tarballs],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.stdout.strip().splitlines()[-1] == f"{len(tarballs)} passed, 0 failed", run.stdout + run.stderr
