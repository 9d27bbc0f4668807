"""The process-level policies give exactly the CPU sets of torchrun --numa-binding, checked against
torch's own functions (torch/numa/binding.py of the installed torch) on the same topology trees.

torch reads absolute /sys paths, its own affinity and CUDA device properties. Here its file reads
and directory listings are redirected into the fixture tree, its affinity is the tree's allowed
set, and CUDA's device list is the tree's GPUs (CUDA cannot exist on this machine): everything
torch decides from those facts runs unchanged.
"""
from __future__ import annotations

import builtins
import io
import os
from types import SimpleNamespace

import pytest

from placement.config import load_config
from placement.plan import JobSpec, make_plan
from placement.plan.cores import physical_cores
from placement.roles import ThreadRole
from placement.topology import discover
from placement.topology.model import Gpu

from plan_checks import check_common
from sysfs_builder import make_tree, shared_trees

binding = pytest.importorskip("torch.numa.binding", reason="this torch has no torch.numa.binding (--numa-binding)")
import torch  # noqa: E402  (after the skip: only needed where torch has the feature)

MODES = ("node", "socket", "exclusive", "core-complex")


class _OsInTree:
    """`os` as torch.numa.binding uses it, with /sys listings read from the tree and the
    calling thread's affinity being the tree's allowed CPUs."""

    def __init__(self, root: str, allowed: set[int]):
        self._root, self._allowed = root, allowed

    def __getattr__(self, name):
        return getattr(os, name)

    def listdir(self, path):
        return os.listdir(self._root + path if str(path).startswith("/sys/") else path)

    def sched_getaffinity(self, pid):
        return set(self._allowed)


def _torch_sets(monkeypatch, root: str, topo, visible: list[Gpu], mode: str,
                injected: dict[str, str]) -> list[set[int] | None]:
    """torch's CPU set for each CUDA index 0..len(visible)-1 (None where torch raises)."""

    def open_in_tree(path, *args, **kwargs):
        p = str(path)
        if p in injected:
            return io.StringIO(injected[p])
        if p.startswith("/sys/"):
            real = root + p
            return builtins.open(real, *args, **kwargs)
        return builtins.open(path, *args, **kwargs)

    def props(i):
        domain, bus, dev_fn = visible[i].pci.split(":")
        return SimpleNamespace(pci_domain_id=int(domain, 16), pci_bus_id=int(bus, 16),
                               pci_device_id=int(dev_fn.split(".")[0], 16))

    allowed = {c.id for c in topo.cpus if c.online and c.allowed}
    monkeypatch.setattr(binding, "open", open_in_tree, raising=False)
    monkeypatch.setattr(binding, "os", _OsInTree(root, allowed))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    options = binding.NumaOptions(affinity_mode=binding.AffinityMode(mode))
    out: list[set[int] | None] = []
    for i in range(len(visible)):
        try:
            out.append(set(binding._get_logical_cpus_to_bind_to(gpu_index=i, numa_options=options)))
        except (RuntimeError, ValueError, OSError):
            out.append(None)
    monkeypatch.undo()
    return out


def _compare(monkeypatch, root: str, topo, injected: dict[str, str]) -> int:
    """Plan every mode for one rank per visible GPU and compare with torch; returns comparisons."""
    visible = sorted(topo.gpus, key=lambda g: g.index)
    compared = 0
    for mode in MODES:
        expected = _torch_sets(monkeypatch, root, topo, visible, mode, injected)
        cfg = load_config([f"policy={mode}", "strict=false"])
        plan = make_plan(topo, JobSpec(len(visible)), cfg)
        check_common(topo, plan, cfg)
        for rank, want in zip(plan.ranks, expected):
            if not want:  # torch fails or binds nothing here (old sysfs, a node without allowed CPU)
                continue
            got = set(rank.cpus(ThreadRole.MAIN))
            assert got == want, f"{root} {mode} GPU {rank.gpu.index}: placement {sorted(got)} torch {sorted(want)}"
            assert all(set(a.cpus) == got for a in rank.roles.values()), "process-level: one set for every role"
            compared += 1
        _check_within(topo, visible, mode, expected)
    return compared


