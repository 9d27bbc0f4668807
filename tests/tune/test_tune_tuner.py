"""The Tuner's safety on synthetic record streams: judged actions, rollback, back-off, dry run,
one action in flight, never outside the share, failures contained."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from placement.roles import ThreadInfo, ThreadRole
from placement.tune.facts import ForeignThread
from placement.tune.tuner import KEPT_HOLD_WINDOWS, Tuner
from tune_fakes import FakeBinder, FakeFacts, ListEvents, hog, rank_plan, topology, tune_cfg, window

MAIN = ThreadRole.MAIN
PLAN = {"main": [0], "nccl": [1], "dataloader": [2, 3], "other": [2, 3]}
QUIET = {"main": {"cpu_ms": 0.8, "runq_ms": 0.01, "cpus": [0]}, "nccl": {"cpu_ms": 0.02}}
HOGGED = {"main": {"cpu_ms": 0.5, "runq_ms": 0.45, "cpus": [0]}, "nccl": {"cpu_ms": 0.02}}


class Run:
    """A tuner on a 4-CPU fake machine, fed window by window."""

    def __init__(self, plan=PLAN, facts=None, binder=None, floor_scale=lambda: 1, **cfg):
        self.cfg = tune_cfg(**cfg)
        self.binder = binder or FakeBinder()
        self.binder.rank_plan = rank_plan(plan, topo=topology(4))
        self.events = ListEvents()
        self.facts = facts or FakeFacts(foreign=[hog(0)])
        self.tuner = Tuner(self.binder, self.cfg, self.events, facts=self.facts, floor_scale=floor_scale)
        self.step = 0

    def feed(self, windows=1, **kw):
        for _ in range(windows):
            for r in window(self.cfg.window, self.step, **kw):
                self.tuner.observe(r)
            self.step += self.cfg.window

    def quiet(self, windows=1, step_ms=10.0):
        self.feed(windows, step_ms=step_ms, jitter=0.02, roles=QUIET)

    def hogged(self, windows=1, step_ms=20.0):
        self.feed(windows, step_ms=step_ms, jitter=0.02, roles=HOGGED)


def test_a_move_that_helps_is_kept_and_logged_with_its_effect():
    run = Run()
    run.quiet(3)  # warm-up window, then two quiet windows for the noise band
    assert run.binder.calls == []
    run.hogged()
    # main goes to core 2; the DataLoader workers that ran there make room in the same action
    assert [(r, c) for r, c, _ in run.binder.calls] == [(MAIN, frozenset({2})), (ThreadRole.DATALOADER, frozenset({3}))]
    applied = run.events.of("tune", phase="applied", rule="runqueue")
    assert applied and applied[0]["change"] == {"from": [0], "to": [2]} and applied[0]["effect"] is None
    assert applied[0]["also"] == [{"role": "dataloader", "from": [2, 3], "to": [3]}]
    assert applied[0]["evidence"]["foreign"][0]["name"] == "hog"
    run.quiet()  # the window after the move: back to 10 ms
    kept = run.events.of("tune", phase="kept", rule="runqueue")
    assert len(kept) == 1
    assert kept[0]["effect"]["gain_pct"] > 40 and kept[0]["effect"]["before_median_ms"] > 19
    assert run.tuner.role_cpus(MAIN) == {2}
    assert run.events.of("rollback") == []


def test_a_move_that_makes_things_worse_is_rolled_back():
    run = Run()
    run.quiet(3)
    run.hogged()
    run.hogged(step_ms=26.0)  # after the move the step got slower
    rb = run.events.of("rollback", rule="runqueue")
    assert len(rb) == 1 and rb[0]["why"].startswith("worse")
    assert rb[0]["change"] == {"from": [2], "to": [0]} and rb[0]["effect"]["gain_pct"] < -20
    # the whole action is undone: main back to 0, the workers that made room back to 2-3
    assert [c for _, c, _ in run.binder.calls] == [frozenset({2}), frozenset({3}), frozenset({0}), frozenset({2, 3})]
    assert rb[0]["also"][0] == {"role": "dataloader", "from": [3], "to": [2, 3]}
    assert run.tuner.role_cpus(MAIN) == {0} and run.tuner.role_cpus(ThreadRole.DATALOADER) == {2, 3}


def test_no_gain_within_the_noise_band_is_rolled_back():
    run = Run()
    run.quiet(1)
    for ms in (10.0, 12.0, 10.0, 12.0, 10.0):  # quiet windows 20% apart: a wide noise band
        run.quiet(step_ms=ms)
    run.hogged(step_ms=20.0)
    run.hogged(step_ms=17.0)  # 15% faster: inside the band
    rb = run.events.of("rollback")
    assert len(rb) == 1 and rb[0]["why"].startswith("no gain") and rb[0]["effect"]["noise_pct"] > 15


def test_back_off_grows_exponentially_up_to_the_cap():
    run = Run(cooldown_windows=0, max_backoff_windows=8)
    run.quiet(3)
    run.hogged(40)  # the hog stays whatever we do: every move is rolled back
    waits = [e["backoff_windows"] for e in run.events.of("rollback")]
    assert waits[:4] == [2, 4, 8, 8]
    applied_at = [e for e in run.events.records if e.get("phase") == "applied"]
    assert len(applied_at) == len(waits) or len(applied_at) == len(waits) + 1
    # between the n-th rollback and the next move the tuner sat out exactly `wait` windows
    steps = [e["evidence"]["window"][0] for e in applied_at]
    gaps = [(b - a) // run.cfg.window for a, b in zip(steps, steps[1:])]
    assert gaps[:3] == [w + 2 for w in waits[:3]]


def test_a_kept_move_resets_the_back_off():
    run = Run(cooldown_windows=0)
    run.quiet(3)
    run.hogged()
    run.hogged()  # no gain: rolled back, wait 2
    run.hogged(3)  # wait, then move again
    run.quiet()  # that one helped
    assert [e["backoff_windows"] for e in run.events.of("rollback")] == [2]
    assert len(run.events.of("tune", phase="kept")) == 1
    assert run.tuner._backoff.blocked(("runqueue", "main"), run.tuner.windows + 1) is False


def test_a_kept_change_is_not_undone_by_another_rule_while_held():
    plan = {"main": [0], "dataloader": [1], "other": [1]}
    run = Run(plan=plan, facts=FakeFacts(), background_nice=5)
    run.quiet(3, step_ms=5.0)
    starved = {"main": {"cpu_ms": 0.3}, "dataloader": {"cpu_ms": 0.95, "threads": 2}}
    run.feed(1, step_ms=12.0, data_frac=0.6, roles=starved)  # dataloader_size lends main's core
    lent = {"main": {"cpu_ms": 0.5, "runq_ms": 0.2}, "dataloader": {"cpu_ms": 0.8, "threads": 2}}
    run.feed(1, step_ms=8.0, roles=lent)  # kept: faster, though main now waits a little
    assert run.events.of("tune", phase="kept", rule="dataloader_size")[0]["change"]["to"] == [0, 1]
    run.feed(KEPT_HOLD_WINDOWS - 1, step_ms=8.0, roles=lent)  # runqueue would evict the workers: held
    assert len(run.binder.calls) == 1
    run.feed(3, step_ms=8.0, roles=lent)  # the hold is over: runqueue may try
    assert run.binder.calls[1][:2] == (ThreadRole.DATALOADER, frozenset({1}))
    assert run.events.of("tune", phase="applied")[1]["rule"] == "runqueue"


def test_dry_run_changes_nothing_and_logs_what_it_would_do_once():
    run = Run(dry_run=True)
    run.quiet(3)
    run.hogged(6)
    assert run.binder.calls == []
    would = run.events.of("tune", phase="dry_run")
    assert len(would) == 1 and would[0]["change"] == {"from": [0], "to": [2]} and would[0]["rule"] == "runqueue"
    assert run.tuner.role_cpus(MAIN) == {0}


def test_disabled_tuner_leaves_the_static_plan():
    run = Run(enabled=False)
    run.quiet(3)
    run.hogged(5)
    assert run.binder.calls == [] and run.events.records == []


def test_a_raising_rule_is_disabled_with_one_warning_and_the_others_go_on():
    run = Run(rules=["runqueue", "faster_core"])
    calls = []

    def broken(ctx):
        calls.append(1)
        raise ZeroDivisionError("synthetic")

    run.tuner.rules[1].propose = broken  # faster_core
    run.quiet(5)
    run.hogged()
    run.quiet()
    warnings = run.events.of("warning", rule="faster_core")
    assert len(warnings) == 1 and "ZeroDivisionError" in warnings[0]["message"]
    assert len(calls) == 1
    assert len(run.events.of("tune", phase="kept", rule="runqueue")) == 1


def test_an_internal_failure_stops_the_tuner_without_raising():
    class ExplodingBinder(FakeBinder):
        def set_role_cpus(self, role, cpus, reason):
            raise RuntimeError("binder exploded")

    run = Run(binder=ExplodingBinder())
    run.quiet(3)
    run.hogged(3)  # must not raise
    msgs = [e["message"] for e in run.events.of("warning")]
    assert len(msgs) == 1 and "binder exploded" in msgs[0]


def test_refused_binding_is_rolled_back_at_once():
    run = Run(binder=FakeBinder(refuse=True))
    run.quiet(3)
    run.hogged()
    rb = run.events.of("rollback")
    assert len(rb) == 1 and "EINVAL" in rb[0]["why"]
    assert run.tuner.role_cpus(MAIN) == {0}
    assert run.binder.calls[-1][1] == {0}


def test_one_action_in_flight_at_a_time():
    plan = {"main": [0], "nccl": [0], "other": [1, 2, 3]}
    both = {"main": {"cpu_ms": 0.5, "runq_ms": 0.45}, "nccl": {"cpu_ms": 0.3, "threads": 2}}
    run = Run(plan=plan, binder=FakeBinder([ThreadInfo(1, 1, "python", MAIN), ThreadInfo(1, 2, "NCCL", ThreadRole.NCCL)]))
    run.quiet(3)
    run.feed(1, step_ms=20.0, comm_frac=0.5, roles=both)  # runqueue and nccl_core both have evidence
    assert len(run.binder.calls) == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    share=st.sets(st.integers(0, 7), min_size=1, max_size=8),
    data=st.data(),
)
def test_every_change_stays_inside_the_share_and_one_is_in_flight(share, data):
    share = sorted(share)
    roles = {r: sorted(data.draw(st.sets(st.sampled_from(share), min_size=1)))
             for r in ("main", "nccl", "pin_memory", "dataloader", "other")}
    foreign = [ForeignThread(9, 9, "x", c, frozenset({c})) for c in data.draw(st.sets(st.integers(0, 7)))]
    facts = FakeFacts(foreign=foreign, mhz={c: data.draw(st.floats(800, 4000)) for c in range(8)}, balancing=1)
    threads = [ThreadInfo(1, i, r, ThreadRole(r)) for i, r in enumerate(roles)]
    run = Run(plan=roles, facts=facts, binder=FakeBinder(threads), cooldown_windows=data.draw(st.integers(0, 2)))
    frac = st.floats(0.0, 1.0)
    for _ in range(data.draw(st.integers(2, 12))):
        run.feed(1, step_ms=data.draw(st.floats(1.0, 50.0)), data_frac=data.draw(frac), comm_frac=data.draw(frac),
                 roles={r: {"cpu_ms": data.draw(frac), "runq_ms": data.draw(frac), "threads": 2} for r in roles})
    for _, cpus, _ in run.binder.calls:
        assert cpus and cpus <= set(share)
    in_flight = 0
    for e in run.events.records:
        if e.get("rule") == "background_nice":
            continue
        if e["type"] == "tune" and e.get("phase") == "applied":
            in_flight += 1
        elif e["type"] == "rollback" or (e["type"] == "tune" and e.get("phase") == "kept"):
            in_flight -= 1
        assert in_flight in (0, 1)


def test_window_end_follows_the_grid_and_restarts_at_an_action():
    """What the monitor reads to hand a window over as soon as it is complete (window_end)."""
    run = Run()  # windows of 10 steps; next_step: the step after the last record
    w = run.cfg.window
    # Before any record: the monitor's first record is step 1.
    assert [run.tuner.window_end(s) for s in (0, w - 1, w, 2 * w + 3)] == [w, w, 2 * w, 3 * w]
    run.quiet(3)  # this feed starts at step 0: the grid is [0, w), [w, 2w), ...
    assert run.tuner.window_end(3 * w - 1) == 4 * w - 1
    run.hogged()  # the move is applied as the 4th window closes: in force from step 4w
    in_force = run.events.of("tune", phase="applied")[0]["in_force_step"]
    assert in_force == 4 * w
    assert run.tuner.window_end(4 * w - 1) == in_force + w - 1
    assert run.tuner.window_end(in_force + w - 1) == in_force + 2 * w - 1
    run.tuner.close()
    assert run.tuner.window_end(4 * w) is None


def test_a_batch_is_observed_as_its_records_one_at_a_time():
    """observe_batch (what the monitor calls with each hand-over's records) judges the same
    windows and takes the same actions as observe() record by record, whatever the batches'
    cuts: across the window that applies a move (which restarts the grid past records already
    handed over) too."""
    def stream(run):
        out = []
        for roles, step_ms, n in ((QUIET, 10.0, 3), (HOGGED, 20.0, 1), (QUIET, 10.0, 3)):
            for _ in range(n):
                out += window(run.cfg.window, run.step, step_ms=step_ms, jitter=0.02, roles=roles)
                run.step += run.cfg.window
        return out

    one, batched = Run(), Run()
    for r in stream(one):
        one.tuner.observe(r)
    records = stream(batched)
    cuts = [0, 7, 8, 21, 40, 41, 55, len(records)]  # inside windows, at their ends, one record alone
    for a, b in zip(cuts, cuts[1:]):
        batched.tuner.observe_batch(records[a:b])
    assert one.binder.calls and batched.binder.calls == one.binder.calls
    assert batched.tuner.windows == one.tuner.windows == 7
    phases = [(e.get("phase"), e.get("in_force_step")) for e in one.events.of("tune")]
    assert [(e.get("phase"), e.get("in_force_step")) for e in batched.events.of("tune")] == phases
    assert batched.tuner.window_end(one.step) == one.tuner.window_end(one.step)


def test_windows_at_short_steps_are_paced_in_time_and_end_at_the_hand_overs_grid():
    """tune.window_min_s: at 6 ms steps a window of 10 steps lasts 60 ms; paced to 0.2 s it is
    10 x 4 steps (a power of two, as the monitor's hand-overs are paced), ending at multiples of
    40 after the first (10 steps, no step time yet); an action's window starts at its in-force
    step and ends at the grid's next multiple at least `window` steps on; at 30 ms steps the
    windows are 10 steps again. The tuner's judgement is the same: a hog is moved off and kept."""
    from placement.tune.tuner import paced_window

    assert [paced_window(10, 0.2, ms) for ms in (6.0, 12.0, 30.0, 0.001)] == [40, 20, 10, 640]  # (640: MAX_PACE)
    assert paced_window(10, 0.0, 0.1) == 10
    run = Run(window_min_s=0.2)
    tuner = run.tuner
    ends = []
    for step in range(1, 161):
        ends.append(tuner.window_end(step - 1))
        tuner.observe(window(1, step, step_ms=6.0, jitter=0.02, roles=QUIET)[0])
    assert ends[0] == 10 and tuner.windows == 5  # windows 1-10, 11-40, 41-80, 81-120, 121-160
    assert set(ends[10:]) == {40, 80, 120, 160}
    assert tuner.window_end(170) == 200
    step = 161
    while not run.binder.calls and step < 400:
        tuner.observe(window(1, step, step_ms=12.0, jitter=0.02, roles=HOGGED)[0])
        step += 1
    assert run.binder.calls and run.binder.calls[0][:2] == (MAIN, frozenset({2}))
    first = run.events.of("tune", phase="applied")[0]["in_force_step"]
    assert step - 1 == 200  # the hogged window 161-200 (40 steps: paced at 6 ms) moved main
    assert tuner.window_end(first - 1) == -(-(first + 9) // 20) * 20  # 12 ms steps: a pace of 20
    for s in range(step, step + 80):
        tuner.observe(window(1, s, step_ms=6.0, jitter=0.02, roles=QUIET)[0])
    kept = run.events.of("tune", phase="kept")
    assert len(kept) == 1 and kept[0]["judged_steps"][0] == first
    assert kept[0]["judged_steps"][1] - first + 1 >= 10
    run2 = Run(window_min_s=0.2)
    for s in range(1, 101):
        run2.tuner.observe(window(1, s, step_ms=30.0, jitter=0.02, roles=QUIET)[0])
    assert run2.tuner.windows == 10  # 30 ms steps: windows of 10 steps


def test_windows_follow_the_monitors_paced_floor_as_its_budget_stretches_it():
    """The monitor's budget stretches its paced floor (monitor/probes/budget.py PacedFloor) and
    the tuner's windows by as much, so that they still end at its hand-overs: at 6 ms steps and
    window_min_s 0.2, windows of 40 steps; the floor doubled, the next window is paced to 0.4 s
    (80 steps), ending on that grid; halved again, 40."""
    scale = [1]
    run = Run(window_min_s=0.2, floor_scale=lambda: scale[0])
    tuner = run.tuner

    def feed(first: int, last: int) -> None:
        for s in range(first, last + 1):
            tuner.observe(window(1, s, step_ms=6.0, jitter=0.02, roles=QUIET)[0])

    feed(1, 40)  # windows 1-10, 11-40
    assert tuner.windows == 2 and tuner.window_end(40) == 80
    scale[0] = 2
    feed(41, 80)  # the window 41-80 ends, the next paced at 0.4 s
    assert tuner.window_end(80) == 160
    feed(81, 160)
    assert tuner.windows == 4 and tuner.window_end(160) == 240
    scale[0] = 1
    feed(161, 240)
    assert tuner.windows == 5 and tuner.window_end(240) == 280
