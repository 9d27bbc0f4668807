"""The step hook's cost budget: when reading the kernel counters every step costs more than
monitor.budget_pct of the step, they are read every k-th step, and each step of the k gets
their per-step mean; the means still add up to the kernel's own accounting."""
import json
import time

import pytest

import placement
from placement.errors import ConfigError
from placement.monitor.probes.budget import AIM, MAX_EVERY, ProbeBudget


def test_budget_reads_less_often_when_over_and_more_often_when_well_under():
    b = ProbeBudget(budget_pct=0.3)  # 30 us of a 10 ms step; the hook's own figure aims at 18 us
    assert AIM * 30.0 == pytest.approx(18.0)
    assert b.update(hook_us_per_step=15.0, step_ms=10.0) is None and b.every == 1  # inside the aim
    assert b.update(hook_us_per_step=27.0, step_ms=10.0) == 2  # 1.5x over the aim: every 2nd step
    assert b.update(hook_us_per_step=15.0, step_ms=10.0) is None  # 15 * 2 / 1 = 30 > 14.4: stays
    assert b.update(hook_us_per_step=7.0, step_ms=10.0) == 1  # 7 * 2 = 14 < 14.4: back to every step
    assert b.update(hook_us_per_step=25.0, step_ms=10.0) == 2  # over the aim though under the budget
    assert b.update(hook_us_per_step=300.0, step_ms=1.0) == MAX_EVERY  # 100x over: capped
    assert b.over(hook_us_per_step=300.0, step_ms=1.0)
    assert not b.over(hook_us_per_step=2.0, step_ms=1.0)


def test_zero_budget_reads_every_step_whatever_it_costs():
    b = ProbeBudget(budget_pct=0.0)
    assert b.update(hook_us_per_step=1e6, step_ms=1.0) is None and b.every == 1
    assert not b.over(hook_us_per_step=1e6, step_ms=1.0)


def test_budget_out_of_range_is_one_line_naming_the_range():
    with pytest.raises(ConfigError) as e:
        placement.attach(policy="none", monitor={"budget_pct": 150})
    assert "placement.monitor.budget_pct=150" in str(e.value) and "[0.0, 100.0]" in str(e.value)


def _step(cpu_s: float, wait_s: float) -> None:
    """Some CPU work, then a wait that releases the GIL (as a GPU rank's sync or data wait does)."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass
    time.sleep(wait_s)


def _run(tmp_path, budget_pct: float, steps: int = 120):
    """Steps of about 1 ms: the hook's few tens of us are far over a 0.01% budget."""
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0, "budget_pct": budget_pct})
    cpu0 = time.thread_time_ns()
    for _ in range(steps):
        _step(0.0005, 0.0005)
        h.step()
    cpu_ms = (time.thread_time_ns() - cpu0) / 1e6
    h.close()
    lines = [json.loads(l) for l in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    return [l for l in lines if l["type"] == "step"], [l for l in lines if l["type"] == "monitor"], cpu_ms


def test_tight_budget_spreads_each_reading_over_its_steps_and_the_sum_still_holds(tmp_path):
    steps, events, cpu_ms = _run(tmp_path, budget_pct=0.01)  # 0.1 us of a 1 ms step
    assert [s["step"] for s in steps] == list(range(1, 121))
    assert events and events[0]["probe_every"] > 1 and "budget_pct" in events[0]["message"]
    spread = [s for s in steps if s["probe_steps"] > 1]
    assert len(spread) > len(steps) // 2
    # Steps read together carry the same per-step means, one reading spread over probe_steps.
    i = 0
    while i < len(steps):
        k = steps[i]["probe_steps"]
        assert k >= 1
        group = steps[i:i + k]
        assert all(s["probe_steps"] == k for s in group)
        assert len({(s["roles"]["main"]["cpu_ms"], s["roles"]["main"]["runq_ms"]) for s in group}) == 1
        i += k
    # The spread means add up to the thread's CPU time as the kernel counts it (within a
    # step: the first record's delta starts at attach, the loop's clock a moment later).
    total = sum(s["roles"]["main"]["cpu_ms"] for s in steps)
    assert abs(total - cpu_ms) < 2.0, (total, cpu_ms)


def test_no_budget_reads_every_step(tmp_path):
    steps, events, _ = _run(tmp_path, budget_pct=0.0, steps=40)
    assert not events
    assert all(s["probe_steps"] == 1 and s["roles"]["main"]["cpu_ms"] is not None for s in steps)


def test_a_main_thread_that_never_lets_go_of_the_gil_keeps_the_backlog_bounded(tmp_path):
    """Pure-Python steps starve the monitor thread of the GIL; the training thread then
    builds the waiting batches itself, so they never pile up, and every step is written."""
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0, "flush_every": 1})
    most = 0
    for _ in range(300):
        _step(0.0003, 0.0)
        h.step()
        most = max(most, len(h.monitor._handed))
    h.close()
    assert most <= 8  # a few batches waiting at most (300 steps: up to 300 without the fallback)
    steps = [json.loads(l) for l in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if s["type"] == "step"] == list(range(1, 301))
