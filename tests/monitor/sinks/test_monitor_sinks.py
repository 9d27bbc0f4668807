"""The other sinks: the periodic one-line summary through logging, and TensorBoard scalars."""
import logging
import time

import pytest

import placement
from placement.records.step import line_steps, record_steps


def test_summary_line_every_n_steps(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="placement")
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 10, "flush_every": 5,
                                  "record_min_s": 0})  # a record a step: a line every 10
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
                                  "summary_every": 0, "record_min_s": 0})  # a record a step
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

    monitor.delivery.add_sink(Broken(), first=True)
    seen = []
    h.add_observer(lambda rec: seen.extend(record_steps(rec)))
    for _ in range(12):
        time.sleep(0.001)
        h.step()
    h.close()
    assert monitor.state is MonitorState.CLOSED and monitor.closed
    steps = [s for l in open(tmp_path / "rank0.jsonl") if '"type":"step"' in l.replace(" ", "")
             for s in line_steps(json.loads(l))]
    assert steps == list(range(1, 13)) and seen == list(range(1, 13))
    said = [r.getMessage() for r in caplog.records if "could not go to broken" in r.getMessage()]
    assert len(said) == 1 and "disk gone" in said[0]


def test_a_step_line_is_json_dumps_of_its_dict_for_every_kind_of_figure(tmp_path):
    """StepRecord.to_json is formatted by hand for speed: it must be json.dumps(to_dict()) for
    None, NaN, infinities, span counters, several roles, an unknown verdict word read back from
    a log, and roles shared by the steps between two readings (encoded once by the JSONL sink)."""
    import json
    import math

    from placement.events import open_rank_log
    from placement.monitor.sinks.jsonl import write_records
    from placement.records.step import RoleSample, StepRecord
    from placement.records.verdict import StepVerdict
    from placement.roles import ThreadRole

    shared = {ThreadRole.MAIN: RoleSample(threads=1, cpu_ms=9.25, runq_ms=None, cpus=[3]),
              ThreadRole.NCCL: RoleSample(threads=2, cpu_ms=math.nan, runq_ms=0.125, nivcsw=1.5, migrations=0.0,
                                          minflt=None, mhz=2900.5, cpus=[4, 5], span_steps=20)}
    recs = [StepRecord(0, 1, 1.8e9 + 0.123456, 10.5, 0.0, None, 0, shared, verdict=StepVerdict.CPU_BOUND),
            StepRecord(0, 2, 1.8e9 + 1.5, math.inf, 1.25, 3.5, 4, shared, comm_enter_t=1.8e9, probe_steps=2, run="r1",
                       placement_cpu_ms=0.0625),
            StepRecord(1, 3, 1.8e9 + 2.5, 7.0, -math.inf, 0.0, 0, {}, verdict="a-newer-word", local_rank=1,
                       placement_cpu_ms=math.nan),
            StepRecord(1, 4, 1.8e9 + 3.5, 7.0, 0.0, 1.0, 1, {ThreadRole.MAIN: RoleSample(threads=1, cpus=[])},
                       probe_steps=0),
            # a record of three steps (records/step.py), one of whose times is not finite
            StepRecord(1, 7, 1.8e9 + 4.5, 2.5, 0.5, 0.25, 6, shared, steps=3, each_ms=(2.0, 3.5, math.nan),
                       placement_cpu_ms=0.5)]

    def dumped(rec):
        d = rec.to_dict()
        text = json.dumps(d, separators=(",", ":"), allow_nan=True)
        return text.replace("NaN", "null").replace("-Infinity", "null").replace("Infinity", "null")

    for rec in recs:
        assert rec.to_json() == dumped(rec), rec
    events = open_rank_log(str(tmp_path), 0, "r1", 0)
    write_records(events, recs)
    events.close()
    lines = [line for line in (tmp_path / "rank0.jsonl").read_text().splitlines() if '"type":"step"' in line]
    assert lines == [dumped(r) for r in recs]


def test_the_exchange_window_takes_each_window_of_a_long_hand_over_in_turn():
    """A hand-over stretched by the budget holds tens of windows, taken one after the other: each
    take gives the figures of its steps alone (as from every record), a window's records are
    dropped once taken, and a record of a later window stays until its own take."""
    from placement.monitor.sinks.base import ExchangeWindow
    from placement.monitor.stragglers.figures import figures_from_records
    from placement.records.step import RoleSample, StepRecord

    recs = [StepRecord(rank=0, step=s, t=1e9 + s, step_ms=10.0 + s % 7, data_ms=1.0, comm_ms=2.0 + s % 3, comm_count=1,
                       roles={"main": RoleSample(threads=1, cpu_ms=5.0, runq_ms=float(s % 5), mhz=None)},
                       comm_enter_t=1e9 + s) for s in range(1, 101)]
    window = ExchangeWindow(0, lambda: True)
    window.write(recs)
    for first in range(1, 101, 20):
        assert window.take(first, first + 19) == figures_from_records(0, recs, first, first + 19)
        assert [r.step for r in window.records] == list(range(first + 20, 101))
