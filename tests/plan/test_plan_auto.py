"""make_plan, policy auto: role placement, knobs, shortfalls, on topologies built in code."""
from __future__ import annotations

import builtins
import json
import os

import pytest

from placement.config import load_config
from placement.errors import PlanError
from placement.plan import JobSpec, Plan, make_plan
from placement.roles import ThreadRole

from plan_checks import check_auto, cores, node_of
from plan_topos import dgx_h100_like, synth

MAIN, NCCL, PIN, DL, OTHER = (ThreadRole.MAIN, ThreadRole.NCCL, ThreadRole.PIN_MEMORY,
                              ThreadRole.DATALOADER, ThreadRole.OTHER)


def plan_of(topo, nproc, *overrides, **job):
    cfg = load_config(list(overrides))
    job.setdefault("dataloader_workers", cfg.dataloader_workers)
    plan = make_plan(topo, JobSpec(nproc, **job), cfg)
    if cfg.policy == "auto":
        check_auto(topo, plan, cfg)
    return plan


def test_dgx_like_eight_ranks_hot_roles_on_gpu_node_fastest_whole_disjoint():
    topo = dgx_h100_like()
    plan = plan_of(topo, 8)
    assert plan.warnings == []
    favoured = {3, 17, 30, 44, 59, 71, 88, 101}
    hot_cores = []
    for r in plan.ranks:
        assert r.gpu.index == r.local_rank
        gpu_node = 0 if r.local_rank < 4 else 1
        for role in (MAIN, NCCL, PIN):
            assert {node_of(topo)[c] for c in r.cpus(role)} == {gpu_node}
        # Every rank's main gets one of its socket's 4 favoured cores; nccl a plain core.
        assert r.cpus(MAIN) <= favoured
        assert not r.cpus(NCCL) & favoured
        hot_cores.append(cores(topo, r.cpus(MAIN) | r.cpus(NCCL)))
        assert r.memory.mode == "bind" and r.memory.nodes == [gpu_node]
        assert "perf_rank 0" in r.roles[MAIN].reason and f"GPU {r.local_rank}'s node" in r.roles[MAIN].reason
    assert len(set().union(*hot_cores)) == 16  # 8 ranks x 2 whole cores, none shared


def test_smt_use_gives_whole_cores_with_siblings_and_avoid_one_thread():
    topo = synth(cores_per_node=8, smt=2)
    avoid = plan_of(topo, 2)
    use = plan_of(topo, 2, "smt=use")
    for a, u in zip(avoid.ranks, use.ranks):
        assert len(a.cpus(MAIN)) == 1
        assert len(u.cpus(MAIN)) == 2 and cores(topo, u.cpus(MAIN)) == cores(topo, a.cpus(MAIN))
        assert len(u.share()) == 2 * len(a.share())
        # CPU-only ranks compute on the intra-op pool: main's CPUs and other's (plan.auto.intra_op_threads)
        assert u.env["OMP_NUM_THREADS"] == str(len(u.cpus(OTHER) | u.cpus(MAIN))) == "6"
        assert a.env["OMP_NUM_THREADS"] == str(len(a.cpus(OTHER) | a.cpus(MAIN))) == "3"


def test_cpu_only_ranks_split_by_node_then_l3():
    topo = synth(packages=2, cores_per_node=8, l3_per_node=2)
    plan = plan_of(topo, 2)
    assert [r.numa for r in plan.ranks] == [[0], [1]]
    plan = plan_of(topo, 4)
    l3_of = {c.id: c.l3 for c in topo.cpus}
    for r in plan.ranks:
        assert len({l3_of[c] for c in r.share()}) == 1, f"rank {r.local_rank} spans L3 groups"
    assert [r.gpu for r in plan.ranks] == [None] * 4


def test_dataloader_spread_over_l3_groups_and_sized_by_workers():
    topo = synth(cores_per_node=16, l3_per_node=4)
    plan = plan_of(topo, 1, "dataloader_workers=4")
    r = plan.ranks[0]
    l3_of = {c.id: c.l3 for c in topo.cpus}
    assert len(r.cpus(DL)) == 4
    assert len({l3_of[c] for c in r.cpus(DL)}) == 4, "4 workers spread over the 4 L3 groups"
    plan = plan_of(topo, 1, "dataloader_workers=0")
    assert plan.ranks[0].cpus(DL) == plan.ranks[0].cpus(OTHER)


