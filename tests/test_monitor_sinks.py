"""The other sinks: the periodic one-line summary through logging, and TensorBoard scalars."""
import logging
import time

import pytest

import placement


def test_summary_line_every_n_steps(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="placement")
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 10, "flush_every": 5})
    for _ in range(20):
        time.sleep(0.002)
        h.step()
    h.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("placement rank 0 steps")]
    assert [l.split(":")[0] for l in lines] == ["placement rank 0 steps 1-10", "placement rank 0 steps 11-20"]
    assert all("step p50" in l and "CPU stall" in l and "comm" in l and "data" in l for l in lines)


def test_tensorboard_scalars_per_flushed_batch(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "tensorboard": True, "flush_every": 5,
                                  "summary_every": 0})
    for _ in range(15):
        time.sleep(0.003)
        h.step()
    h.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "rank0"))
    acc.Reload()
    assert "placement/step_ms" in acc.Tags()["scalars"]
    points = acc.Scalars("placement/step_ms")
    assert [p.step for p in points] == [5, 10, 15]
    assert all(p.value >= 3.0 for p in points)
