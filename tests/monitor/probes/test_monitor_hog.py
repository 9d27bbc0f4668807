"""A CPU hog pinned to the main thread's core for a known run of steps: the kernel's own
runqueue accounting, as the monitor records it per step, rises in exactly those steps. The
counters are read at every step boundary (monitor.budget_pct=0, in the hook): by default the
monitor thread reads them every few steps and a reading's wait is spread over its steps
(monitor/probes/sampled.py), which on a host busy with other work raises the steps around a
preempted one too."""
import os
import statistics
import time

import pytest

import placement
from hogs import spin_pinned, stop

HOG = range(21, 41)  # steps during which the hog runs
STEPS = 60
HOGS = 3  # busy loops on main's core
WORK_S = 0.004  # CPU seconds of work per step


def _work(cpu_seconds: float) -> None:
    """A training step's worth of CPU work (measured in this thread's CPU time)."""
    end = time.thread_time() + cpu_seconds
    x = 0
    while time.thread_time() < end:
        x += 1


@pytest.fixture
def pinned_main():
    """This thread on one core (the binder's job under a plan; done here so the test does not
    depend on the plan), restored after."""
    before = os.sched_getaffinity(0)
    core = sorted(before)[-1]
    os.sched_setaffinity(0, {core})
    yield core
    os.sched_setaffinity(0, before)


def test_main_runqueue_wait_rises_during_the_hog_and_falls_after(tmp_path, pinned_main):
    records = []
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "flush_every": 5, "summary_every": 0, "budget_pct": 0})
    h.add_observer(records.append)
    hogs: list[int] = []
    try:
        for step in range(1, STEPS + 1):
            if step == HOG.start:
                hogs = [spin_pinned(pinned_main) for _ in range(HOGS)]
            if step == HOG.stop:
                stop(hogs)
            _work(WORK_S)
            h.step()
    finally:
        stop(hogs)
        h.close()
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    runq = {r.step: r.roles["main"].runq_ms for r in records}
    assert all(r.roles["main"].cpus == [pinned_main] for r in records)
    before = statistics.median(runq[s] for s in range(5, HOG.start))
    during = statistics.median(runq[s] for s in HOG[1:])  # the hog starts during step 21
    after = statistics.median(runq[s] for s in range(HOG.stop + 1, STEPS + 1))
    # Sharing its core with HOGS busy loops, main waits about HOGS times as long as it runs,
    # on top of whatever else this machine runs there (hence a margin, not a ratio).
    margin = 1e3 * WORK_S
    assert during > max(before, after) + margin, (before, during, after)
    hog_steps = {r.step for r in records if r.verdict == "cpu-bound"}
    assert len(hog_steps & set(HOG)) > len(HOG) // 2