def test_prefer_fast_cores_off_takes_the_first_cores():
    topo = synth(cores_per_node=8, perf=lambda core: 0 if core == 6 else 1)
    fast = plan_of(topo, 1)
    assert fast.ranks[0].cpus(MAIN) == {6}
    first = plan_of(topo, 1, "prefer_fast_cores=false")
    assert first.ranks[0].cpus(MAIN) == {0} and first.ranks[0].cpus(NCCL) == {1}
    assert "prefer_fast_cores off" in first.ranks[0].roles[MAIN].reason


def test_ranks_trade_so_hot_cores_are_the_fastest_on_the_node():
    # All fast cores sit in the second half: without trading rank 0 would get none.
    topo = synth(cores_per_node=16, l3_per_node=2, perf=lambda core: 0 if core >= 12 else 3)
    plan = plan_of(topo, 2)
    mains = set().union(*(r.cpus(MAIN) for r in plan.ranks))
    nccls = set().union(*(r.cpus(NCCL) for r in plan.ranks))
    assert mains | nccls == {12, 13, 14, 15}


def test_nccl_goes_to_the_nic_node_when_gpu_and_nic_sit_apart():
    topo = synth(packages=2, cores_per_node=8, gpu_nodes=(0, 0), nic_nodes=(1, 1))
    plan = plan_of(topo, 2)
    nodes = node_of(topo)
    for r in plan.ranks:
        assert {nodes[c] for c in r.cpus(MAIN)} == {0}
        assert {nodes[c] for c in r.cpus(NCCL)} == {1}
        assert {nodes[c] for c in r.cpus(PIN)} == {0}, "pin_memory stays next to main"
        assert r.numa == [0, 1] and r.memory.nodes == [0]
        assert "NIC mlx5_" in r.roles[NCCL].reason and "node 1" in r.roles[NCCL].reason
    assert plan.ranks[0].cpus(NCCL) != plan.ranks[1].cpus(NCCL)


def test_gpu_without_numa_node_uses_its_local_cpus():
    topo = synth(packages=2, cores_per_node=4, gpu_nodes=(1, 0), gpu_numa_unknown=True)
    plan = plan_of(topo, 2)
    nodes = node_of(topo)
    assert [{nodes[c] for c in r.share()} for r in plan.ranks] == [{1}, {0}]


def test_reserved_cpus_are_never_used_and_hot_roles_avoid_their_cores():
    topo = synth(cores_per_node=8, smt=2)
    plan = plan_of(topo, 2, "reserved_cpus=0,9", "smt=use")
    used = set().union(*(r.share() for r in plan.ranks))
    assert not used & {0, 9}
    hot = set().union(*(r.cpus(MAIN) | r.cpus(NCCL) for r in plan.ranks))
    assert not hot & {0, 8, 1, 9}, "cores with a reserved sibling are not whole: no hot role there"


def test_reserved_cpus_leaving_nothing():
    topo = synth(cores_per_node=4)
    with pytest.raises(PlanError, match=r"reserved_cpus='0-3' leaves no usable CPU \(online and allowed: 0-3\)"):
        plan_of(topo, 1, "reserved_cpus=0-3", "strict=true")
    plan = plan_of(topo, 1, "reserved_cpus=0-3")  # the default: degraded
    assert plan.ranks[0].roles == {} and "monitor only" in plan.warnings[0]


def test_more_ranks_than_gpus():
    topo = synth(packages=2, cores_per_node=8, gpu_nodes=(0, 1))
    with pytest.raises(PlanError) as e:
        plan_of(topo, 3, "strict=true")
    assert str(e.value).startswith("nproc_per_node=3 but only 2 GPU(s) are visible: 0 (0000:10:00.0), 1 (0000:11:00.0)")
    plan = plan_of(topo, 3)
    assert [r.gpu is None for r in plan.ranks] == [False, False, True]
    assert "local rank(s) 2 get no GPU" in plan.warnings[0]


