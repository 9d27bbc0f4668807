"""The straggler classifier on recorded per-rank figures (pure function, no processes)."""
import math

from placement.monitor.record import RoleSample, StepRecord
from placement.monitor.straggler import (FIELDS, RankFigures, Thresholds, arrival_lateness_ms, classify,
                                         comm_baseline, figures_from_records)

T = 1_800_000_000.0  # a wall-clock second, as time.time() gives


def fig(rank, *, late_ms=0.0, step=20.0, data=0.0, comm=2.0, runq=0.1, nccl_runq=None, mhz=None, steps=20):
    return RankFigures(rank=rank, steps=steps, first_step=21, last_step=40, step_ms=step, data_ms=data,
                       comm_ms=comm, enter_t=T + late_ms / 1e3, main_runq_ms=runq, nccl_runq_ms=nccl_runq,
                       main_cpu_ms=step - comm - data, main_mhz=mhz)


def test_late_rank_with_runqueue_wait_is_cpu_slow_and_the_waiting_rank_is_not_named():
    # Recorded shape of the hog run: rank 0 waited 11 ms in the all-reduce (its comm time
    # grew), rank 1 arrived 11 ms late and its main thread sat 10 ms in the runqueue.
    figs = [fig(0, comm=13.0, runq=0.2), fig(1, late_ms=11.0, comm=2.1, runq=10.4)]
    rep = classify(figs)
    assert rep.names("cpu-slow") == [1]
    assert rep.names() == [1]
    assert rep.waiting == [0]
    s = rep.stragglers[0]
    assert math.isclose(s.lateness_ms, 11.0, rel_tol=1e-6)
    assert "runqueue" in s.why and "rank 0" in s.why


def test_late_rank_that_waits_for_data_is_data_slow():
    figs = [fig(0, comm=10.0), fig(1, late_ms=8.0, data=8.5, comm=2.0)]
    rep = classify(figs)
    assert [(s.kind, s.ranks) for s in rep.stragglers] == [("data-slow", [1])]


def test_late_rank_on_a_slower_core_is_cpu_slow():
    figs = [fig(0, mhz=3800.0, comm=9.0), fig(1, late_ms=7.0, mhz=2900.0)]
    assert classify(figs).names("cpu-slow") == [1]


def test_late_rank_with_no_cpu_or_data_excess_is_compute_slow():
    figs = [fig(0, comm=9.0), fig(1, late_ms=7.0), fig(2, comm=9.1), fig(3, comm=8.9)]
    rep = classify(figs)
    assert [(s.kind, s.ranks) for s in rep.stragglers] == [("compute-slow", [1])]
    assert rep.waiting == [0, 2, 3]


def test_nccl_thread_runqueue_counts_as_cpu_stall():
    figs = [fig(0, comm=9.0, nccl_runq=0.1), fig(1, late_ms=6.0, nccl_runq=5.0)]
    assert classify(figs).names("cpu-slow") == [1]


def test_all_ranks_together_but_collectives_slower_than_baseline_is_comm_slow():
    # Every rank enters within 0.2 ms; the all-reduce takes 14 ms/step against 4 ms before.
    figs = [fig(r, late_ms=0.1 * r, comm=14.0 + 0.1 * r, step=30.0) for r in range(4)]
    rep = classify(figs, baseline_transfer_ms=4.0)
    assert [(s.kind, s.ranks) for s in rep.stragglers] == [("comm-slow", [0, 1, 2, 3])]
    assert rep.transfer_ms == 14.0
    assert rep.waiting == []


def test_slow_collectives_with_one_rank_starved_of_cpu_name_that_rank_not_the_link():
    # Recorded shape of a hog window where rank 1 still arrived on time: its gloo threads share
    # the hogged core, so the all-reduce itself slowed for everyone, but only rank 1 waits for a CPU.
    figs = [fig(0, comm=14.0, runq=0.2), fig(1, late_ms=0.3, comm=14.1, runq=9.0)]
    rep = classify(figs, baseline_transfer_ms=4.0)
    assert [(s.kind, s.ranks) for s in rep.stragglers] == [("cpu-slow", [1])]
    assert rep.waiting == [0]
    assert "runqueue" in rep.stragglers[0].why


def test_collectives_at_their_usual_speed_name_nobody():
    figs = [fig(r, late_ms=0.1 * r, comm=4.2) for r in range(4)]
    assert classify(figs, baseline_transfer_ms=4.0).stragglers == []
    assert classify(figs).stragglers == []  # no baseline yet: comm-slow needs one


def test_small_arrival_differences_are_noise():
    th = Thresholds()
    figs = [fig(0), fig(1, late_ms=th.late_ms * 0.5)]
    assert classify(figs, th=th).stragglers == []


def test_ranks_without_collectives_or_alone_name_nobody():
    figs = [fig(0), fig(1, late_ms=50.0)]
    figs[0].enter_t = None
    assert classify(figs).stragglers == []
    assert classify([fig(0)]).stragglers == []
    assert classify([fig(0), fig(1, late_ms=50.0, steps=0)]).stragglers == []


def test_figures_travel_as_a_float_row_and_back():
    f = fig(3, late_ms=2.5, nccl_runq=None, mhz=3100.0)
    f.steps = 3
    f.enter_ts = (T, None, T + 0.5)
    row = f.to_row(slots=5)
    assert len(row) == len(FIELDS) + 5 and math.isnan(row[FIELDS.index("nccl_runq_ms")])
    back = RankFigures.from_row(row)
    assert back == f


def test_window_figures_from_step_records():
    recs = [StepRecord(rank=1, step=s, t=T + s, step_ms=10.0 + s, data_ms=1.0, comm_ms=2.0, comm_count=1,
                       roles={"main": RoleSample(threads=1, cpu_ms=5.0, runq_ms=float(s), mhz=None)},
                       comm_enter_t=T + s + 0.004) for s in (1, 2, 3)]
    f = figures_from_records(1, recs)
    assert (f.rank, f.steps, f.first_step, f.last_step) == (1, 3, 1, 3)
    assert f.step_ms == 12.0 and f.main_runq_ms == 2.0 and f.nccl_runq_ms is None and f.main_mhz is None
    assert math.isclose(f.enter_t, T + 2.004)
    assert figures_from_records(1, []) is None


def test_lateness_is_the_median_over_steps_so_one_slow_step_is_not_a_straggler():
    # Rank 1 is 40 ms late in one step of ten (a GC pause), on time otherwise: its mean entry
    # time is 4 ms late, above the threshold, but the per-step median says it is punctual.
    steps = 10
    r0 = fig(0, steps=steps)
    r1 = fig(1, late_ms=4.0, steps=steps)
    r0.enter_ts = tuple(T + i for i in range(steps))
    r1.enter_ts = tuple(T + i + (0.040 if i == 3 else 0.0001) for i in range(steps))
    lateness = arrival_lateness_ms([r0, r1])
    assert lateness[0] == 0.0 and math.isclose(lateness[1], 0.1, abs_tol=1e-3)  # float64 of wall time: ~0.2 us
    assert classify([r0, r1]).stragglers == []
    r1.enter_ts = tuple(T + i + 0.012 for i in range(steps))  # late every step
    assert classify([r0, r1]).names("compute-slow") == [1]


def test_comm_baseline_needs_history_and_ignores_one_lucky_window():
    assert comm_baseline([4.0, 4.2]) is None
    assert comm_baseline([1.0, 4.0, 4.2, 4.4]) == 4.1
