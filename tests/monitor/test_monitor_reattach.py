"""close() then attach() again on one DDP model (a new phase of training): DDP comm hooks
cannot be removed nor registered twice, so the one placement hook follows the current
attach; the closed monitor's clock keeps nothing. (A one-rank world, so its buckets are timed
only when asked: monitor.comm_timing=wall.)"""
import json

import torch

import placement


def _phase(ddp, opt, log_dir, steps=4):
    h = placement.attach(ddp, opt, policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(log_dir), "summary_every": 0, "comm_timing": "wall"})
    x = torch.randn(16, 32)
    for _ in range(steps):
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    h.close()
    lines = [json.loads(l) for l in open(log_dir / "rank0.jsonl")]
    return h, [l for l in lines if l["type"] == "step"], next(l for l in lines if l["type"] == "start")


def test_attach_close_attach_on_one_ddp_model_keeps_comm_timing(tmp_path, gloo_world_of_one):
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    h1, first, start1 = _phase(ddp, opt, tmp_path / "one")
    h2, second, start2 = _phase(ddp, opt, tmp_path / "two")
    assert start1["ddp_hook"] is True and start2["ddp_hook"] is True
    assert len(second) == 4
    assert all(s["comm_count"] >= 1 and s["comm_inflight_ms"] > 0 for s in first + second), second
    assert [s["comm_count"] for s in second] == [s["comm_count"] for s in first]
    # the first monitor's clock, closed, kept none of the second phase's collectives
    old = h1.monitor.comm.clock
    assert old.closed and old._intervals == []
