"""The hand-overs' cadence (monitor.handover_min_s): at short steps the training thread hands its
steps to the monitor thread only at multiples of flush_every x stride, a power of two the
monitor thread sets so that a hand-over holds at least handover_min_s of steps; every step is
still written once, in order. handover_min_s = 0 hands over at every due step. Over its budget,
the monitor stretches that floor up to monitor.handover_max_s (the runs of stamped steps here,
far faster in wall time than their stamps say, set it to 0 where they count hand-overs: their
cost over wall time is no job's)."""
import json
import time

import pytest

import placement
from placement.errors import ConfigError
from placement.monitor.hook import MAX_STRIDE
from placement.monitor.step_monitor import SPAN_FLOORS
from placement.records.step import line_steps, record_steps

FLUSH = 5
STEPS = 3000
STEP_NS = 10_000_000  # the stamped steps' length (_span_steps)
NO_OBSERVER = object()


def _count_hand_overs(mon) -> list[int]:
    """The last step of each hand-over the monitor thread processes from now on, as a list."""
    handed: list[int] = []
    process = mon._process

    def counted(item, exchange):
        handed.append(item.last_step)
        return process(item, exchange)

    mon._process = counted
    return handed


def _run(tmp_path, floor_s: float, window_end=NO_OBSERVER) -> tuple[list[int], list[int], list[int], int]:
    """A loop of trivial steps (tens of us each, well under any floor here), with an observer
    when `window_end` is given (None included: one that wants no window): the last step of each
    hand-over the monitor processed, the steps written, the steps observed, and the stride at
    the end."""
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "flush_every": FLUSH, "rescan_every": FLUSH,
                                  "summary_every": 0, "handover_min_s": floor_s, "handover_max_s": 0})
    mon = h.monitor
    handed = _count_hand_overs(mon)
    seen: list[int] = []
    if window_end is not NO_OBSERVER:
        h.add_observer(lambda rec: seen.extend(record_steps(rec)), window_end)
    for _ in range(STEPS):
        h.step()
    stride = mon.hook.stride
    h.close()
    steps = [s for line in (tmp_path / "rank0.jsonl").read_text().splitlines() if '"type":"step"' in line
             for s in line_steps(json.loads(line))]
    return handed, steps, seen, stride


def test_short_steps_are_handed_over_a_floor_apart_and_every_step_is_written(tmp_path):
    handed, steps, _, stride = _run(tmp_path, floor_s=2.0)
    assert steps == list(range(1, STEPS + 1))
    # 160 steps of this loop take far less than 2 s, so the stride goes to its cap ...
    assert stride == MAX_STRIDE
    # ... within the first few hand-overs (the training thread may pass a few due steps before
    # the monitor thread has seen a step time), and each later one holds a whole stride.
    at_cap = [s for s in handed if s % (FLUSH * MAX_STRIDE) == 0]
    assert len(handed) - len(at_cap) <= 8, handed[:20]
    assert len(handed) <= STEPS // (FLUSH * MAX_STRIDE) + 8


def test_a_floor_of_zero_hands_over_at_every_due_step(tmp_path):
    handed, steps, _, stride = _run(tmp_path, floor_s=0.0)
    assert steps == list(range(1, STEPS + 1))
    assert stride == 1
    # every flush (and span) step is a hand-over; the close's drain may add the last few steps
    assert set(range(FLUSH, STEPS + 1, FLUSH)) <= set(handed)


@pytest.mark.parametrize("key,value,valid", [("handover_min_s", -0.5, r"\[0.0, 60.0\]"),
                                               ("handover_min_s", 61.0, r"\[0.0, 60.0\]"),
                                               ("handover_max_s", -1.0, r"\[0.0, 600.0\]"),
                                               ("handover_max_s", 601.0, r"\[0.0, 600.0\]")])