def test_more_ranks_than_free_physical_cores():
    topo = synth(cores_per_node=4, smt=2)
    with pytest.raises(PlanError, match=r"nproc_per_node=5 needs one free physical core per rank but only 4 are free"):
        plan_of(topo, 5, "strict=true")
    plan = plan_of(topo, 5)
    assert any("ranks share physical cores" in w for w in plan.warnings)


def test_too_few_cores_for_two_hot_cores_per_rank_warns():
    topo = synth(cores_per_node=3)
    plan = plan_of(topo, 2)
    one_core = [r for r in plan.ranks if len(cores(topo, r.share())) == 1]
    assert one_core and plan.warnings
    r = one_core[0]
    assert r.cpus(MAIN) == r.cpus(NCCL) == r.cpus(PIN)
    assert any(f"local rank {r.local_rank} has one free physical core" in w for w in plan.warnings)


def test_unknown_gpu_index_is_an_error_naming_the_gpus():
    topo = synth(cores_per_node=8, gpu_nodes=(0,))
    with pytest.raises(PlanError, match=r"GPU index 5 for local rank 0 is not on this machine; GPUs: 0 \(0000:10:00.0\)"):
        plan_of(topo, 1, gpus=[5])


def test_crowded_node_hands_ranks_to_the_nearest_node():
    # A cpuset leaves node 0 one core; its two GPUs' ranks cannot both live there.
    topo = synth(packages=2, cores_per_node=4, gpu_nodes=(0, 0), allowed=frozenset({0, 4, 5, 6, 7}))
    plan = plan_of(topo, 2)
    nodes = node_of(topo)
    assert [{nodes[c] for c in r.share()} for r in plan.ranks] == [{0}, {1}]
    assert any("local rank 1 moved to node 1" in w for w in plan.warnings)


def test_memory_modes():
    topo = synth(packages=1, nodes_per_package=2, cores_per_node=4, gpu_nodes=(1,))
    assert plan_of(topo, 1).ranks[0].memory.nodes == [1]
    inter = plan_of(topo, 1, "memory=interleave").ranks[0].memory
    assert (inter.mode, inter.nodes) == ("interleave", [0, 1]), "both nodes of the package"
    assert plan_of(topo, 1, "memory=none").ranks[0].memory.nodes == []
    memless = synth(packages=2, cores_per_node=4, gpu_nodes=(1,), node_memory={1: 0})
    plan = plan_of(memless, 1)
    assert plan.ranks[0].memory.nodes == [0] and "have no memory" in plan.warnings[0]


def test_refused_membind_is_announced():
    topo = synth(cores_per_node=4)
    topo.kernel.membind_allowed = False
    plan = plan_of(topo, 1)
    assert plan.ranks[0].memory.mode == "bind"
    assert any("refuses membind" in w for w in plan.warnings)


def test_policy_none_binds_nothing():
    topo = synth(cores_per_node=4, gpu_nodes=(0,))
    plan = plan_of(topo, 1, "policy=none")
    r = plan.ranks[0]
    assert r.roles == {} and r.memory.mode == "none" and r.gpu.index == 0


def test_plan_json_round_trip_and_schema():
    plan = plan_of(dgx_h100_like(), 8)
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["schema"] == "placement.plan/1" and d["policy"] == "auto"
    assert set(d["ranks"][0]["roles"]) == {"main", "backward", "nccl", "pin_memory", "dataloader", "other"}
    assert d["ranks"][0]["gpu"] == {"index": 0, "pci": "0000:10:00.0"}
    again = Plan.from_dict(d)
    assert again.to_dict() == plan.to_dict()


def test_make_plan_is_pure(monkeypatch):
    topo = dgx_h100_like()
    cfg = load_config()

    def no_io(*a, **k):
        raise AssertionError(f"make_plan did I/O: {a!r}")

    for name in ("open", "listdir", "scandir", "stat", "sched_getaffinity"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, no_io)
    monkeypatch.setattr(builtins, "open", no_io)
    plan = make_plan(topo, JobSpec(8), cfg)
    monkeypatch.undo()
    assert len(plan.ranks) == 8
    assert make_plan(topo, JobSpec(8), cfg).to_dict() == plan.to_dict(), "same input, same plan"
