"""Records paced in time (monitor.record_min_s, monitor/build.py): at short steps a record holds
the fewest steps, a divisor of exchange_every, that cover record_min_s; it ends at an observer's
window end too, never across one nor across an exchange window; every step is in one record,
in order, each step's own time kept."""
import json
import time

import pytest

import placement
from placement.records.step import line_steps

STEP_NS = 5_000_000  # the stamped steps' length: 5 ms
STEPS = 400


def _run(tmp_path, window: int, **monitor) -> tuple[list[dict], list[tuple[int, int, int]], int]:
    """Steps STEP_NS apart by their own stamps, an observer judging windows of `window` steps:
    the step lines written, the records the observer saw (first step, last step, steps), and
    the steps a record held at the end."""
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0, **monitor})
    seen = []
    h.add_observer(lambda rec: seen.append((rec.step - rec.steps + 1, rec.step, rec.steps)),
                   lambda after: (after // window + 1) * window)
    t0 = time.perf_counter_ns()
    for i in range(1, STEPS + 1):
        h.monitor.on_step(at=t0 + i * STEP_NS)
    group = h.monitor.builder.group
    h.close()
    lines = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()
             if '"type":"step"' in line]
    return lines, seen, group


def test_short_steps_share_a_record_that_never_crosses_a_window_and_keeps_each_steps_time(tmp_path):
    lines, seen, group = _run(tmp_path, window=7, record_min_s=0.025)
    # 5 ms steps: the fewest steps dividing exchange_every (20) that cover 25 ms
    assert group == 5
    steps = [s for d in lines for s in line_steps(d)]
    assert steps == list(range(1, STEPS + 1))  # every step once, in order
    assert [(d["step"] - d.get("steps", 1) + 1, d["step"], d.get("steps", 1)) for d in lines] == seen
    for d in lines:
        first, last, n = d["step"] - d.get("steps", 1) + 1, d["step"], d.get("steps", 1)
        assert n <= group
        # never across a group boundary, an observer's window end (7) or an exchange window (20)
        assert all(s % 7 and s % 20 and s % group for s in range(first, last)), d
        each = d.get("each_ms", [d["step_ms"]])
        # (step 1 is timed from attach, not from the first stamp)
        assert len(each) == n and all(ms == pytest.approx(5.0, abs=1e-6) for s, ms in zip(range(first, last + 1), each)
                                      if s > 1)
        assert d["step_ms"] == pytest.approx(sum(each) / n)
    # most records hold several steps once the step time is known (the first hand-over's are one each)
    assert sum(d.get("steps", 1) > 1 for d in lines) > 0.8 * len(lines)
    assert len(lines) < STEPS / 2


def test_a_record_a_step_at_zero_and_at_a_budget_of_zero(tmp_path):
    for i, monitor in enumerate(({"record_min_s": 0}, {"budget_pct": 0})):
        lines, _, group = _run(tmp_path / str(i), window=7, **monitor)
        assert group == 1 and [d["step"] for d in lines] == list(range(1, STEPS + 1))
        assert not any("steps" in d or "each_ms" in d for d in lines)


def test_a_record_covers_record_min_s_times_the_paced_floors_scale():
    """While the budget stretches the monitor's paced floor (probes/budget.py PacedFloor), a record
    covers record_min_s x its scale: the fewest steps, a divisor of exchange_every (20), that do."""
    h = placement.attach(policy="none", tune={"enabled": False}, monitor={"summary_every": 0, "record_min_s": 0.1})
    builder = h.monitor.builder
    got = []
    for step_ms, scale in [(10.0, 1), (10.0, 2), (40.0, 1), (40.0, 2), (40.0, 8), (2.0, 1)]:
        builder.pace(step_ms, scale)
        got.append(builder.group)
    h.close()
    assert got == [10, 20, 4, 5, 20, 20]


@pytest.mark.parametrize("value", [-0.1, 61.0])
def test_record_min_s_out_of_range_is_refused_with_its_range(value):
    from placement.errors import ConfigError

    with pytest.raises(ConfigError, match=r"monitor.record_min_s=.* is out of range; valid: \[0.0, 60.0\]"):
        placement.attach(policy="none", monitor={"record_min_s": value})


def test_the_last_records_steps_are_written_at_close_when_every_step_was_handed_over(tmp_path):
    """Close right after a hand-over of every step: the last group (steps 41-45 of 20-step
    records) was built but not whole; close writes it as it is."""
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0, "flush_every": 5,
                                  "handover_min_s": 0, "record_min_s": 0.02})
    t0 = time.perf_counter_ns()
    for i in range(1, 46):
        h.monitor.on_step(at=t0 + i * 1_000_000)  # 1 ms steps: 20 a record
    h.close()
    lines = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()
             if '"type":"step"' in line]
    assert [s for d in lines for s in line_steps(d)] == list(range(1, 46))
    assert lines[-1]["step"] == 45 and lines[-1].get("steps", 1) <= 5
