"""The one hand-off from placerun to its workers: one file (placement.handoff.Handoff) named by
one variable, written by the launcher and read by a worker as the same value; it holds the
config and the plan, whose ranks carry the cores of their share and each CPU's perf_rank, and
no topology: a worker under placerun neither reads nor discovers one, and its tuner works from
the plan alone.

The file is also the training script the placerun test runs.
"""
import json
import os
import sys

import pytest

from placement import launcher
from placement.config import load_config
from placement.handoff import FILE_NAME, PLAN_FILE_ENV, SCHEMA, Handoff, HandoffError, VirtualLocalRank
from placement.launcher import make_handoff, parse_placerun_args
from placement.plan.cores import share_cores
from placement.plan.model import Plan
from placement.plan.node import plan_for_node
from placement.topology import discover
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: its helpers, when this file runs as a rank's script

from placerun_helpers import run_self_under_placerun, write_facts

STEPS = 12


def node_plan(tmp_path, nproc=2):
    cfg = load_config([f"placement.monitor.log_dir={tmp_path / 'logs'}", "placement.strict=false",
                       "placement.tune.window=7"])
    topo, plan = plan_for_node(cfg, nproc)
    return cfg, topo, plan


def test_the_handoff_placerun_writes_is_the_one_a_worker_reads(tmp_path, monkeypatch):
    cfg, topo, plan = node_plan(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # set by the user before placerun: the plan's env leaves it
    monkeypatch.delenv(PLAN_FILE_ENV, raising=False)  # _hand_over sets it; monkeypatch puts it back
    before = {k for k in os.environ if k.startswith("PLACEMENT_")}
    pa = parse_placerun_args(["--nproc-per-node", "2", "--virtual-local-rank", "t.py"])
    sent = make_handoff(cfg, plan, pa.torch_args, environ={**os.environ, "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"})
    launcher._hand_over(str(tmp_path), sent)
    assert {k for k in os.environ if k.startswith("PLACEMENT_")} - before == {PLAN_FILE_ENV}  # one variable
    assert set(os.listdir(tmp_path)) - {"logs"} == {FILE_NAME}  # one file
    got = Handoff.load(os.environ)
    assert got == sent and got.config == cfg and got.plan == plan
    assert got.plan.to_dict() == plan.to_dict()
    assert got.keep_env == (("OMP_NUM_THREADS",) if any("OMP_NUM_THREADS" in r.env for r in plan.ranks) else ())
    assert got.virtual_local_rank == VirtualLocalRank(("GPU-a", "GPU-b"))
    assert got.local_rank({"CUDA_VISIBLE_DEVICES": "GPU-b"}) == 1
    with open(os.environ[PLAN_FILE_ENV]) as f:
        raw = json.load(f)
    assert raw["schema"] == SCHEMA and set(raw) == {"schema", "config", "plan", "keep_env", "virtual_local_rank"}
    assert "topology" not in json.dumps(raw)  # no topology, nor any part of one, travels
    for r in got.plan.ranks:  # each rank's cores and their perf_rank, as the topology gives them
        assert r.cores == share_cores(topo, r.share())
        assert frozenset().union(*(c.cpus for c in r.cores)) == r.share() & topo.usable()


def test_a_plan_without_cores_still_reads_and_a_bad_file_is_one_line(tmp_path):
    cfg, _, plan = node_plan(tmp_path)
    d = Handoff(cfg, plan).to_dict()
    for r in d["plan"]["ranks"]:
        del r["cores"]
    path = tmp_path / FILE_NAME
    path.write_text(json.dumps(d))
    assert all(r.cores == [] for r in Handoff.read(str(path)).plan.ranks)
    path.write_text(json.dumps(plan.to_dict()))  # a bare plan is not a hand-off
    with pytest.raises(HandoffError, match="is not a placement plan: schema 'placement.plan/1' is not 'placement.handoff/1'"):
        Handoff.read(str(path))


@pytest.mark.slow
def test_a_placerun_worker_tunes_from_the_plan_and_never_loads_a_topology(tmp_path):
    run_self_under_placerun(__file__, tmp_path)
    topo = discover()
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"facts{rank}.json").read_text())
        assert facts["loaded"] == []  # neither discovery nor Topology.from_dict ran in the worker
        assert facts["handoff_keys"] == ["config", "keep_env", "plan", "schema", "virtual_local_rank"]
        assert facts["old_env"] == [] and not facts["session_has_topology"]
        assert facts["tuner"]  # started, from the plan's cores ...
        plan = Plan.from_dict(facts["plan"])
        rank_plan = plan.for_local_rank(facts["local_rank"])
        want = share_cores(topo, rank_plan.share())  # ... which are the topology's, computed here
        assert facts["tuner_cores"] == sorted(sorted(c.cpus) for c in want)
        assert facts["tuner_bounds"] == sorted(rank_plan.share() & topo.usable())
        assert facts["tuner_perf"] == {str(c): r for core in want for c, r in core.perf_rank}
        assert facts["tuner_main"] == facts["binder_main"]  # the tuner reads where main is from the binder


def script(out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import placement
    import placement.topology
    from placement.topology.model import Topology

    loaded = []
    discover_module = sys.modules["placement.topology.discover"]
    real_discover, real_from_dict = discover_module.discover, Topology.from_dict.__func__

    def counted_discover(*a, **k):
        loaded.append("discover")
        return real_discover(*a, **k)

    def counted_from_dict(cls, d):
        loaded.append("Topology.from_dict")
        return real_from_dict(cls, d)

    placement.topology.discover = discover_module.discover = counted_discover
    Topology.from_dict = classmethod(counted_from_dict)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = placement.attach(model, opt, tune={"enabled": True, "window": 4}, monitor={"flush_every": 4})
    for _ in range(STEPS):
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
    tuner, s = h._tuner, h.session
    with open(os.environ[PLAN_FILE_ENV]) as f:
        handoff_keys = sorted(json.load(f))
    main = next(r for r in s.rank_plan.roles if r.value == "main")
    facts = {"loaded": loaded, "handoff_keys": handoff_keys, "local_rank": s.local_rank, "plan": s.plan.to_dict(),
             "old_env": [k for k in ("PLACEMENT_CONFIG_FILE", "PLACEMENT_TOPOLOGY_FILE", "PLACEMENT_KEEP_ENV",
                                     "PLACEMENT_VIRTUAL_LOCAL_RANK") if k in os.environ],
             "session_has_topology": hasattr(s, "topology"), "tuner": tuner is not None,
             "tuner_cores": None if tuner is None else sorted(sorted(c) for c in tuner.cores.cores),
             "tuner_bounds": None if tuner is None else sorted(tuner.layout.bounds),
             "tuner_perf": None if tuner is None else {str(c): r for c, r in tuner.cores.perf_rank.items()},
             "tuner_main": None if tuner is None else sorted(tuner.role_cpus(main)),
             "binder_main": sorted(s.binder.role_cpus(main))}
    h.close()
    write_facts(out_dir, rank, facts)
    dist.destroy_process_group()


if __name__ == "__main__":
    script(sys.argv[1])