def test_a_floor_out_of_range_is_refused_with_its_range(key, value, valid):
    with pytest.raises(ConfigError, match=rf"monitor.{key}=.* is out of range; valid: {valid}"):
        placement.attach(policy="none", monitor={key: value})


def _stride_observed(tmp_path, window_end) -> int:
    _, _, seen, stride = _run(tmp_path, 2.0, window_end)
    assert seen == list(range(1, STEPS + 1))
    return stride


WINDOW = 20
SLOW_FROM = 1001  # the first step of the first window whose steps run 50% longer


def _windowed_hand_overs(tmp_path, flush: int) -> tuple[list[int], list[int], int]:
    """Steps 10 ms apart by their own stamps, 15 ms from SLOW_FROM on, an observer judging
    20-step windows, the floor 0.5 s: (the last step of each hand-over processed after the
    stride was set, the steps observed, the stride set at the quiet steps). The loop waits (bounded) for the monitor
    thread to set the stride before the quiet windows that are judged."""
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "flush_every": flush, "rescan_every": flush,
                                  "summary_every": 0, "handover_min_s": 0.5, "handover_max_s": 0})
    mon = h.monitor
    handed = _count_hand_overs(mon)
    seen: list[int] = []
    h.add_observer(lambda rec: seen.extend(record_steps(rec)), lambda after: (after // WINDOW + 1) * WINDOW)
    at, paced_from = time.perf_counter_ns(), None
    for i in range(1, STEPS + 1):
        at += STEP_NS if i < SLOW_FROM else STEP_NS * 3 // 2
        h.monitor.on_step(at=at)
        if i == 200:
            deadline = time.monotonic() + 30
            while mon.hook.stride == 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            paced_from, stride = len(handed), mon.hook.stride
    h.close()
    return handed[paced_from:], seen, stride


@pytest.mark.parametrize("flush", [FLUSH, WINDOW])  # a flush step is a window's end, or every one is
def test_a_tuners_quiet_windows_come_with_the_paced_hand_overs_and_a_slower_one_as_it_ends(tmp_path, flush):
    handed, seen, stride = _windowed_hand_overs(tmp_path, flush)
    assert seen == list(range(1, STEPS + 1))  # every window's records, in order
    # flushes of 10 ms steps: the fewest (a power of two) that hold the 0.5 s floor, 0.8 s
    assert flush * stride == 80
    paced = flush * stride
    quiet = [s for s in handed if 200 + paced < s < SLOW_FROM]
    # the quiet windows (four of each stride's) come with the paced hand-overs, not one each
    assert quiet and all(s % paced == 0 for s in quiet), quiet
    # the first window whose steps ran slower is handed over as it ends, between two paced ones
    first_slow = SLOW_FROM - 1 + WINDOW
    assert first_slow % paced and first_slow in handed, handed


def test_an_observer_that_stopped_judging_windows_lets_the_stride_grow(tmp_path):
    # window_end None: no window wanted (a tuner that stopped)
    assert _stride_observed(tmp_path, lambda after: None) == MAX_STRIDE


def _span_steps(tmp_path, floor_s: float, window_end=NO_OBSERVER, light=False) -> list[int]:
    """Steps 10 ms apart by their own stamps (the hook's `at`), however fast the loop runs: the
    steps whose record carries a full span reading (main's involuntary switches), or with
    `light` any span reading (the `other` role: this process's other threads, the monitor's own
    among them, are read at every span). A record a step (record_min_s 0): the step a span
    reading was taken at is its record's."""
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "flush_every": FLUSH, "rescan_every": FLUSH,
                                  "summary_every": 0, "handover_min_s": floor_s, "record_min_s": 0,
                                  "handover_max_s": 0})
    if window_end is not NO_OBSERVER:
        h.add_observer(lambda rec: None, window_end)
    t0 = time.perf_counter_ns()
    for i in range(1, STEPS + 1):
        h.monitor.on_step(at=t0 + i * STEP_NS)
    h.close()
    records = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()
               if '"type":"step"' in line]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["roles"]["main"].get("nivcsw", 0) >= 0 for r in records)
    if light:
        return [r["step"] for r in records if "other" in r["roles"]]
    return [r["step"] for r in records if "nivcsw" in r["roles"]["main"]]


