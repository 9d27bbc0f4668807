"""Property tests: the plan rules hold on every topology with random rank counts, reserved sets
and knobs, and a PlanError is raised exactly when the job cannot be met under strict.

Topologies: random machine shapes built in code, the sysfs fixtures (tests/sysfs_builder.py,
through real discovery) and the real trees of ../shared (skipped when absent).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from placement.config import Policy, load_config
from placement.cpuset import format_cpulist
from placement.errors import PlanError
from placement.plan import JobSpec, make_plan
from placement.roles import ThreadRole
from placement.topology import discover

from plan_checks import check_auto, check_common, cores, node_of
from plan_topos import synth
from sysfs_builder import FIXTURES, make_tree, shared_trees

EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def machines(draw):
    packages = draw(st.integers(1, 2))
    nodes_per_package = draw(st.integers(1, 2))
    cores_per_node = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    l3 = draw(st.sampled_from([d for d in (1, 2, 3) if cores_per_node % d == 0]))
    smt = draw(st.integers(1, 2))
    nodes = packages * nodes_per_package
    total = nodes * cores_per_node
    gpu_nodes = tuple(draw(st.lists(st.integers(0, nodes - 1), max_size=6)))
    nic_nodes = tuple(draw(st.integers(0, nodes - 1)) for _ in gpu_nodes)
    levels = draw(st.lists(st.integers(0, 3), min_size=total, max_size=total))
    cpu_ids = list(range(total * smt))
    allowed = draw(st.one_of(st.none(), st.frozensets(st.sampled_from(cpu_ids), min_size=1)))
    return synth(packages=packages, nodes_per_package=nodes_per_package, cores_per_node=cores_per_node,
                 smt=smt, l3_per_node=l3, gpu_nodes=gpu_nodes, nic_nodes=nic_nodes,
                 perf=levels.__getitem__, allowed=allowed, gpu_numa_unknown=draw(st.booleans()))


def draw_config(data, topo, policy=None):
    ids = sorted(c.id for c in topo.cpus)
    reserved = data.draw(st.frozensets(st.sampled_from(ids), max_size=max(1, len(ids) // 4)), label="reserved")
    overrides = [
        f"policy={policy or data.draw(st.sampled_from(['auto'] * 3 + list(Policy.values())), label='policy')}",
        f"smt={data.draw(st.sampled_from(['avoid', 'use']), label='smt')}",
        f"prefer_fast_cores={data.draw(st.booleans(), label='prefer_fast')}",
        f"memory={data.draw(st.sampled_from(['bind', 'preferred', 'interleave', 'none']), label='memory')}",
        f"strict={data.draw(st.booleans(), label='strict')}",
        f"dataloader_workers={data.draw(st.integers(0, 4), label='workers')}",
    ]
    if reserved:  # an empty override value reads as null in OmegaConf: leave the default instead
        overrides.append(f"reserved_cpus={format_cpulist(reserved)}")
    return load_config(overrides)


def plan_and_check(topo, nproc: int, cfg) -> None:
    """Make the plan; check its rules, or that the PlanError was due (and only then)."""
    usable = topo.usable() - frozenset(int(c) for c in _ids(cfg.reserved_cpus))
    free_cores = len(cores(topo, usable))
    gpus = len(topo.gpus)
    short_gpus = gpus > 0 and nproc > gpus
    short_cores = cfg.policy == "auto" and nproc > free_cores
    nothing = not usable and cfg.policy != "none"
    due = short_gpus or (usable and short_cores) or nothing
    job = JobSpec(nproc, dataloader_workers=cfg.dataloader_workers)
    try:
        plan = make_plan(topo, job, cfg)
    except PlanError as e:
        message = str(e)
        # exclusive also fails, like torch, on a node with fewer physical cores than GPUs/ranks.
        assert cfg.strict and (due or message.startswith("policy exclusive: node")), f"unexpected PlanError: {e}"
        assert "\n" not in message and "placement.strict=false" in message
        if short_gpus:
            assert f"nproc_per_node={nproc} but only {gpus} GPU(s)" in message
        elif nothing:
            assert "leaves no usable CPU" in message
        elif short_cores:
            assert f"only {free_cores} are free" in message
        return
    assert not (cfg.strict and due), "a shortfall under strict must raise PlanError"
    assert [r.local_rank for r in plan.ranks] == list(range(nproc))
    if due and not cfg.strict:
        assert plan.warnings, "a degraded plan must say what it gave up"
    if cfg.policy == "auto":
        check_auto(topo, plan, cfg)
    elif cfg.policy == "none" or not usable:
        assert all(r.roles == {} for r in plan.ranks)
    else:
        check_common(topo, plan, cfg)
        check_process_level(topo, plan, cfg, usable)


def _ids(text: str):
    from placement.cpuset import parse_cpulist

    return parse_cpulist(text)


def check_process_level(topo, plan, cfg, usable) -> None:
    of_node = node_of(topo)
    for r in plan.ranks:
        cpus = r.cpus(ThreadRole.MAIN)
        assert all(r.cpus(role) == cpus for role in ThreadRole)
        nodes = {of_node[c] for c in cpus}
        if cfg.policy == "node":
            (node,) = nodes
            assert cpus == {c for c in usable if of_node[c] == node}, "node: every usable CPU of the node"
        elif cfg.policy in ("exclusive", "core-complex"):
            assert len(nodes) == 1, f"{cfg.policy}: one node per rank"
    if cfg.policy == "exclusive" and not plan.warnings:
        for a in plan.ranks:
            for b in plan.ranks:
                if a.local_rank < b.local_rank and (a.gpu is None) == (b.gpu is None):
                    assert not a.share() & b.share() or a.gpu == b.gpu, "exclusive slices do not overlap"


@EXAMPLES
@given(topo=machines(), data=st.data())
def test_random_machines(topo, data):
    total_cores = len(cores(topo, topo.usable())) or 1
    nproc = data.draw(st.integers(1, total_cores + 2), label="nproc")
    plan_and_check(topo, nproc, draw_config(data, topo))


@pytest.fixture(scope="module")
def fixture_topologies(tmp_path_factory):
    base = tmp_path_factory.mktemp("plan-fixtures")
    return {name: discover(make_tree(base, name)) for name in FIXTURES}


@EXAMPLES
@given(data=st.data())
def test_fixture_trees(fixture_topologies, data):
    name = data.draw(st.sampled_from(sorted(fixture_topologies)), label="fixture")
    topo = fixture_topologies[name]
    nproc = data.draw(st.integers(1, max(len(topo.gpus), 4) + 1), label="nproc")
    plan_and_check(topo, nproc, draw_config(data, topo))


@pytest.fixture(scope="module")
def shared_topologies():
    return {root: discover(root) for root in shared_trees()}


@pytest.mark.slow  # reads the real machines' trees (extracted from their tarballs)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_shared_real_trees(shared_topologies, data):
    root = data.draw(st.sampled_from(sorted(shared_topologies)), label="tree")
    topo = shared_topologies[root]
    total = len(cores(topo, topo.usable())) or 1
    nproc = data.draw(st.integers(1, total + 1), label="nproc")
    plan_and_check(topo, nproc, draw_config(data, topo))
