"""The step hook's cost budget: when reading the kernel counters every step costs more than
monitor.budget_pct of the step, they are read every k-th step, and each step of the k gets
their per-step mean; the means still add up to the kernel's own accounting."""
import json
import math
import random
import threading
import time

import pytest

import placement
from placement.records.step import line_steps
from placement.errors import ConfigError
from placement.roles import OWN_THREADS
from placement.monitor.step_monitor import read_at_hand_over
from placement.monitor.probes.budget import (AIM, FLOOR_DOWN_BELOW, FLOOR_JUDGE_S, FLOOR_MAX_HOLD_S, JUDGED,
                                              LOWER_BELOW, MAX_EVERY, MAX_PERIOD_S, MIN_HOLD_STEPS, NEAR_CAP, STRETCH,
                                              CostRate, PacedFloor, ProbeBudget, floor_scales, max_every)


def test_budget_reads_less_often_when_over_and_more_often_when_well_under():
    b = ProbeBudget(budget_pct=0.3)  # 30 us of a 10 ms step; the hook's own figure aims at 18 us
    assert AIM * 30.0 == pytest.approx(18.0)
    assert b.update(hook_us_per_step=15.0, step_ms=10.0, step=20) is None and b.every == 1  # inside the aim
    assert b.update(hook_us_per_step=27.0, step_ms=10.0, step=40) == 2  # median 21 > 18: every 2nd step
    step = 40
    for _ in range(JUDGED):  # 15 * 2 / 1 = 30 > 14.4: stays, however long
        step += 20
        assert b.update(hook_us_per_step=15.0, step_ms=10.0, step=step) is None
    # 7 * 2 = 14 < 14.4: back to every step, once JUDGED batches at k = 2 say so and the hold is over
    changes = [b.update(hook_us_per_step=7.0, step_ms=10.0, step=step + 20 * i) for i in range(1, JUDGED + 1)]
    assert [c for c in changes if c is not None] == [1]
    assert b.hold_steps == 2 * MIN_HOLD_STEPS  # a reversal: the next change waits twice as long
    assert b.update(hook_us_per_step=300.0, step_ms=1.0, step=step + 20 * JUDGED + 1) is None  # held
    step += 20 * JUDGED + 2 * MIN_HOLD_STEPS
    assert b.update(hook_us_per_step=300.0, step_ms=1.0, step=step) > MAX_EVERY  # the overshoot, in one change
    assert not b.over(step_ms=1.0)  # not yet at its cap
    while b.every < max_every(1.0):
        step += b.hold_steps
        assert b.update(hook_us_per_step=300.0, step_ms=1.0, step=step) is not None
    assert not b.over(step_ms=1.0)  # at its cap, and no batch judged there yet
    for _ in range(JUDGED - 1):
        step += 20
        assert b.update(hook_us_per_step=300.0, step_ms=1.0, step=step) is None
    assert not b.over(step_ms=1.0)  # one batch short of JUDGED: one busy window does not say so
    step += 20
    assert b.update(hook_us_per_step=300.0, step_ms=1.0, step=step) is None and b.over(step_ms=1.0)
    assert b.judged_us() == 300.0


