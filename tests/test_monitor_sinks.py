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


def test_a_failing_output_is_said_once_and_the_others_still_get_every_record(tmp_path, caplog):
    """The monitor's outputs are sinks (monitor/sinks/base.py): one that raises (here TensorBoard's
    writer) costs its own output, not the log's nor the observers'."""
    import json

    from placement.monitor.step_monitor import MonitorState

    caplog.set_level(logging.WARNING)
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "flush_every": 5, "summary_every": 0})
    monitor = h.monitor
    assert monitor.state is MonitorState.RUNNING

    class Broken:
        name = "broken"

        def write(self, batch):
            raise OSError("disk gone")

        def close(self):
            pass

    monitor.sinks.insert(0, Broken())
    seen = []
    h.add_observer(lambda rec: seen.append(rec.step))
    for _ in range(12):
        time.sleep(0.001)
        h.step()
    h.close()
    assert monitor.state is MonitorState.CLOSED and monitor.closed
    steps = [json.loads(l)["step"] for l in open(tmp_path / "rank0.jsonl") if '"type":"step"' in l.replace(" ", "")]
    assert steps == list(range(1, 13)) and seen == list(range(1, 13))
    said = [r.getMessage() for r in caplog.records if "could not go to broken" in r.getMessage()]
    assert len(said) == 1 and "disk gone" in said[0]
