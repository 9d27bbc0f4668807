"""The last exchange window is judged at close: 2 real gloo ranks, an all_reduce per step, and
rank 1 waits for its data only in the steps after the last regular exchange window (which, at
step STEPS, carries steps up to STEPS - MAX_EVERY + 1). Those steps reach rank 0 only if every
rank sends them at close; rank 0 names rank 1 data-slow on them.

The file is also the worker: `python tests/monitor/crossrank/test_exchange_close.py LOG_DIR` with
RANK/WORLD_SIZE/MASTER_* in the environment runs one rank.
"""
from __future__ import annotations

import json
import sys
import time

import pytest

from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: its helpers, when this file runs as a rank's script

from placerun_helpers import close_and_exit, run_gloo_ranks

EVERY = 10
STEPS = 60
SLOW_FROM = 54  # rank 1 waits SLOW_MS for each batch from this step on
SLOW_MS = 30.0


@pytest.mark.slow
def test_the_steps_after_the_last_exchange_window_are_judged_at_close(tmp_path):
    from placement.monitor.crossrank.exchange import exchange_steps

    run_gloo_ranks(2, [__file__, str(tmp_path)], timeout=120)
    log = [json.loads(l) for l in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    events = [e for e in log if e["type"] == "straggler"]
    last_regular = exchange_steps(STEPS, EVERY)[1]
    assert last_regular < SLOW_FROM  # the slow steps are in no regular window
    final = [e for e in events if e["steps"] == [last_regular + 1, STEPS]]
    assert final, [e["steps"] for e in events]
    assert ("data-slow", [1]) in [(s["kind"], s["ranks"]) for s in final[0]["stragglers"]], final[0]
    assert final[0]["ranks_judged"] == 2
    # Nothing judged twice, and rank 1 named data-slow nowhere before it slowed down (a window
    # of real noise on this busy machine may name someone else).
    assert len({tuple(e["steps"]) for e in events}) == len(events)
    assert all(("data-slow", [1]) not in [(s["kind"], s["ranks"]) for s in e["stragglers"]]
               for e in events if e["steps"][1] < SLOW_FROM), events


class _Batches:
    def __init__(self, rank: int):
        import torch

        self.rank, self.step, self.x = rank, 0, torch.ones(64)

    def __iter__(self):
        return self

    def __next__(self):
        self.step += 1
        if self.rank == 1 and self.step >= SLOW_FROM:
            time.sleep(SLOW_MS / 1e3)
        return self.x


def worker(log_dir: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import placement

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    handle = placement.attach(policy="none", tune={"enabled": False},
                              monitor={"log_dir": log_dir, "exchange_every": EVERY, "flush_every": EVERY,
                                       "summary_every": 0,
                                       # the slow steps are in the last window alone: named on one window,
                                       # however steady (a noisy step before the slowdown is not what is tested)
                                       "straggler_confirm_windows": 1, "straggler_steady_pct": 0.0})
    data = handle.watch(_Batches(rank))
    dist.barrier()
    for _ in range(STEPS):
        x = next(data)
        time.sleep(0.005)
        dist.all_reduce(x)
        handle.step()
    close_and_exit(handle)


if __name__ == "__main__":
    worker(sys.argv[1])