def test_the_cap_is_half_a_second_of_short_steps_and_follows_the_steps_when_they_grow():
    # at 50 ms or more the cap is MAX_EVERY steps; below, MAX_PERIOD_S of them
    assert max_every(50.0) == max_every(100.0) == MAX_EVERY and max_every(25.0) == 2 * MAX_EVERY
    assert max_every(0.4) * 0.4 == pytest.approx(MAX_PERIOD_S * 1e3, rel=0.01) and max_every(0.4) > 50 * MAX_EVERY
    b = ProbeBudget(budget_pct=0.3)
    # a 0.4 ms step whose hook alone (5 us) is over 0.3% of it: up to the cap in a change or two
    step, changes = 0, []
    while b.every < max_every(0.4) and step < 20 * MIN_HOLD_STEPS:
        step += 20
        new = b.update(hook_us_per_step=5.0 + 150.0 / b.every, step_ms=0.4, step=step)
        if new is not None:
            changes.append(new)
    assert b.every == max_every(0.4) and len(changes) <= 2, changes
    for _ in range(JUDGED):
        step += 20
        assert b.update(hook_us_per_step=5.0 + 150.0 / b.every, step_ms=0.4, step=step) is None
    assert b.over(step_ms=0.4)
    # a batch whose median step is half as long again (a busy host): k stays, no event
    assert max_every(0.6) < b.every < STRETCH * max_every(0.6)
    assert b.update(hook_us_per_step=5.0, step_ms=0.6, step=step + 1) is None and b.every == max_every(0.4)
    # ... nor one a little shorter, whose cap is a few steps more: k is at the cap (NEAR_CAP), the
    # budget's warning still holds and nothing moves (each move to it was an event every few seconds)
    assert max_every(0.4) < max_every(0.38) and b.at_cap(0.38)
    for i in range(JUDGED):
        assert b.update(hook_us_per_step=5.0 + 150.0 / b.every, step_ms=0.38, step=step + 1 + b.hold_steps * (i + 1)) is None
    assert b.over(step_ms=0.38) and b.to_cap(0.38, step) is None
    # 30% shorter: not at it (k under NEAR_CAP of the cap there: the readings' cost could still go down)
    assert b.every < NEAR_CAP * max_every(0.4 * 0.7) and not b.at_cap(0.4 * 0.7)
    # the steps grow to 100 ms: back to MAX_EVERY at the next batch, inside the hold
    assert b.update(hook_us_per_step=5.0, step_ms=100.0, step=step + 2) == MAX_EVERY


def test_an_up_move_that_did_not_land_goes_to_the_cap():
    # The cost falls slower than 1/k (a reading's wake-up costs more the longer the thread slept):
    # 4 us per reading at k = 1, 4 * k**0.5 at k.
    b = ProbeBudget(budget_pct=0.3)  # aim 0.72 us at a 0.4 ms step
    step, changes = 0, []
    while step < 20 * MIN_HOLD_STEPS:
        step += 20
        new = b.update(hook_us_per_step=0.2 + 4.0 / b.every ** 0.5, step_ms=0.4, step=step)
        if new is not None:
            changes.append(new)
    assert changes[:2] == [math.ceil(4.2 / (AIM * 1.2)), max_every(0.4)], changes
    # then down, each change to a k still inside the aim and a quarter below the one before
    assert all(0.2 + 4.0 / k ** 0.5 < AIM * 1.2 for k in changes[1:]), changes
    assert all(b <= 0.75 * a for a, b in zip(changes[1:], changes[2:])) and len(changes) <= 5, changes


def test_the_cadence_comes_down_in_one_change_to_a_k_inside_the_aim():
    b = ProbeBudget(budget_pct=0.3, every=25)  # aim 18 us at 10 ms
    step = 2 * MIN_HOLD_STEPS
    changes = [b.update(hook_us_per_step=4.0 + 100.0 / 25, step_ms=10.0, step=step + 20 * i) for i in range(JUDGED)]
    new = [c for c in changes if c is not None]
    assert len(new) == 1 and 1 < new[0] < 25, changes
    # the cost there, were all of it reads, stays under LOWER_BELOW of the aim; one k finer would not
    k = new[0]
    assert 8.0 * 25 / k < LOWER_BELOW * AIM * 30.0 <= 8.0 * 25 / (k - 1)


def _noisy_loop(b: ProbeBudget, steps: int, seed: int) -> list[tuple[int, int]]:
    """A steady loop on a noisy host: a 10 ms step, the hook 4 us fixed + 30 us of reads / k, each
    20-step batch's cost scaled by a random factor (0.6-1.6x, and one batch in ten 4-8x: another
    tenant's burst). Returns (step, new every) of each change."""
    rng = random.Random(seed)
    changes = []
    for step in range(20, steps + 1, 20):
        noise = rng.uniform(4.0, 8.0) if rng.random() < 0.1 else rng.uniform(0.6, 1.6)
        cost = (4.0 + 30.0 / b.every) * noise
        new = b.update(hook_us_per_step=cost, step_ms=10.0, step=step)
        if new is not None:
            changes.append((step, new))
    return changes


