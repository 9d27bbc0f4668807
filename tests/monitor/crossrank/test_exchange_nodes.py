"""The straggler exchange across "nodes": two placerun agents on torch elastic's c10d rendezvous,
two ranks each (4 processes), figures sent to rank 0 through the job's own c10d store. Rank 3,
on the second node, waits for its batches: rank 0 names it data-slow on node 1, nobody else,
and `placement report` over both nodes' logs says the same."""
import json

import pytest

from placement.cli import main as cli
from placerun_helpers import JOBS, free_port, launcher, start, text

pytestmark = pytest.mark.slow

STEPS = 60
SLOW_RANK = 3


def test_four_ranks_on_two_nodes_name_the_straggler_on_its_node(tmp_path, capsys):
    port = free_port()
    agents = []
    for node in (0, 1):
        cmd = [*launcher("placerun"), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "exchange-nodes", "--monitor-interval", "0.2",
               "placement.policy=none", "placement.tune.enabled=false", "placement.monitor.exchange_every=10",
               "placement.monitor.summary_every=0", f"placement.monitor.log_dir={tmp_path / f'logs-{node}'}",
               str(JOBS / "exchange_nodes.py"), str(STEPS), str(SLOW_RANK), "40"]
        agents.append((start(cmd, tmp_path / f"node{node}"), tmp_path / f"node{node}"))
    for proc, prefix in agents:
        assert proc.wait(timeout=300) == 0, text(prefix, "err")[-4000:]
    logs = {}
    for node in (0, 1):
        for f in (tmp_path / f"logs-{node}").glob("rank*.jsonl"):
            logs[int(f.stem[4:])] = [json.loads(l) for l in f.read_text().splitlines()]
    assert sorted(logs) == [0, 1, 2, 3]
    node_of = {r: next(e["node_rank"] for e in log if e["type"] == "start" and e.get("source") == "monitor")
               for r, log in logs.items()}
    assert node_of[0] == node_of[1] != node_of[2] == node_of[3]
    # One run id on every record of both agents' ranks: fixed by torch elastic's environment alone
    run_ids = {e.get("run") for log in logs.values() for e in log}
    assert len(run_ids) == 1 and None not in run_ids, run_ids
    events = [e for e in logs[0] if e["type"] == "straggler"]
    assert all(e["type"] != "straggler" for r in (1, 2, 3) for e in logs[r]), "only rank 0 judges"
    slow_windows = [e for e in events if e["steps"][0] > 10]
    named = [(s["kind"], s["ranks"]) for e in slow_windows for s in e["stragglers"]]
    # The windows of steps 11-20 .. 41-50 and, sent at close, 51-60 are judged; on this busy
    # 2-core machine allow one to be missed.
    assert named.count(("data-slow", [SLOW_RANK])) >= 3, named
    assert all(SLOW_RANK in ranks for _kind, ranks in named), named
    assert all(e["nodes"] == {str(SLOW_RANK): node_of[SLOW_RANK]} for e in slow_windows if e["stragglers"])
    # Every exchange judges all 4 ranks, except perhaps the two rank 0 judges at its close (the
    # exchange of step 60 and the steps after its window): it waits 2 s in all for their rows,
    # and on a busy 2-core machine a rank may not make it; then the event names who is missing.
    partial = [e for e in events if e["ranks_judged"] != 4]
    assert len(partial) <= 2, partial
    assert all(e.get("missing") and e["ranks_judged"] < 4 for e in partial), partial
    assert cli(["report", str(tmp_path / "logs-0"), str(tmp_path / "logs-1")]) == 0
    out = capsys.readouterr().out
    held = [l for l in out.splitlines() if l.strip().startswith("data-slow")]
    assert held and f"{SLOW_RANK} in " in held[0] and f"[node {node_of[SLOW_RANK]}" in held[0], out[-3000:]
