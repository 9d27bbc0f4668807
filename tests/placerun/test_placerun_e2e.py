"""placerun end to end: 2 real ranks on gloo with real DataLoader workers, read from /proc while
they run: every thread and worker process on exactly the planned CPUs, memory policy as planned
(or as the logged fallback), and the plan applied is the plan `placement plan` computes."""
import json
import os
import time

import pytest
import torch

from placement.config import load_config
from placement.plan import plan_for_node
from placement.plan.model import Plan
from placement.roles import ThreadRole, role_of
from placerun_helpers import (JOBS, allowed, children, comm, launcher, memory_policy, start, text, tids,
                              wait_for)

pytestmark = pytest.mark.slow


def expected_sets(rank_plan):
    """Role -> the CPUs its threads must show. A role without a set is left on the stage-1 mask."""
    return {role: rank_plan.cpus(role) or rank_plan.share() for role in ThreadRole}


def observe(pid, sets):
    """{(pid, tid): (comm, role, allowed, expected)} for the rank process and its DataLoader workers."""
    seen = {}
    for tid in tids(pid):
        name = comm(pid, tid)
        role = role_of(name or "", is_main_thread=(tid == pid))
        seen[(pid, tid)] = (name, role.value, allowed(pid, tid), sets[role])
    for child in children(pid):
        if (comm(child) or "").startswith("pt_data_worker"):
            for tid in tids(child):
                seen[(child, tid)] = (comm(child, tid), "dataloader", allowed(child, tid), sets[ThreadRole.DATALOADER])
    return {k: v for k, v in seen.items() if v[2] is not None}  # drop threads that ended meanwhile


def test_two_ranks_run_on_exactly_the_planned_cpus(tmp_path):
    seen = run_and_check(tmp_path, nproc=2, backend="gloo")
    for rank, (_, threads) in seen.items():
        assert {"main", "other", "dataloader"} <= {v[1] for v in threads.values()}


needs_gpus = pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                                reason="needs a CUDA GPU and NCCL")


@pytest.mark.gpu
@needs_gpus
def test_nccl_threads_and_main_on_their_own_cores(tmp_path):
    """NCCL starts its proxy threads at the first collective, with the caller's mask: the binder
    then moves them to the nccl set and narrows main to its own core."""
    seen = run_and_check(tmp_path, nproc=1, backend="nccl")
    for _, threads in seen.values():
        assert "nccl" in {v[1] for v in threads.values()}


def test_numa_binding_node_runs_with_each_rank_inside_torchs_set(tmp_path):
    """`placerun --numa-binding node`, a flag torchrun takes: it runs, one line says placement binds
    inside torch's node sets, and every thread read from /proc sits inside the set policy `node`
    gives its rank (the sets test_plan_torch checks against torch's own function)."""
    seen = run_and_check(tmp_path, nproc=2, backend="gloo", numa_binding="node")
    _, node_plan = plan_for_node(load_config(["policy=node"]), 2)
    for rank, (rank_plan, threads) in seen.items():
        envelope = node_plan.for_local_rank(rank_plan.local_rank).share()
        assert rank_plan.share() <= envelope
        assert all(v[2] <= envelope for v in threads.values()), threads
    err = text(tmp_path / "placerun", "err")
    assert [line for line in err.splitlines() if "--numa-binding=node: placement binds each rank inside" in line]


def run_and_check(tmp_path, nproc, backend, numa_binding=None):
    """Launch hold.py under placerun, check every thread from /proc while it runs; returns
    {rank: (rank_plan, observed threads)}."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    override = f"placement.monitor.log_dir={logs}"
    torch_flags = [] if numa_binding is None else ["--numa-binding", numa_binding]
    cmd = [*launcher("placerun"), "--standalone", "--nproc-per-node", str(nproc), *torch_flags, override,
           str(JOBS / "hold.py"), str(out), backend]
    proc = start(cmd, tmp_path / "placerun")
    ranks = range(nproc)
    try:
        wait_for([out / f"rank{r}.json" for r in ranks], [(proc, tmp_path / "placerun")])
        reports = [json.loads((out / f"rank{r}.json").read_text()) for r in ranks]
        _, plan = plan_for_node(load_config([override]), nproc, within=numa_binding)
        for report in reports:
            assert report["plan"] == plan.to_dict()  # what workers got is what `placement plan` prints
        applied = {}
        for report in reports:
            rank_plan = Plan.from_dict(report["plan"]).for_local_rank(report["local_rank"])
            sets = expected_sets(rank_plan)
            deadline = time.monotonic() + 30  # the watcher rescans every second
            while True:
                seen = observe(report["pid"], sets)
                wrong = {k: v for k, v in seen.items() if v[2] != v[3]}
                if not wrong or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert not wrong, f"rank {report['rank']}: threads off their planned CPUs: {wrong}"
            workers = {k[0] for k, v in seen.items() if v[1] == "dataloader"}
            assert len(workers) == 2
            applied[report["rank"]] = (rank_plan, seen)
        if nproc == 2 and len(os.sched_getaffinity(0)) >= 2:  # ranks on one node do not overlap
            assert applied[0][0].share().isdisjoint(applied[1][0].share())

        for rank, (rank_plan, seen) in applied.items():
            # The rank's log is flushed by the watcher once a second: wait for stage 1's event.
            deadline = time.monotonic() + 30
            while True:
                memory = [json.loads(line) for line in open(logs / f"rank{rank}.jsonl")]
                found = [e for e in memory if e["type"] == "memory"]
                if found or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            (event,) = found
            planned = (rank_plan.memory.mode, sorted(rank_plan.memory.nodes))
            assert (event["planned"]["mode"], event["planned"]["nodes"]) == planned
            want = planned if event["fallback"] is None else (event["applied"]["mode"], event["applied"]["nodes"])
            for pid, tid in seen:  # every thread of the rank and of its workers
                assert memory_policy(pid, tid) == want, (pid, tid, comm(pid, tid))
    finally:
        (out / "done").touch()
        rc = proc.wait(timeout=120)
    assert rc == 0, text(tmp_path / "placerun", "err")[-4000:]

    err = text(tmp_path / "placerun", "err")
    assert "main" in err and "dataloader" in err  # the plan table, printed at start
    for rank in ranks:
        events = [json.loads(line) for line in open(logs / f"rank{rank}.jsonl")]
        kinds = [e["type"] for e in events]
        assert kinds[0] == "start" and kinds[-1] == "end" and "bind" in kinds
        assert all(e["ok"] for e in events if e["type"] == "bind"), [e for e in events if e["type"] == "bind"]
        # a container may refuse the memory policy (logged, checked above), and hold.py steps no
        # optimizer (the automatic monitor says so once); nothing else may warn
        assert not [e for e in events if e["type"] == "warning" and not e["message"].startswith("memory policy")
                    and not e["message"].startswith("no optimizer step ran")]
    return applied
