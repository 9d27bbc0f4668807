"""Window summaries, the judge, the noise band, back-off and the role layout."""
from __future__ import annotations

import pytest

from placement.records.step import RoleSample
from placement.roles import ThreadRole
from placement.tune.judge import DEFAULT_NOISE_PCT, Backoff, NoiseBand, judge
from placement.tune.layout import CoreMap, RoleLayout
from placement.tune.window import summarize
from tune_fakes import rank_plan, record, topology, window

MAIN, DL = ThreadRole.MAIN, ThreadRole.DATALOADER


def test_summary_takes_medians_and_ignores_unknown_roles():
    recs = [record(i, 10.0, data_ms=2.0, comm_ms=5.0, roles={"main": {"cpu_ms": 8.0, "runq_ms": 1.0, "cpus": [i % 2]}})
            for i in range(9)]
    recs[4].step_ms = 100.0  # one outlier moves no median
    recs[0].roles["future_role"] = RoleSample(threads=1, cpu_ms=1.0)
    s = summarize(recs)
    assert s.n == 9 and s.median_ms == 10.0 and (s.first_step, s.last_step) == (0, 8)
    assert s.data_share_pct == 20.0 and s.comm_share_pct == 50.0
    assert s.roles.keys() == {MAIN}
    assert s.role(MAIN).cpu_share_pct == 80.0 and s.role(MAIN).runq_share_pct == 10.0
    assert s.role(MAIN).cpus == {0, 1}
    assert s.spikes() == tuple(i == 4 for i in range(9))


def test_cold_role_samples_are_shares_of_the_steps_they_cover():
    recs = [record(i, 10.0 if i < 5 else 30.0) for i in range(10)]
    # sampled every 5 steps, figures are per-step means over those 5 steps
    recs[4].roles["dataloader"] = RoleSample(threads=2, cpu_ms=5.0, span_steps=5)
    recs[9].roles["dataloader"] = RoleSample(threads=2, cpu_ms=15.0, span_steps=5)
    s = summarize(recs)
    assert s.role(DL).cpu_share_pct == 50.0 and s.role(DL).threads == 2
    assert s.step_totals("minflt") == (None,) * 10


def test_summary_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        summarize([])


def test_judge_keeps_a_gain_beyond_the_band_and_reverts_otherwise():
    before = summarize(window(10, step_ms=20.0))
    assert judge(None, before, summarize(window(10, step_ms=10.0)), 5.0, 2.0).keep
    v = judge(None, before, summarize(window(10, step_ms=19.0)), 5.0, 2.0)  # 5% < 7% needed
    assert not v.keep and v.why.startswith("no gain") and v.effect()["gain_pct"] == 5.0
    v = judge(None, before, summarize(window(10, step_ms=25.0)), 5.0, 2.0)
    assert not v.keep and v.why.startswith("worse")


def test_judge_weighs_the_window_after_against_the_quiet_baseline():
    trigger = summarize(window(10, step_ms=20.0))
    # back at the quiet level: kept although the gain over the trigger is inside need + trouble
    v = judge(10.0, trigger, summarize(window(10, step_ms=10.5)), 5.0, 2.0)
    assert v.keep and "quiet" in v.why and v.effect()["quiet_median_ms"] == 10.0
    # a partial fix, well beyond the band: kept; no fix: rolled back although quiet is known
    assert judge(10.0, trigger, summarize(window(10, step_ms=15.0)), 5.0, 2.0).keep
    assert not judge(10.0, trigger, summarize(window(10, step_ms=19.5)), 5.0, 2.0).keep
    # a trigger window at the quiet level (nothing to recover from) must beat it by the band
    quiet_trigger = summarize(window(10, step_ms=10.2))
    assert not judge(10.0, quiet_trigger, summarize(window(10, step_ms=10.0)), 5.0, 2.0).keep


def test_noise_band_comes_from_quiet_windows_only():
    steady, wobbly, jittery = NoiseBand(), NoiseBand(), NoiseBand()
    assert steady.pct() == DEFAULT_NOISE_PCT  # nothing quiet seen yet
    for ms in (10.0, 10.1, 10.0, 10.1):
        steady.add_quiet(summarize(window(20, step_ms=ms)))
    for ms in (10.0, 13.0, 10.0, 13.0):
        wobbly.add_quiet(summarize(window(20, step_ms=ms)))
    assert steady.pct() < 5.0 < 50.0 < wobbly.pct()
    # with fewer quiet windows: the standard error of their medians
    jittery.add_quiet(summarize(window(20, step_ms=10.0, jitter=0.5)))
    calm = NoiseBand()
    calm.add_quiet(summarize(window(20, step_ms=10.0, jitter=0.01)))
    assert calm.pct() < 1.0 < jittery.pct()


def test_one_quiet_window_far_off_does_not_widen_the_noise_band():
    # Three quiet windows, the last one a co-runner's first window that no rule recognised:
    # a band as wide as that shift (140%) would keep every later move from being kept.
    band = NoiseBand()
    for ms in (3.23, 3.19, 7.79):
        band.add_quiet(summarize(window(20, step_ms=ms, jitter=0.01)))
    assert band.pct() < 10.0
    assert band.baseline_ms() == pytest.approx(3.23, rel=0.02)
    trigger = summarize(window(20, step_ms=7.28))
    assert judge(band.baseline_ms(), trigger, summarize(window(20, step_ms=3.66)), band.pct(), 5.0).keep


def test_back_off_doubles_per_revert_up_to_the_cap_and_resets_on_keep():
    b = Backoff(cap_windows=6)
    key = ("runqueue", "main")
    assert [b.on_revert(key, w) for w in (0, 10, 20, 30)] == [2, 4, 6, 6]
    assert b.blocked(key, 31) and b.blocked(key, 36) and not b.blocked(key, 37)
    assert not b.blocked(("runqueue", "nccl"), 31)
    b.on_keep(key)
    assert not b.blocked(key, 31) and b.on_revert(key, 40) == 2


def test_layout_bounds_are_the_share_within_usable_cpus():
    topo = topology(8)
    topo.cpus[3].allowed = False
    layout = RoleLayout.from_plan(rank_plan({"main": [0], "other": [2, 3, 4]}, topo=topo))
    assert layout.bounds == {0, 2, 4}
    assert layout.cpus(ThreadRole.OTHER) == {2, 4}
    with pytest.raises(ValueError):
        layout.with_role(MAIN, frozenset({5}))
    assert layout.with_role(MAIN, frozenset({2})).cpus(MAIN) == {2}


def test_core_map_without_topology_is_one_core_per_cpu():
    cm = CoreMap.from_plan(rank_plan({"other": [0, 1]}))
    assert cm.cores == (frozenset({0}), frozenset({1})) and cm.rank_of({0, 1}) is None
    smt = CoreMap.from_plan(rank_plan({"other": [0, 1, 2, 3]},
                                      topo=topology(4, smt=True, perf_rank={1: 0, 3: 0, 0: 1, 2: 1})))
    assert smt.core_of(2) == {0, 2} and smt.cores_of({3}) == {1, 3} and smt.rank_of({0, 1}) == 0
