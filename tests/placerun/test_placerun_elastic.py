"""Beyond one machine, on torch elastic's own c10d rendezvous: two placerun agents on this
machine act as two nodes (one rank each), each placing its own rank from its own topology.
Killing one worker restarts the job (--max-restarts 1) with the same plan, and it finishes
with the exit codes torchrun gives for the same run."""
import json
import os
import signal

import pytest

from placement.cpuset import parse_cpulist
from placement.plan.model import Plan
from placerun_helpers import JOBS, free_port, launcher, start, text, wait_for

pytestmark = pytest.mark.slow


def two_nodes(tmp_path, name):
    """Start two agents of `name` (placerun or torchrun) as the two nodes of one job."""
    out = tmp_path / name
    out.mkdir()
    port = free_port()
    agents = []
    for node in (0, 1):
        extra = [f"placement.monitor.log_dir={tmp_path / f'logs-{node}'}"] if name == "placerun" else []
        cmd = [*launcher(name), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"{name}-elastic", "--max-restarts", "1",
               "--monitor-interval", "0.2", *extra, str(JOBS / "elastic.py"), str(out)]
        agents.append((start(cmd, tmp_path / f"{name}-node{node}"), tmp_path / f"{name}-node{node}"))
    return out, agents


def kill_rank1(out, agents):
    wait_for([out / "attempt0.rank0.json", out / "attempt0.rank1.json"], agents, timeout=180)
    victim = json.loads((out / "attempt0.rank1.json").read_text())
    (out / "killed").touch()
    os.kill(victim["pid"], signal.SIGKILL)


def test_two_agents_restart_with_the_same_plan_and_torchruns_exit_codes(tmp_path, monkeypatch):
    # Workers get their own TCPStore per attempt: with the store shared with the rendezvous (torch's
    # default), an agent whose workers did not fail restarts them under the old restart count and the
    # attempts' keys collide (pytorch/pytorch#135712). The same setting, and result, for both launchers.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    runs = {name: two_nodes(tmp_path, name) for name in ("placerun", "torchrun")}
    for out, agents in runs.values():
        kill_rank1(out, agents)
    codes = {name: [p.wait(timeout=180) for p, _ in agents] for name, (_, agents) in runs.items()}
    placerun_out, placerun_agents = runs["placerun"]
    assert codes["placerun"] == codes["torchrun"] == [0, 0], \
        [text(prefix, "err")[-3000:] for _, prefix in placerun_agents]

    for rank in (0, 1):
        before = json.loads((placerun_out / f"attempt0.rank{rank}.json").read_text())
        after = json.loads((placerun_out / f"attempt1.rank{rank}.json").read_text())
        assert after["pid"] != before["pid"]  # a new worker process
        # the plan was computed once per node, before the agent started, and reused
        assert after["plan"] == before["plan"] and after["plan_file"] == before["plan_file"]
        planned = Plan.from_dict(after["plan"]).for_local_rank(0).share()
        assert parse_cpulist(before["allowed"]) == parse_cpulist(after["allowed"])
        # main is narrowed to its own core by stage 2; it always lies inside the rank's share
        assert parse_cpulist(after["allowed"]) <= planned
    assert any(json.loads(p.read_text())["restart_count"] == 1 for p in placerun_out.glob("attempt1.*.json"))
    for node in (0, 1):  # each agent printed its own node's plan
        assert "main" in text(tmp_path / f"placerun-node{node}", "err")
