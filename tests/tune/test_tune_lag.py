"""The tuner behind the real step monitor, with NCCL's comm lag (a step's durations settled
2 steps later: nccl_recorder_standins.settle_steps_late) and flush steps every 40 steps while windows are 20: a move is
judged on steps that ran after it, never on steps measured before it, whether the records
come in batches at flush steps (an observer without window_end) or, as placement.attach
wires the tuner, each window as soon as its comm timing is final."""
from __future__ import annotations

import time
from typing import Optional

import pytest

import placement
from placement.roles import ThreadRole
from placement.tune.rules.base import Proposal, Rule, RuleContext
from placement.tune.tuner import Tuner
from nccl_recorder_standins import settle_steps_late
from tune_fakes import FakeBinder, FakeFacts, ListEvents, rank_plan, topology, tune_cfg

SLOW_MS, FAST_MS = 6.0, 2.0  # step time on the first core and after the move
WINDOW, FLUSH_EVERY, LAG_STEPS = 20, 40, 2


class SlowStepsRule(Rule):
    """Moves main to CPU 2 when the window's median step is slow (the scripted trouble)."""

    name = "runqueue"

    def propose(self, ctx: RuleContext) -> Optional[Proposal]:
        if ctx.stats.median_ms > (SLOW_MS + FAST_MS) / 2 and ctx.layout.cpus(ThreadRole.MAIN) != {2}:
            return Proposal(self.name, ThreadRole.MAIN, frozenset({2}), "slow steps",
                            {"window": [ctx.stats.first_step, ctx.stats.last_step]})
        return None


class SteppingBinder(FakeBinder):
    """Moving main makes the training loop's steps fast from the next step it starts."""

    def __init__(self):
        super().__init__()
        self.moved_at_step: Optional[int] = None  # training steps finished when the move happened

    def set_role_cpus(self, role, cpus, reason):
        if role is ThreadRole.MAIN and self.moved_at_step is None:
            self.moved_at_step = self.monitor.step
        return super().set_role_cpus(role, cpus, reason)


def _step_work(ms: float) -> None:
    """A step of `ms` that releases the GIL, as a training step's kernels do. A pure-Python
    spin would hold it: the monitor thread, whose hand-over does a few dozen reads and
    writes, then waits a switch interval (5 ms) after each, and the window hand-over landed
    20 steps late in a full suite run (more threads to read, as more tests had run)."""
    end = time.perf_counter() + ms / 1e3
    while (left := end - time.perf_counter()) > 0:
        time.sleep(left)


@pytest.mark.slow
@pytest.mark.parametrize("early", [True, False], ids=["window-hand-over", "flush-batches"])
def test_a_move_is_judged_on_whole_windows_after_it_took_force(tmp_path, early):
    handle = placement.attach(policy="none", tune={"enabled": False},
                              monitor={"log_dir": str(tmp_path), "flush_every": FLUSH_EVERY,
                                       "exchange_every": FLUSH_EVERY, "rescan_every": FLUSH_EVERY,
                                       "summary_every": 0, "budget_pct": 0,
                                       # every window handed over as it ends (no paced hand-overs:
                                       # these steps are all slow alike, none "slower")
                                       "handover_min_s": 0})
    monitor = handle.monitor
    settle_steps_late(handle, LAG_STEPS)  # NCCL's durations come after the step: the last 2 steps wait
    binder = SteppingBinder()
    binder.rank_plan = rank_plan({"main": [0], "other": [2, 3]}, topo=topology(4))
    binder.monitor = monitor
    events = ListEvents()
    tuner = Tuner(binder, tune_cfg(window=WINDOW), events, facts=FakeFacts(), next_step=lambda: monitor.step + 2)
    tuner.rules = [SlowStepsRule()]
    handle.add_observer(tuner.observe, tuner.window_end if early else None)
    try:
        for _ in range(260):
            moved = binder.moved_at_step is not None and monitor.step >= binder.moved_at_step + 1
            _step_work(FAST_MS if moved else SLOW_MS)
            handle.step()
    finally:
        handle.close()
    applied = events.of("tune", phase="applied")
    assert applied, events.records
    verdicts = [e for e in events.records if e["type"] == "rollback" or e.get("phase") == "kept"]
    assert verdicts, events.records
    v = verdicts[0]
    # Delivered late: the trigger window closed after training had moved past it, by the comm
    # lag at least; at the next flush step without window_end (windows [1, 20], [21, 40] are
    # warm-up, so the trigger is [41, 60], whose records are built at the flush of step 80),
    # and with it as soon as step 62 (the lag) is done, long before that flush.
    trigger_last = applied[0]["evidence"]["window"][1]
    assert binder.moved_at_step >= trigger_last + LAG_STEPS
    if early:
        assert binder.moved_at_step < trigger_last + WINDOW, (binder.moved_at_step, trigger_last)
    else:
        assert binder.moved_at_step >= trigger_last + WINDOW - LAG_STEPS, (binder.moved_at_step, trigger_last)
    # Judged on a whole window of steps that all started after the move.
    first, last = v["judged_steps"]
    assert first >= binder.moved_at_step + 2 and last - first + 1 == WINDOW
    assert first == v["in_force_step"] == applied[0]["in_force_step"]
    # And so the verdict is the move's real effect: kept, the steps after it are the fast ones.
    assert v["type"] == "tune" and v["phase"] == "kept", v
    assert v["effect"]["after_median_ms"] < 0.7 * v["effect"]["before_median_ms"], v["effect"]
