"""plan_for_node (discovery + CUDA_VISIBLE_DEVICES + make_plan) and `placement plan`."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from placement import cli
from placement.config import load_config
from placement.errors import PlanError
from placement.plan import format_plan_table, plan_for_node
from placement.roles import ThreadRole

from plan_checks import check_auto
from sysfs_builder import make_tree

ROLES = [r.value for r in ThreadRole]


@pytest.fixture(scope="module")
def dgx(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("dgx"), "dgx_h100")


def run_cli(capsys, *argv):
    rc = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------- plan_for_node


def test_live_machine_plan_uses_only_cpus_this_process_may_run_on():
    cfg = load_config(["strict=false"])  # a CI box may have a single core
    topo, plan = plan_for_node(cfg, 2, environ={})
    check_auto(topo, plan, cfg)
    allowed = os.sched_getaffinity(0)
    for r in plan.ranks:
        assert r.share() <= allowed
    shares = [r.share() for r in plan.ranks]
    if len(topo.groups("core", topo.usable())) >= 2:
        assert not shares[0] & shares[1], "two ranks on this machine get disjoint CPUs"


def test_dgx_fixture_eight_ranks_main_and_nccl_on_gpu_node_fastest_whole_disjoint(dgx):
    """The DGX H100-like fixture through real discovery (equal CPPC highest_perf on every core)."""
    cfg = load_config()
    topo, plan = plan_for_node(cfg, 8, root=dgx, environ={})
    check_auto(topo, plan, cfg)
    assert plan.warnings == []
    gpus = {g.index: g for g in topo.gpus}
    node_of = {c.id: c.numa for c in topo.cpus}
    hot_cores = set()
    for r in plan.ranks:
        gpu = gpus[r.gpu.index]
        assert r.gpu.index == r.local_rank
        for role in (ThreadRole.MAIN, ThreadRole.NCCL):
            (cpu,) = r.cpus(role)
            assert node_of[cpu] == gpu.numa
            core = next(c.core for c in topo.cpus if c.id == cpu)
            siblings = {c.id for c in topo.cpus if c.core == core}
            assert len(siblings) == 2
            assert not any(siblings & other.share() for other in plan.ranks if other is not r), "whole core"
            assert not siblings & (r.cpus(ThreadRole.OTHER) | r.cpus(ThreadRole.DATALOADER)), "whole core"
            hot_cores.add(core)
    assert len(hot_cores) == 16, "8 ranks x (main, nccl) on 16 distinct physical cores"


def test_gpu_nic_cross_node_fixture_puts_nccl_beside_the_nic(tmp_path):
    root = make_tree(tmp_path, "gpu_nic_cross_node")
    cfg = load_config()
    topo, plan = plan_for_node(cfg, 2, root=root, environ={})
    check_auto(topo, plan, cfg)
    node_of = {c.id: c.numa for c in topo.cpus}
    nic_node = next(n.numa for n in topo.nics if n.name == "mlx5_0")
    assert nic_node == 1
    for r in plan.ranks:
        assert {node_of[c] for c in r.cpus(ThreadRole.MAIN) | r.cpus(ThreadRole.PIN_MEMORY)} == {0}
        assert {node_of[c] for c in r.cpus(ThreadRole.NCCL)} == {1}
        assert "NIC mlx5_0" in r.roles[ThreadRole.NCCL].reason
        assert r.memory.nodes == [0]


def test_cuda_visible_devices_indices_and_uuids_pick_the_gpus(dgx):
    cfg = load_config()
    topo, plan = plan_for_node(cfg, 2, root=dgx, environ={"CUDA_VISIBLE_DEVICES": "6,1"})
    assert [r.gpu.index for r in plan.ranks] == [6, 1]
    node_of = {c.id: c.numa for c in topo.cpus}
    assert [node_of[min(r.cpus(ThreadRole.MAIN))] for r in plan.ranks] == [1, 0]
    uuid = next(g.uuid for g in topo.gpus if g.index == 3)
    if uuid:
        _, plan = plan_for_node(cfg, 1, root=dgx, environ={"CUDA_VISIBLE_DEVICES": uuid})
        assert plan.ranks[0].gpu.index == 3


def test_cuda_visible_devices_entry_matching_no_gpu(dgx):
    with pytest.raises(PlanError) as e:
        plan_for_node(load_config(["strict=true"]), 2, root=dgx, environ={"CUDA_VISIBLE_DEVICES": "0,GPU-deadbeef"})
    msg = str(e.value)
    assert msg.startswith("CUDA_VISIBLE_DEVICES entry 'GPU-deadbeef' (position 1 of '0,GPU-deadbeef') matches no GPU; GPUs: 0 (0000:18:00.0")
    assert "\n" not in msg
    _, plan = plan_for_node(load_config(["strict=false"]), 2, root=dgx,
                            environ={"CUDA_VISIBLE_DEVICES": "0,GPU-deadbeef"})
    assert [r.gpu and r.gpu.index for r in plan.ranks] == [0, None]
    assert "only the 1 GPU(s) before it are used" in plan.warnings[0]
    with pytest.raises(PlanError, match=r"entry '2' \(position 1 of '2,2'\) repeats GPU 2"):
        plan_for_node(load_config(["strict=true"]), 2, root=dgx, environ={"CUDA_VISIBLE_DEVICES": "2,2"})


def test_cuda_visible_devices_hiding_every_gpu_plans_cpu_ranks(dgx):
    _, plan = plan_for_node(load_config(), 2, root=dgx, environ={"CUDA_VISIBLE_DEVICES": "-1"})
    assert [r.gpu for r in plan.ranks] == [None, None]


def test_nproc_words(dgx, tmp_path):
    assert len(plan_for_node(load_config(), "gpu", root=dgx, environ={})[1].ranks) == 8
    assert len(plan_for_node(load_config(), "auto", root=dgx, environ={"CUDA_VISIBLE_DEVICES": "2,3"})[1].ranks) == 2
    small = make_tree(tmp_path, "small_cpu")
    assert len(plan_for_node(load_config(["smt=use", "strict=false"]), "auto", root=small, environ={})[1].ranks) == 16
    with pytest.raises(PlanError, match="nproc_per_node='gpu' but this machine shows no visible GPU"):
        plan_for_node(load_config(), "gpu", root=small, environ={})


def test_nccl_topo_file_from_config_reaches_discovery(dgx, tmp_path):
    missing = tmp_path / "no-such-topo.xml"
    with pytest.raises(Exception) as e:
        plan_for_node(load_config([f"nccl_topo_file={missing}"]), 1, root=dgx, environ={})
    assert str(missing) in str(e.value)


# ---------------------------------------------------------------- placement plan


def test_cli_json_is_the_plan_for_node_plan(capsys, dgx):
    rc, out, err = run_cli(capsys, "--root", dgx, "--nproc-per-node", "8", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["schema"] == "placement.plan/1" and doc["policy"] == "auto"
    assert [r["local_rank"] for r in doc["ranks"]] == list(range(8))
    assert all(sorted(r["roles"]) == sorted(ROLES) for r in doc["ranks"])
    assert doc == plan_for_node(load_config(), 8, root=dgx)[1].to_dict()


def test_cli_table_lists_every_rank_and_role_with_reasons(capsys, dgx):
    rc, out, _ = run_cli(capsys, "--root", dgx, "--nproc-per-node", "2", "placement.smt=use")
    assert rc == 0
    _, plan = plan_for_node(load_config(["smt=use"]), 2, root=dgx)
    assert out.strip() == format_plan_table(plan)
    lines = out.splitlines()
    assert lines[0] == "plan: policy auto, 2 local rank(s)"
    assert lines[1].split() == ["rank", "gpu", "numa", "memory", "role", "cpus", "reason"]
    assert sum(1 for line in lines if line.split()[:1] == ["0"]) == 1
    for r in plan.ranks:
        for role, a in r.roles.items():
            assert any(role.value in line and a.reason in line for line in lines)


def test_cli_policy_flag_and_overrides(capsys, dgx):
    rc, out, _ = run_cli(capsys, "--root", dgx, "--nproc-per-node", "2", "--policy", "exclusive", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["policy"] == "exclusive"
    assert len(doc["ranks"][0]["roles"]["main"]["cpus"]) == 28  # 56 cores / 4 GPUs on node 0, 2 threads


def test_cli_config_file(capsys, dgx, tmp_path):
    f = tmp_path / "placement.yaml"
    f.write_text("placement:\n  policy: node\n  memory: none\n")
    rc, out, _ = run_cli(capsys, "--root", dgx, "--placement-config", str(f), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["policy"] == "node" and doc["ranks"][0]["memory"] == {"mode": "none", "nodes": []}


@pytest.mark.parametrize("argv, message", [
    (["--policy", "bogus"], "placement.policy='bogus' is not valid; choose one of: auto, node, socket, exclusive, core-complex, none"),
    (["placement.smt=maybe"], "placement.smt='maybe' is not valid; choose one of: avoid, use"),
    (["placement.nosuch=1"], "unknown key placement.nosuch"),
    (["--nproc-per-node", "0"], "nproc_per_node='0' is not valid; valid: an integer >= 1, auto, gpu, cpu"),
    (["--nproc-per-node", "9", "placement.strict=true"], "nproc_per_node=9 but only 8 GPU(s) are visible: 0 (0000:18:00.0)"),
    (["placement.reserved_cpus=0-223", "placement.strict=true"], "placement.reserved_cpus='0-223' leaves no usable CPU (online and allowed: 0-223)"),
    (["--placement-config", "/no/such/file.yaml"], "cannot read placement config file '/no/such/file.yaml'"),
])
def test_cli_bad_input_is_one_line_exit_2(capsys, dgx, argv, message):
    rc, out, err = run_cli(capsys, "--root", dgx, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("placement plan: ")
    assert message in err


def test_cli_cuda_visible_devices_from_environment(capsys, dgx, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    rc, out, _ = run_cli(capsys, "--root", dgx, "--json")
    assert rc == 0 and json.loads(out)["ranks"][0]["gpu"]["index"] == 7
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "12")
    rc, _, err = run_cli(capsys, "--root", dgx, "placement.strict=true")
    assert rc == 2 and "CUDA_VISIBLE_DEVICES entry '12' (position 0 of '12') matches no GPU" in err


def test_console_script_runs_on_the_live_machine():
    exe = os.path.join(os.path.dirname(sys.executable), "placement")
    proc = subprocess.run([exe, "plan", "--nproc-per-node", "1", "--json"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc["ranks"][0]["roles"]["main"]["cpus"]) <= os.sched_getaffinity(0)


def test_placement_plan_prints_the_plan_placerun_applies(capsys):
    """Same arguments, same machine: `placement plan` and `placerun --dry-run` show one plan."""
    from placement import launcher

    overrides = ["placement.smt=use", "placement.strict=false"]
    assert cli.main(["plan", "--nproc-per-node", "2", *overrides]) == 0
    planned = capsys.readouterr().out
    assert launcher.main(["--dry-run", "--nproc-per-node", "2", *overrides, "examples/train_ddp.py"]) == 0
    dry_run = capsys.readouterr().out
    assert dry_run.startswith(planned), "placerun --dry-run prints the same plan table first"


def test_dgx_plan_table_shows_a_backward_role_per_rank_next_to_main(dgx, capsys):
    rc, out, _ = run_cli(capsys, "--root", dgx, "--nproc-per-node", "8")
    assert rc == 0
    rows = [line.split() for line in out.splitlines()]
    backward = [r for r in rows if len(r) > 1 and r[0] == "backward"]
    assert len(backward) == 8
    rc, out, _ = run_cli(capsys, "--root", dgx, "--nproc-per-node", "8", "--json")
    plan = json.loads(out)
    cpus = json.loads(subprocess.run([sys.executable, "-m", "placement.cli", "topo", "--root", dgx, "--json"],
                                     capture_output=True, text=True, check=True).stdout)["cpus"]
    core, l3 = {c["id"]: c["core"] for c in cpus}, {c["id"]: c["l3"] for c in cpus}
    for r in plan["ranks"]:
        main, bwd = r["roles"]["main"]["cpus"], r["roles"]["backward"]["cpus"]
        assert len(bwd) == 1 and core[bwd[0]] != core[main[0]] and l3[bwd[0]] == l3[main[0]]
        others = set(r["roles"]["nccl"]["cpus"]) | set(r["roles"]["other"]["cpus"])
        assert not {core[c] for c in bwd} & {core[c] for c in others}, "backward has a whole core of its own"