@pytest.mark.parametrize("seed", range(5))
def test_the_cadence_settles_on_a_noisy_steady_loop(seed):
    b = ProbeBudget(budget_pct=0.3)
    changes = _noisy_loop(b, 20_000, seed)
    late = [c for c in changes if c[0] > 2_000]
    assert len(late) <= 18, changes  # at steady state at most one change per 1,000 steps
    # The cadence it settles on keeps the hook's typical cost (the noise's median, 1.1x) in budget.
    assert (4.0 + 30.0 / b.every) * 1.1 <= 30.0, b.every


@pytest.mark.slow
def test_the_cadence_settles_under_a_real_steady_loop(tmp_path):
    """A real monitor on a steady ~0.3 ms loop (the hook is a large share of such a step, and on a
    busy host its cost jumps): after the first 1,000 steps, at most one cadence event per 1,000."""
    steps = 5000
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0, "flush_every": 20})
    for _ in range(steps):
        end = time.perf_counter() + 0.0003
        while time.perf_counter() < end:
            pass
        h.step()
    h.close()
    events = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    cadence = [e for e in events if e["type"] == "monitor" and "probe_every" in e]
    assert cadence, "the hook costs more than 0.3% of a 0.3 ms step: the cadence must change at least once"
    late = [e for e in cadence if e["step"] > 1000]
    assert len(late) <= (steps - 1000) // 1000, cadence


def test_zero_budget_reads_every_step_whatever_it_costs():
    b = ProbeBudget(budget_pct=0.0)
    assert b.update(hook_us_per_step=1e6, step_ms=1.0) is None and b.every == 1
    assert not b.over(step_ms=1.0)


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
    """Steps of about 1 ms: the hook's few tens of us are far over a 0.01% budget. A record a
    step (record_min_s 0): each step's reading is what is looked at."""
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0, "budget_pct": budget_pct,
                                  "record_min_s": 0})
    cpu0 = time.thread_time_ns()
    for _ in range(steps):
        _step(0.0005, 0.0005)
        h.step()
    cpu_ms = (time.thread_time_ns() - cpu0) / 1e6
    h.close()  # the last reading is taken in close(), after it built what the monitor thread had not
    cpu_closed_ms = (time.thread_time_ns() - cpu0) / 1e6
    lines = [json.loads(l) for l in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    return [l for l in lines if l["type"] == "step"], [l for l in lines if l["type"] == "monitor"], (cpu_ms, cpu_closed_ms)


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
    # The spread means add up to the thread's CPU time as the kernel counts it: from attach (the
    # loop's clock starts a moment later) to the last reading, taken in close() (after the loop's
    # clock stops: close builds the batches a busy host's monitor thread had not got to).
    total = sum(s["roles"]["main"]["cpu_ms"] for s in steps)
    loop_ms, closed_ms = cpu_ms
    assert loop_ms - 2.0 < total < closed_ms + 2.0, (total, cpu_ms)


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
        most = max(most, len(h.monitor.handed))
    h.close()
    assert most <= 8  # a few batches waiting at most (300 steps: up to 300 without the fallback)
    steps = [json.loads(l) for l in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if s["type"] == "step"] == list(range(1, 301))


def test_a_reading_counts_the_wake_up_it_took_and_a_reading_of_no_new_step_is_not_taken(tmp_path):
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0, "flush_every": 1000})
    try:
        reads = h.monitor._sampled
        with h.monitor.holding():  # the monitor thread takes no reading meanwhile
            h.step()
            before = reads.cost_ns
            reads.take(woke_ns=5_000_000)  # as if waking for it had cost 5 ms of CPU
            assert reads.cost_ns - before >= 5_000_000
            before = reads.cost_ns
            reads.take(woke_ns=5_000_000)  # no step ended since: no reading, nothing counted
            assert reads.cost_ns == before and not reads.due()
            reads.postpone()
            assert reads.wait_s() > 0
    finally:
        h.close()