def _check_within(topo, visible: list[Gpu], mode: str, expected: list[set[int] | None]) -> None:
    """placerun --numa-binding=MODE with policy auto (JobSpec.within): every thread role of every
    rank inside the set torch gives that rank, and per-role placement within it: main on one CPU
    of its own wherever torch's set has a core for each rank that shares it."""
    cfg = load_config(["strict=false"])
    plan = make_plan(topo, JobSpec(len(visible), within=mode), cfg)
    check_common(topo, plan, cfg)
    assert plan.policy == f"auto within {mode}"
    sharing: dict[frozenset[int], list] = {}
    for rank, want in zip(plan.ranks, expected):
        if not want:
            continue
        assert rank.share() <= want, f"{mode} GPU {rank.gpu.index}: {sorted(rank.share())} outside torch's {sorted(want)}"
        assert len(rank.cpus(ThreadRole.MAIN)) == 1 and rank.cpus(ThreadRole.OTHER) <= want
        sharing.setdefault(frozenset(want), []).append(rank)
    for want, ranks in sharing.items():
        if len(physical_cores(topo, want)) >= len(ranks):
            mains = [r.cpus(ThreadRole.MAIN) for r in ranks]
            assert len(set(mains)) == len(mains), f"{mode}: ranks sharing torch's set {sorted(want)} share a main core"


def _inject_gpus(topo, per_node: dict[int, int]) -> dict[str, str]:
    """Give a GPU-less tree GPUs (count per node) and the PCI numa_node file torch reads for each."""
    injected = {}
    index = len(topo.gpus)
    for node, count in sorted(per_node.items()):
        for _ in range(count):
            pci = f"0000:{0xe0 + index:02x}:00.0"
            topo.gpus.append(Gpu(index=index, pci=pci, numa=node, cpus=sorted(topo.node_cpus(node))))
            injected[f"/sys/bus/pci/devices/{pci}/numa_node"] = f"{node}\n"
            index += 1
    return injected


@pytest.mark.parametrize("name", ["dgx_h100", "gpu_nic_cross_node"])
def test_fixture_gpus_match_torch(monkeypatch, tmp_path, name):
    root = make_tree(tmp_path, name)
    topo = discover(root)
    assert topo.gpus, f"fixture {name} has GPUs"
    assert _compare(monkeypatch, root, topo, {}) == 4 * len(topo.gpus)


def test_numa_node_minus_one_differs_from_torch_only_where_torch_guesses_node_0(monkeypatch, tmp_path):
    """Both GPUs of this VM say numa_node -1; torch reads that as node 0 for both. Discovery
    finds each GPU's node from its local_cpulist (GPU 1: node 1) and the plan follows it: the one
    deliberate difference. GPU 0, really on node 0, gets torch's set."""
    root = make_tree(tmp_path, "vm_numa_minus_one")
    topo = discover(root)
    torch_node = _torch_sets(monkeypatch, root, topo, topo.gpus, "node", {})
    plan = make_plan(topo, JobSpec(2), load_config(["policy=node"]))
    assert torch_node == [set(range(0, 8)), set(range(0, 8))]
    assert plan.ranks[0].cpus(ThreadRole.MAIN) == torch_node[0]
    assert plan.ranks[1].cpus(ThreadRole.MAIN) == set(range(8, 16)) == set(topo.gpus[1].cpus)


@pytest.mark.parametrize("name", ["epyc_nps4", "container_cgroup2", "small_cpu", "sparse_offline"])
def test_fixture_cpus_with_injected_gpus_match_torch(monkeypatch, tmp_path, name):
    root = make_tree(tmp_path, name)
    topo = discover(root)
    nodes = sorted({c.numa for c in topo.cpus if c.online and c.allowed and c.numa is not None})
    # Uneven counts: 3 GPUs on the first node, 1 on the others, exercise the exclusive slices.
    injected = _inject_gpus(topo, {n: 3 if i == 0 else 1 for i, n in enumerate(nodes)})
    assert _compare(monkeypatch, root, topo, injected) > 0


@pytest.mark.slow  # reads the real machines' trees (extracted from their tarballs)
def test_shared_real_trees_match_torch(monkeypatch):
    compared = 0
    for root in shared_trees():
        topo = discover(root)
        nodes = sorted({c.numa for c in topo.cpus if c.online and c.allowed and c.numa is not None})
        injected = _inject_gpus(topo, {n: 2 for n in nodes})
        compared += _compare(monkeypatch, root, topo, injected)
    assert compared > 0