def test_without_a_tuner_span_readings_are_four_floors_of_steps_apart(tmp_path):
    spans = _span_steps(tmp_path, floor_s=0.5)
    floors = SPAN_FLOORS * 0.5e9 / STEP_NS  # 200 steps of 10 ms
    gaps = [b - a for a, b in zip(spans, spans[1:])]
    # rarer than the hand-overs themselves (at most MAX_STRIDE flushes, 1.6 s of these steps)
    assert gaps and min(gaps) >= floors > FLUSH * MAX_STRIDE, spans
    # ... and no further apart than a floor's worth plus one hand-over (at most MAX_STRIDE flushes)
    assert max(gaps) <= floors + FLUSH * MAX_STRIDE, spans


def test_a_floor_of_zero_reads_spans_every_rescan_every_steps(tmp_path):
    spans = _span_steps(tmp_path, floor_s=0.0)
    assert spans[:10] == list(range(FLUSH, 11 * FLUSH, FLUSH))


def test_with_a_tuner_each_hand_over_gets_a_light_span_and_full_ones_are_four_floors_apart(tmp_path):
    window = 20
    every_window = lambda after: (after // window + 1) * window  # noqa: E731
    spans = _span_steps(tmp_path, 0.5, every_window, light=True)
    # the rules read the dataloader's and other's time per window: a span at each hand-over, the
    # windows' (at most a stride of flushes apart: quiet windows come with the paced ones)
    gaps = [b - a for a, b in zip(spans, spans[1:])]
    assert spans[0] <= window and max(gaps) <= FLUSH * MAX_STRIDE, spans[:20]
    (tmp_path / "rank0.jsonl").unlink()
    full = _span_steps(tmp_path, 0.5, every_window)
    floors = SPAN_FLOORS * 0.5e9 / STEP_NS  # 200 steps of 10 ms
    gaps = [b - a for a, b in zip(full, full[1:])]
    # the stat and status files (faults, switches) only at full spans, a floor's worth of steps apart
    assert gaps and min(gaps) >= floors and max(gaps) <= floors + FLUSH * MAX_STRIDE, full
    assert len(spans) > 2 * len(full)


def test_the_tuners_windows_paced_in_time_end_at_the_paced_hand_overs_and_read_nothing_of_their_own(tmp_path):
    """The real tuner at its defaults (tune.window 20, tune.window_min_s 0.5) over steps 10 ms
    apart by their stamps: once both are paced from the step time, its windows are 80 steps
    (20 x 4, what lasts 0.5 s) ending at multiples of 80, where the hand-overs are (flush_every
    20 x stride 4): no window end between two hand-overs asks the monitor thread for a counter
    reading of its own (a wake-up each), and the tuner judges a window per 0.8 s, not per 0.2."""
    h = placement.attach(monitor={"log_dir": str(tmp_path), "summary_every": 0, "handover_max_s": 0})
    mon, tuner = h.monitor, h.tuner
    assert tuner is not None and tuner.cfg.window_min_s == 0.5
    asked: list[int] = []
    ask = mon.hook._ask_read  # (the hook's call for a reading at a window end off a hand-over)
    mon.hook._ask_read = lambda step: (asked.append(step), ask(step))[1]
    at, paced_at = time.perf_counter_ns(), None
    for i in range(1, STEPS + 1):
        at += STEP_NS
        mon.on_step(at=at)
        if paced_at is None and i % 20 == 0 and i >= 200:
            deadline = time.monotonic() + 30  # the monitor thread paces both from the steps handed over
            while (mon.hook.stride == 1 or tuner.window_end(i) % 80) and time.monotonic() < deadline:
                time.sleep(0.01)
            paced_at, windows_at, asked_at = i, tuner.windows, len(asked)
    last_end = tuner.window_end(STEPS)
    h.close()
    assert paced_at is not None and mon.hook.stride == 4
    assert last_end % 80 == 0
    assert asked[asked_at:] == []  # every window end from then on was a hand-over
    paced = tuner.windows - windows_at
    assert (STEPS - paced_at) // 80 - 2 <= paced <= (STEPS - paced_at) // 80 + 1, (paced, paced_at)


def test_over_its_budget_the_monitor_stretches_the_floor_and_the_hand_overs_follow(tmp_path):
    """Steps of ~4 ms (slept) and a budget placement cannot keep at the floor of 0.5 s
    (0.01% of the step, 0.4 us): once the readings are at their cap, the floor doubles to
    monitor.handover_max_s (1 s) within a few of its periods, a `monitor` event says so and
    what placement took, the hand-overs after it hold 1 s of steps at least, and the binder's
    watcher rescans half as often."""
    h = placement.attach(tune={"enabled": False},  # bound: the binder's watcher follows the floor too
                         monitor={"log_dir": str(tmp_path), "summary_every": 0, "budget_pct": 0.01,
                                  "handover_min_s": 0.5, "handover_max_s": 1.0})
    mon = h.monitor
    handed: list[tuple[int, int]] = []  # (last step, its end stamp: the training thread's perf_counter_ns)
    process = mon._process
    mon._process = lambda item, exchange: (handed.append((item.last_step, item.raw[-1][0])),
                                           process(item, exchange))[1]
    log = tmp_path / "rank0.jsonl"
    rose, after = None, 0
    deadline = time.monotonic() + 60
    while (rose is None or len([s for s, _ in handed if s > rose["step"]]) < 4) and time.monotonic() < deadline:
        time.sleep(0.004)
        h.step()
        after += 1
        if rose is None and after % 50 == 0:
            mon.events.flush()
            rose = next((e for e in map(json.loads, log.read_text().splitlines())
                         if e["type"] == "monitor" and "handover_floor_s" in e), None)
    binder = h.binder
    paced = None if binder is None else binder._watch_pace()  # (the binder's watcher follows it)
    h.close()
    assert rose is not None, "the floor never rose"
    assert binder is not None and paced == 2.0
    assert rose["handover_floor_s"] == 1.0 and rose["placement_cost_pct"] > 0.01 and rose["budget_pct"] == 0.01
    assert "hand-overs at least 1 s apart, was 0.5 s" in rose["message"]
    assert mon.floor_scale == 2
    # The hook is paced once the monitor thread has seen the rise: from the second hand-over
    # after it, each ends a stride of steps that last 1 s or more (at ~4.4 ms steps 320, where
    # the floor of 0.5 s gave 160: 0.7 s) after the one before, by the steps' own stamps, less
    # their noise.
    later = [t for s, t in handed if s > rose["step"]][1:]
    gaps_s = [(b - a) / 1e9 for a, b in zip(later, later[1:])]
    assert gaps_s and min(gaps_s) >= 0.8, gaps_s
    # the stride's rule itself: at 10 ms steps 0.5 s is 20 x 4 steps, the floor doubled 20 x 8
    hook = mon.hook
    assert [(hook.pace(10.0, None, scale), hook.stride)[1] for scale in (1, 2, 8)] == [4, 8, 32]
    # the end event keeps the floor, and the report says it was stretched
    end = next(e for e in map(json.loads, log.read_text().splitlines()) if e["type"] == "end" and e.get("source") == "monitor")
    assert (end["handover_floor_s"], end["handover_floor_scale"]) == (1.0, 2)
    from placement.report.logs import read_logs
    from placement.report.text import event_lines

    said = [line for line in event_lines(read_logs([str(log)])) if "monitor end after" in line]
    assert len(said) == 1 and "hand-overs 1.0 s apart at least (x2: stretched to keep the budget)" in said[0], said