@pytest.mark.parametrize("step, read_in_steps, every, left_to_hand_over", [
    (18, 0, 9, True),  # 2 steps before the hand-over: it reads then, one wake-up for both
    (15, 0, 9, False),  # 5 steps before: more than half a reading's steps
    (12, 5, 9, True),  # due 5 steps from now, 3 before the hand-over
    (12, 2, 9, False),
    (19, 0, 1, False),  # read every step: only the reading at the hand-over itself is left to it
    (20, 0, 1, True),
])
def test_a_reading_due_near_a_hand_over_is_left_to_it(step, read_in_steps, every, left_to_hand_over):
    step_s = 0.01  # the hand-over is due at step 20
    assert read_at_hand_over(read_in_steps * step_s, step, 20, every, every * step_s) is left_to_hand_over


def _spin(cpu_s: float) -> None:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


@pytest.mark.slow
@pytest.mark.parametrize("windowed", [False, True])
def test_the_budget_counts_all_of_placements_cpu_tuner_or_not(tmp_path, windowed):
    """An observer that spends 300 us of the monitor thread's CPU on each record: the budget
    counts it, with a tuner's windows or without (k goes up for it), and says it is placement's.
    A record a step (record_min_s 0): 300 us a step."""
    burn_us = 300.0
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0, "flush_every": 20, "budget_pct": 1.0,
                                  "record_min_s": 0})
    h.add_observer(lambda rec: _spin(burn_us / 1e6), (lambda after: (after // 20 + 1) * 20) if windowed else None)
    for _ in range(400):  # ~2 ms steps: 1% is 20 us, far under the observer's 300
        _step(0.0005, 0.0015)
        h.step()
    h.close()
    events = [json.loads(l) for l in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    cadence = [e for e in events if e["type"] == "monitor" and "probe_every" in e]
    assert cadence and cadence[0]["probe_every"] > 1, events
    assert "on its own threads" in cadence[0]["message"], cadence
    # Counted in the judgement of the batch whose records it observed; at these short steps the
    # windows come with the paced hand-overs, a few times a second, and the per-second judgement
    # may have sent k to its cap (MAX_PERIOD_S of steps) before: no move left to say it with.
    counted = [e for e in cadence if e["hook_us"] + e["thread_us"] > burn_us / 2]
    capped = cadence[-1]["probe_every"] * cadence[-1]["step_ms"] >= 0.9 * MAX_PERIOD_S * 1e3
    assert (counted and counted[0]["placement_cpu_us_per_step"] > burn_us / 2) or capped, cadence
    end = next(e for e in events if e["type"] == "end" and e.get("source") == "monitor")
    # the whole figure over the run: at least the observer's CPU per step, and the share of a ~2 ms step it is
    assert end["placement_cpu_us_per_step"] > 0.9 * burn_us, end
    assert 0.9 * burn_us / 2000 * 100 / 2 < end["placement_cost_pct"] < 100, end


def test_a_thread_of_ours_other_than_the_monitors_is_counted_and_named():
    """OWN_THREADS: a thread started there is named in the kernel (read back from /proc), its CPU
    is read live by its clock, and kept once it ended (its clock dies with it)."""
    before = OWN_THREADS.cpu_ns()
    go, spun = threading.Event(), threading.Event()

    def work():
        _spin(0.05)
        spun.set()
        go.wait(10)

    t = OWN_THREADS.start(work, "placement_test")
    assert spun.wait(10)
    with open(f"/proc/self/task/{t.native_id}/comm") as f:
        assert f.read().strip() == "placement_test"
    assert "placement_test" in OWN_THREADS.names()
    live = OWN_THREADS.cpu_ns() - before
    assert live >= 0.045e9, live
    go.set()
    t.join(10)
    assert not t.is_alive()
    assert OWN_THREADS.cpu_ns() - before >= live  # ended: still counted
    assert "placement_test" not in OWN_THREADS.names()


@pytest.mark.parametrize("reads_us, expect", [(30.0, "fits"), (10.0, "cap"), (None, "overshoot")])
def test_an_up_move_fits_the_readings_into_what_the_rest_leaves_of_the_aim(reads_us, expect):
    # aim at a 10 ms step: 18 us; the batch costs 40 us a step at k = 1
    b = ProbeBudget(budget_pct=0.3)
    aim = AIM * 0.3 / 100 * 10.0 * 1e3
    new = b.update(hook_us_per_step=40.0, step_ms=10.0, step=MIN_HOLD_STEPS, reads_us=reads_us)
    if expect == "fits":  # the rest (10 us) leaves 8 of the aim: the readings at k' cost 30 / k'
        assert new == math.ceil(30.0 / (aim - 10.0)) and 10.0 + 30.0 / new <= aim < 10.0 + 30.0 / (new - 1)
    elif expect == "cap":  # the rest alone (30 us) is over the aim: no k brings it inside
        assert new == max_every(10.0)
    else:  # the readings' share unknown: all of the cost taken for readings
        assert new == math.ceil(40.0 / aim)


def test_cost_rate_judges_each_second_after_the_first():
    r = CostRate(budget_pct=0.3)
    assert r.tick(100.0, 0) is None  # the first look starts the period
    assert r.tick(100.5, 10**9) is None  # half a period
    assert r.tick(101.0, 10**9) is None and r.last_pct == pytest.approx(100.0)  # the first period: not judged
    assert r.tick(102.0, 10**9 + 2 * 10**6) is None and r.last_pct == pytest.approx(0.2)  # under 0.3%
    assert r.tick(103.0, 10**9 + 7 * 10**6) == pytest.approx(0.5)  # over: said
    assert CostRate(budget_pct=0).tick(1.0, 0) is None


def _ms_of(pct: float, s: float) -> int:
    """CPU ns that are `pct` % of `s` seconds."""
    return int(pct / 100 * s * 1e9)


def test_the_paced_floor_doubles_over_the_budget_once_the_readings_are_at_their_cap_and_halves_well_under():
    f = PacedFloor(budget_pct=0.3, most=floor_scales(0.5, 4.0))
    assert f.most == 8 and f.scale == 1
    t, cpu = 100.0, 0
    assert f.judge(t, cpu, may_rise=True) is None  # the first hand-over starts the first period

    def period(pct: float, may_rise: bool = True, s: float = FLOOR_JUDGE_S):
        nonlocal t, cpu
        t, cpu = t + s, cpu + _ms_of(pct, s)
        return f.judge(t, cpu, may_rise)

    assert period(0.6, s=FLOOR_JUDGE_S / 2) is None  # shorter than a period: not judged yet ...
    assert period(0.6, s=FLOOR_JUDGE_S / 2) == (2, pytest.approx(0.6), pytest.approx(FLOOR_JUDGE_S))  # ... now
    assert period(0.6, may_rise=False) is None and f.scale == 2  # the readings not at their cap: they move first
    assert period(0.31)[0] == 4
    assert period(0.9)[0] == 8
    assert period(5.0) is None and f.scale == 8  # at its most (handover_max_s): the budget's warning, not a rise
    assert period(0.2) is None  # under the budget, but not well under: stays
    assert period(FLOOR_DOWN_BELOW * 0.3 * 0.9) == (4, pytest.approx(FLOOR_DOWN_BELOW * 0.3 * 0.9), pytest.approx(FLOOR_JUDGE_S))
    assert f.hold_s == 2 * FLOOR_JUDGE_S  # a reversal: periods twice as long from now on
    assert period(1.0) is None  # a period of the old length is not one any more
    assert period(1.0)[0] == 8  # up again: another reversal
    assert f.hold_s == 4 * FLOOR_JUDGE_S
    for _ in range(8):  # reversals double the period up to its most
        period(1.0 if f.scale == 4 else 0.01, s=f.hold_s)
    assert f.hold_s == FLOOR_MAX_HOLD_S


def test_the_paced_floor_never_moves_without_a_budget_or_room_to_stretch():
    for f in (PacedFloor(budget_pct=0, most=8), PacedFloor(budget_pct=0.3, most=floor_scales(0.5, 0.5))):
        assert f.judge(0.0, 0, True) is None
        assert f.judge(100.0, 10**12, True) is None and f.scale == 1
    assert floor_scales(0.5, 4.0) == 8 and floor_scales(0.5, 3.9) == 4 and floor_scales(0.0, 4.0) == 1
    assert floor_scales(0.3, 0.2) == 1 and floor_scales(1.0, 600.0) == 512


@pytest.mark.slow
def test_a_spinning_thread_of_ours_moves_the_budget_within_a_second_or_two(tmp_path):
    """A thread of placement's that spins (as the monitor's and the watcher's did under
    libfaketime, whose timed waits returned at once) costs the rank every second: the readings go
    to their cap and the event says what placement took, within CostRate's period (+ the first,
    unjudged one), not after the batches the per-batch judgement waits for (at 50 ms steps, JUDGED
    batches of 20 steps are 5 s)."""
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0, "flush_every": 20})
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            _spin(0.01)

    for _ in range(10):
        _step(0.001, 0.001)
        h.step()
    started = time.time()
    t = OWN_THREADS.start(spin, "placement_spin")
    try:
        deadline = time.monotonic() + 30
        moved = None
        while moved is None and time.monotonic() < deadline:
            _step(0.002, 0.048)  # ~50 ms steps
            h.step()
            h.monitor.events.flush()
            for line in (tmp_path / "rank0.jsonl").read_text().splitlines():
                e = json.loads(line)
                if e["type"] == "monitor" and e.get("probe_every", 1) > 1:
                    moved = e
    finally:
        stop.set()
        t.join(5)
        h.close()
    assert moved is not None, "no budget move"
    assert moved["placement_cost_pct"] > 0.3, moved
    # the first period starts at the monitor's first watch, before the spin; judged from the second:
    # within three periods of the spin's start, however busy the machine (the steps themselves are ~50 ms)
    assert moved["t"] - started < 3 * CostRate.PERIOD_S + 1.5, moved["t"] - started


def _schedstat_ms(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e6


def test_each_record_carries_placements_own_cpu_as_the_kernel_counts_it(tmp_path):
    """Never blame the rank for us: a record says what placement's own threads took of the CPU
    while its steps ran (placement_cpu_ms, per step), beside its CPU stall. A thread of ours
    that burns CPU from step 60 on (outside the GIL, as a C-level read would): the records'
    figures add up to what the kernel says it spent, and are ~0 before it started."""
    import hashlib

    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0, "flush_every": 10,
                                  "handover_min_s": 0})
    stop, tid = threading.Event(), []
    blob = b"x" * (1 << 20)

    def burn():
        tid.append(threading.get_native_id())
        while not stop.is_set():
            hashlib.sha256(blob).digest()  # releases the GIL over a buffer this long

    for _ in range(60):
        _step(0.0005, 0.002)
        h.step()
    t = OWN_THREADS.start(burn, "placement_burn")
    try:
        for _ in range(200):
            _step(0.0005, 0.002)
            h.step()
        burned_ms = _schedstat_ms(tid[0])  # from /proc, as it stops (the records' last batch counts its end)
    finally:
        stop.set()
        t.join(5)
        h.close()
    recs = [json.loads(l) for l in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    # per step (a record of several steps says its per-step mean)
    steps = {s: r["placement_cpu_ms"] for r in recs if r["type"] == "step" for s in line_steps(r)}
    assert len(steps) >= 255 and all(v is not None and v >= 0 for v in steps.values())
    total = sum(steps.values())
    # all of ours: the burn, and the monitor's own (a small part: its end event's figure)
    mon_ms = [r for r in recs if r["type"] == "end"][-1]["monitor_thread_us_per_step"] * len(steps) / 1e3
    assert burned_ms > 50, burned_ms  # it ran
    assert 0.9 * burned_ms <= total <= 1.1 * burned_ms + 2 * mon_ms + 5, (total, burned_ms, mon_ms)
    before = [steps[s] for s in range(5, 41)]  # batches of 10 steps: the burn starts at step 61
    after = [steps[s] for s in range(91, 251)]
    assert sum(after) / len(after) > 10 * max(sum(before) / len(before), 0.005), (before, after)
