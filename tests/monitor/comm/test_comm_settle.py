"""NCCL comm time against the truth, with the flight recorder's real cadence (tests/
nccl_recorder_standins.StandInRecorder: durations written by a watchdog every 100 ms, dumps that show
"completed" before that, a GPU queue behind the CPU, a ring that wraps): never short, null only
when it cannot be known, for steps far shorter and far longer than the watchdog's period.
On the code before settlement by evidence (a fixed 2-step lag, "completed" taken as settled)
the 2 ms and GPU-lag cases came out short on most steps."""
from __future__ import annotations

import pytest

from nccl_recorder_standins import run_standin_job


@pytest.mark.slow
@pytest.mark.parametrize("step_ms,steps,lag", [(2.0, 400, 0), (20.0, 60, 0), (2.0, 400, 3), (20.0, 60, 3)],
                         ids=["2ms", "20ms", "2ms-gpu-3-behind", "20ms-gpu-3-behind"])
def test_comm_time_is_the_truth_or_null_never_short(tmp_path, step_ms, steps, lag):
    job = run_standin_job(str(tmp_path), step_ms=step_ms, steps=steps, gpu_lag_steps=lag)
    assert job.wrong() == [], (job.wrong()[:10], job.stats)
    # Null only where the truth was not there yet at exit: the steps whose collectives the
    # watchdog had not retired when the job closed (the GPU's lag, and one watchdog period).
    tail = lag + 1 + int(100 / step_ms) + 1
    assert job.nulls(last=steps - tail) == [], (job.nulls()[:10], job.stats)
    assert job.stats["comm_unsettled"] <= tail if "comm_unsettled" in job.stats else True


@pytest.mark.slow
def test_long_steps_are_built_once_their_collectives_settle(tmp_path):
    """500 ms steps, flush every 2 steps: each step waits for the watchdog's retire (100 ms on)
    and is then built whole, not at a fixed lag."""
    job = run_standin_job(str(tmp_path), step_ms=500.0, steps=6, flush_every=2)
    assert job.wrong() == [] and job.nulls(last=5) == [], (job.got, job.stats)


@pytest.mark.slow
def test_a_tensor_parallel_step_of_3000_collectives_fits_the_ring_placement_asks_for(tmp_path):
    """TP=8 with sequence parallelism: thousands of collectives a step. torch's default ring
    (2,000) wraps within one step's burst, so every step is null (never short), and said;
    placement's ring (10,000, nccl_env.PLACEMENT_RING) holds three such steps between polls."""
    from placement.bind.nccl_env import PLACEMENT_RING

    kw = dict(step_ms=1000.0, steps=4, per_step=3000, gpu_ms=0.005)
    small = run_standin_job(str(tmp_path / "default"), ring=2000, **kw)
    assert small.stats["overflow"] > 0 and small.wrong() == []
    assert small.nulls(last=3) == [1, 2, 3], small.got
    big = run_standin_job(str(tmp_path / "placement"), ring=PLACEMENT_RING, **kw)
    assert big.stats["overflow"] == 0 and big.wrong() == [], big.stats
    assert big.nulls(last=3) == [], (big.got, big.stats)
