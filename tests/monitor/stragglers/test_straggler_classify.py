"""The straggler classifier on recorded per-rank figures (pure function, no processes)."""
import math

from placement.monitor.probes.budget import MAX_EVERY
from placement.records.step import RoleSample, StepRecord
from placement.monitor.stragglers.cost import arrival_lateness_ms
from placement.monitor.stragglers.figures import FIELDS, RankFigures, Thresholds, figures_from_records
from placement.monitor.stragglers.classify import classify, comm_baseline
from placement.monitor.crossrank.exchange import exchange_steps

T = 1_800_000_000.0  # a wall-clock second, as time.time() gives


def fig(rank, *, step=20.0, data=0.0, comm=2.0, runq=0.1, nccl_runq=None, mhz=None, steps=20, ours=None):
    """A rank's figures over steps 21..20+steps; `comm` ms in collectives every step: a rank
    that arrives L ms late waits L ms less in them than its peers."""
    return RankFigures(rank=rank, steps=steps, first_step=21, last_step=20 + steps, step_ms=step, data_ms=data,
                       comm_ms=comm, cpu_stall_ms=runq, nccl_runq_ms=nccl_runq,
                       main_cpu_ms=step - (comm or 0.0) - data, main_mhz=mhz, comm_steps=(comm,) * steps,
                       placement_cpu_ms=ours)


def test_late_rank_with_runqueue_wait_is_cpu_slow_and_the_waiting_rank_is_not_named():
    # Recorded shape of the hog run: rank 0 waited 11 ms in the all-reduce (its comm time
    # grew), rank 1 arrived 11 ms late and its main thread sat 10 ms in the runqueue.
    figs = [fig(0, comm=13.0, runq=0.2), fig(1, comm=2.0, runq=10.4)]
    rep = classify(figs)
    assert rep.names("cpu-slow") == [1]
    assert rep.names() == [1]
    assert rep.waiting == [0]
    s = rep.stragglers[0]
    assert math.isclose(s.lateness_ms, 11.0, rel_tol=1e-6)
    assert "runqueue" in s.why and "rank 0" in s.why


def test_a_rank_held_back_by_placements_own_threads_is_not_blamed_for_it():
    # rank 1 arrives 11 ms late, its main thread 10 ms in the runqueue; placement's own threads
    # took 6 ms/step of CPU there against 0.05 on rank 0: the why says it is placement's cost
    figs = [fig(0, comm=13.0, runq=0.2, ours=0.05), fig(1, comm=2.0, runq=10.4, ours=6.0)]
    s = classify(figs).stragglers[0]
    assert s.ranks == [1] and s.kind == "cpu-slow" and s.by_placement
    assert "placement's own threads took 6.0 ms/step" in s.why and "0.1 on peers" in s.why, s.why
    # the same stall with placement's threads as cheap as on the peers: the rank's own, said as before
    for ours in (0.06, None):
        figs = [fig(0, comm=13.0, runq=0.2, ours=0.05), fig(1, comm=2.0, runq=10.4, ours=ours)]
        s = classify(figs).stragglers[0]
        assert s.ranks == [1] and not s.by_placement and "placement" not in s.why, s.why
    # starved, all entering together (slow collectives): the same words
    figs = [fig(0, comm=14.0, runq=0.2, ours=0.05), fig(1, comm=14.1, runq=9.0, ours=4.0)]
    s = classify(figs, baseline_transfer_ms=4.0).stragglers[0]
    assert s.ranks == [1] and s.by_placement and "placement's own threads took 4.0" in s.why, s.why


def test_late_rank_that_waits_for_data_is_data_slow():
    figs = [fig(0, comm=10.0), fig(1, data=8.5, comm=2.0)]
    rep = classify(figs)
    assert [(s.kind, s.ranks) for s in rep.stragglers] == [("data-slow", [1])]


def test_late_rank_on_a_slower_core_is_cpu_slow():
    figs = [fig(0, mhz=3800.0, comm=9.0), fig(1, mhz=2900.0)]
    assert classify(figs).names("cpu-slow") == [1]


def test_late_rank_with_no_cpu_or_data_excess_is_compute_slow():
    figs = [fig(0, comm=9.0), fig(1), fig(2, comm=9.1), fig(3, comm=8.9)]
    rep = classify(figs)
    assert [(s.kind, s.ranks) for s in rep.stragglers] == [("compute-slow", [1])]
    assert rep.waiting == [0, 2, 3]


def test_nccl_thread_runqueue_counts_as_cpu_stall():
    figs = [fig(0, comm=9.0, nccl_runq=0.1), fig(1, nccl_runq=5.0)]
    assert classify(figs).names("cpu-slow") == [1]


def test_all_ranks_together_but_collectives_slower_than_baseline_is_comm_slow():
    # Every rank enters within 0.2 ms; the all-reduce takes 14 ms/step against 4 ms before.
    figs = [fig(r, comm=14.0 + 0.1 * r, step=30.0) for r in range(4)]
    rep = classify(figs, baseline_transfer_ms=4.0)
    assert rep.stragglers == []  # a slowdown every rank shares names no rank: it is the job's
    job = rep.job_wide
    assert (job.kind, job.cause) == ("comm-slow", "comm")
    assert math.isclose(job.cost_ms_per_step, 10.0) and math.isclose(job.cost_pct, 100 * 10.0 / 30.0)
    assert rep.transfer_ms == 14.0
    assert rep.waiting == []


def test_slow_collectives_with_one_rank_starved_of_cpu_name_that_rank_not_the_link():
    # Recorded shape of a hog window where rank 1 still arrived on time: its gloo threads share
    # the hogged core, so the all-reduce itself slowed for everyone, but only rank 1 waits for a CPU.
    figs = [fig(0, comm=14.0, runq=0.2), fig(1, comm=14.1, runq=9.0)]
    rep = classify(figs, baseline_transfer_ms=4.0)
    assert [(s.kind, s.ranks) for s in rep.stragglers] == [("cpu-slow", [1])]
    assert rep.waiting == [0]
    assert "runqueue" in rep.stragglers[0].why


def test_collectives_at_their_usual_speed_name_nobody():
    figs = [fig(r, comm=4.2 - 0.1 * r) for r in range(4)]
    assert classify(figs, baseline_transfer_ms=4.0).stragglers == []
    assert classify(figs).stragglers == []  # no baseline yet: comm-slow needs one


def test_small_arrival_differences_are_noise():
    th = Thresholds()
    figs = [fig(0), fig(1, comm=2.0 - th.late_ms * 0.5)]
    assert classify(figs, th=th).stragglers == []


def test_ranks_without_collectives_or_alone_name_nobody():
    figs = [fig(0, comm=52.0), fig(1)]
    figs[0].comm_steps = (None,) * 20
    assert classify(figs).stragglers == []
    assert classify([fig(0)]).stragglers == []
    assert classify([fig(0, comm=52.0), fig(1, steps=0)]).stragglers == []


def test_figures_travel_as_a_float_row_and_back():
    f = fig(3, nccl_runq=None, mhz=3100.0, steps=3, ours=0.25)
    f.comm_steps = (2.0, None, 2.5)
    row = f.to_row(slots=5)
    assert len(row) == len(FIELDS) + 5 and math.isnan(row[FIELDS.index("nccl_runq_ms")])
    back = RankFigures.from_row(row)
    assert back == f


def test_window_figures_from_step_records():
    recs = [StepRecord(rank=1, step=s, t=T + s, step_ms=10.0 + s, data_ms=1.0, comm_ms=2.0, comm_count=1,
                       roles={"main": RoleSample(threads=1, cpu_ms=5.0, runq_ms=float(s), mhz=None)},
                       comm_enter_t=T + s + 0.004, placement_cpu_ms=None if s == 3 else 0.1 * s) for s in (1, 2, 3)]
    f = figures_from_records(1, recs, 1, 3)
    assert (f.rank, f.steps, f.first_step, f.last_step) == (1, 3, 1, 3)
    assert f.step_ms == 12.0 and f.cpu_stall_ms == 2.0 and f.nccl_runq_ms is None and f.main_mhz is None
    assert math.isclose(f.placement_cpu_ms, 0.15)  # the steps that have it
    assert f.comm_steps == (2.0, 2.0, 2.0)
    # the window is the steps asked for: a step without a record is unknown, others are ignored
    f = figures_from_records(1, recs, 2, 5)
    assert (f.steps, f.first_step, f.last_step, f.comm_steps) == (2, 2, 5, (2.0, 2.0, None, None))
    assert figures_from_records(1, [], 1, 3).steps == 0


def test_lateness_is_the_median_over_steps_so_one_slow_step_is_not_a_straggler():
    # Rank 1 is 40 ms late in one step of ten (a GC pause), on time otherwise: its mean entry
    # time is 4 ms late, above the threshold, but the per-step median says it is punctual.
    steps = 10
    r0 = fig(0, steps=steps)
    r1 = fig(1, steps=steps)
    r0.comm_steps = tuple(42.0 if i == 3 else 2.1 for i in range(steps))  # rank 0 waited 40 ms once
    r1.comm_steps = (2.0,) * steps
    lateness = arrival_lateness_ms([r0, r1])
    assert lateness[0] == 0.0 and math.isclose(lateness[1], 0.1, abs_tol=1e-9)
    assert classify([r0, r1]).stragglers == []
    r0.comm_steps = (14.0,) * steps  # rank 0 waits 12 ms for rank 1 every step
    assert classify([r0, r1]).names("compute-slow") == [1]


def test_ranks_sending_different_steps_are_not_compared():
    assert arrival_lateness_ms([fig(0, comm=14.0), fig(1, steps=19)]) is None


def test_two_ranks_with_different_probe_cadences_and_identical_arrivals_name_nobody():
    # Each rank's records are built up to its own last probe step (rank 0 probes every 2nd step,
    # rank 1 every 3rd), so at the exchange at step 40 they hold different steps; each enters
    # every collective at the same instant but the step time ramps up (warm-up), so comparing
    # means over different steps would make one look 100 ms late. Both send the same steps.
    def recs(rank, last):
        return [StepRecord(rank=rank, step=s, t=T + s, step_ms=10.0 * s, data_ms=0.0, comm_ms=2.0, comm_count=1,
                           roles={"main": RoleSample(threads=1, cpu_ms=5.0, runq_ms=0.1)},
                           comm_enter_t=T + 0.01 * s * s) for s in range(1, last + 1)]

    first, last = exchange_steps(40, every=20)
    assert last <= 40 - MAX_EVERY + 1  # built on every rank, whatever its probe cadence
    figs = [figures_from_records(0, recs(0, 38), first, last), figures_from_records(1, recs(1, 36), first, last)]
    assert [(f.first_step, f.last_step, f.steps) for f in figs] == [(first, last, 20)] * 2
    rep = classify([RankFigures.from_row(f.to_row(20)) for f in figs])
    assert rep.stragglers == [] and arrival_lateness_ms(figs) == {0: 0.0, 1: 0.0}


def test_comm_baseline_needs_history_and_ignores_one_lucky_window():
    assert comm_baseline([4.0, 4.2]) is None
    assert comm_baseline([1.0, 4.0, 4.2, 4.4]) == 4.1


# ------------------------------------------------------------------ what a straggler costs
def steps_fig(rank, comm_steps, *, step=20.0, data=0.0, runq=0.1):
    """A rank whose comm time at step 21 + i is comm_steps[i]."""
    n = len(comm_steps)
    return RankFigures(rank=rank, steps=n, first_step=21, last_step=20 + n, step_ms=step, data_ms=data,
                       comm_ms=sum(comm_steps) / n, cpu_stall_ms=runq, nccl_runq_ms=None, main_cpu_ms=None,
                       main_mhz=None, comm_steps=tuple(comm_steps))


def test_a_late_rank_costs_its_lateness_over_its_peers_per_step():
    # Rank 2 enters 4 ms late at every step (its peers wait 4 ms longer in the all-reduce), rank 1
    # 1 ms late: without rank 2's lateness the 1 ms rank sets the pace, so rank 2 costs 3 ms/step.
    figs = [steps_fig(0, [6.0] * 10), steps_fig(1, [5.0] * 10), steps_fig(2, [2.0] * 10, runq=3.0)]
    rep = classify(figs)
    s2 = next(s for s in rep.stragglers if s.ranks == [2])
    assert s2.lateness_ms == 4.0 and math.isclose(s2.cost_ms_per_step, 3.0)
    assert math.isclose(s2.cost_pct, 100 * 3.0 / 20.0)
    # its runqueue excess (2.9 ms over its peers' 0.1) explains all but 0.1 ms of the cost
    assert s2.kind == "cpu-slow" and s2.cost_by_cause == {"cpu_stall": 2.9, "data": 0.0, "compute": 0.1}
    s1 = next(s for s in rep.stragglers if s.ranks == [1])
    assert s1.cost_ms_per_step == 0.0  # never the latest: fixing it alone gains nothing
    # Both fixed: the job's step is 4 ms shorter (the earliest rank, at 0, sets the pace).
    assert math.isclose(rep.cost_ms_per_step, 4.0) and math.isclose(rep.cost_pct, 20.0)


def test_two_equally_late_ranks_cost_little_alone_and_their_lateness_together():
    # Ranks 1 and 2 alternate as the latest, 5.0 and 4.8 ms late: fixing either alone leaves the
    # other setting the pace (0.2 ms every other step), fixing both gives the 5 ms back.
    late_a, late_b = [1.0, 1.2] * 5, [1.2, 1.0] * 5
    figs = [steps_fig(0, [6.0] * 10), steps_fig(1, late_a), steps_fig(2, late_b), steps_fig(3, [6.0] * 10)]
    rep = classify(figs)
    assert rep.names() == [1, 2]
    for s in rep.stragglers:
        assert math.isclose(s.cost_ms_per_step, 0.1, abs_tol=1e-9)  # 0.2 ms in half the steps
    assert math.isclose(rep.cost_ms_per_step, 5.0)


def test_a_late_rank_waiting_for_data_costs_data():
    figs = [steps_fig(0, [7.0] * 10), steps_fig(1, [2.0] * 10, data=6.0)]
    s = classify(figs).stragglers[0]
    assert s.kind == "data-slow" and math.isclose(s.cost_ms_per_step, 5.0)
    assert s.cost_by_cause == {"cpu_stall": 0.0, "data": 5.0, "compute": 0.0}  # 6 ms of excess, scaled to the cost


def test_one_late_step_costs_its_share_but_makes_no_candidate():
    # A 40 ms GC pause in one step of ten: a mean cost of 4 ms/step, but median lateness 0.
    figs = [steps_fig(0, [42.0] + [2.0] * 9), steps_fig(1, [2.0] * 10)]
    assert classify(figs).stragglers == []


# ---------------------------------------------------------------------------- naming (precision)
def window(first, late_ms, step=20.0, ranks=2, slow=1):
    """Figures of one window starting at step `first`: rank `slow` enters `late_ms` late."""
    figs = []
    for r in range(ranks):
        comm = [2.0 if r == slow else 2.0 + late_ms] * 10
        f = steps_fig(r, comm, step=step)
        f.first_step, f.last_step = first, first + 9
        figs.append(f)
    return figs


def test_a_straggler_is_named_from_its_second_costly_window_and_only_while_it_costs():
    from placement.monitor.stragglers.naming import Naming

    th = Thresholds()
    naming = Naming(th)
    named = []
    # 1 ms late on a 20 ms step: 5% of step time, above the 3% default; 0.4 ms: 2%, below.
    for i, late in enumerate([1.0, 1.0, 1.0, 0.4, 1.0, 1.0, 0.0]):
        rep = naming.decide(classify(window(1 + 10 * i, late), th=th), 1 + 10 * i)
        named.append(rep.names())
    assert named == [[], [1], [1], [], [], [1], []]
    rep = naming.decide(classify(window(71, 1.0), th=th), 71)
    assert rep.names() == [] and naming.held_back >= 3


def test_a_window_judged_without_a_ranks_row_neither_confirms_nor_clears_it():
    from placement.monitor.stragglers.naming import Naming

    # Rank 1 of 3 enters 1 ms late every window; its row misses the exchange of the second
    # window (judged on ranks 0 and 2: nobody late). It is named at its next window, its second
    # judged one, as slow since the first; once named, a window without its row leaves it named.
    def without_1(first):
        return [f for f in window(first, 1.0, ranks=3) if f.rank != 1]

    th = Thresholds()
    naming = Naming(th)
    got = [naming.decide(classify(window(1, 1.0, ranks=3), th=th), 1).names(),
           naming.decide(classify(without_1(11), th=th), 11, absent=[1]).names()]
    rep = naming.decide(classify(window(21, 1.0, ranks=3), th=th), 21)
    assert got == [[], []] and rep.names() == [1] and rep.stragglers[0].since_step == 1
    assert naming.decide(classify(without_1(31), th=th), 31, absent=[1]).names() == []
    rep = naming.decide(classify(window(41, 1.0, ranks=3), th=th), 41)
    assert rep.names() == [1] and rep.stragglers[0].since_step == 1
    # the same windows with rank 1's row, on time in the second: that window clears its streak
    naming = Naming(th)
    naming.decide(classify(window(1, 1.0, ranks=3), th=th), 1)
    assert naming.decide(classify(window(11, 0.0, ranks=3), th=th), 11).names() == []
    assert naming.decide(classify(window(21, 1.0, ranks=3), th=th), 21).names() == []


def test_a_named_straggler_says_since_when_and_what_it_costs():
    from placement.monitor.stragglers.naming import Naming

    naming = Naming(Thresholds())
    naming.decide(classify(window(1, 2.0)), 1)
    rep = naming.decide(classify(window(11, 2.0)), 11)
    (s,) = rep.stragglers
    assert s.since_step == 1 and math.isclose(s.cost_ms_per_step, 2.0) and math.isclose(s.cost_pct, 10.0)
    d = rep.to_dict()
    assert d["cost_pct"] == 10.0 and d["stragglers"][0]["cost_by_cause"]["compute"] == 2.0


def test_a_job_wide_slowdown_is_reported_once_per_episode_and_names_no_rank():
    from placement.monitor.stragglers.naming import Naming

    naming = Naming(Thresholds())
    slow = [fig(r, comm=14.0 + 0.1 * r, step=30.0) for r in range(4)]
    said = [naming.decide(classify(slow, baseline_transfer_ms=4.0), 1 + 10 * i).job_wide for i in range(4)]
    assert [j is not None for j in said] == [False, True, False, False]
    assert said[1].cause == "comm" and said[1].kind == "comm-slow"
    naming.decide(classify([fig(r, comm=4.0, step=20.0) for r in range(4)], baseline_transfer_ms=4.0), 41)
    again = [naming.decide(classify(slow, baseline_transfer_ms=4.0), 51 + 10 * i).job_wide for i in range(2)]
    assert [j is not None for j in again] == [False, True]


def test_one_confirm_window_names_at_once():
    from placement.monitor.stragglers.naming import Naming

    naming = Naming(Thresholds(confirm_windows=1))
    assert naming.decide(classify(window(1, 2.0)), 1).names() == [1]


def test_a_rank_a_little_late_behind_a_much_later_one_is_not_material():
    # Recorded shape (4 ranks over 2 nodes, rank 3 waiting 40 ms for data): rank 1 also entered
    # late, here 1.2 ms after the earliest; fixing it as well as rank 3 gains those 1.2 ms more,
    # 2.6% of the 47 ms step, under the 3% default: a candidate, not material.
    figs = [steps_fig(0, [46.0] * 10, step=47.0), steps_fig(1, [44.8] * 10, step=47.0),
            steps_fig(2, [46.0] * 10, step=47.0), steps_fig(3, [6.0] * 10, step=47.0, data=40.0)]
    rep = classify(figs)
    material = {s.ranks[0]: s.material for s in rep.stragglers}
    assert material == {3: True, 1: False}


def test_two_tied_ranks_are_material_together():
    late_a, late_b = [1.0, 1.2] * 5, [1.2, 1.0] * 5
    figs = [steps_fig(0, [6.0] * 10), steps_fig(1, late_a), steps_fig(2, late_b), steps_fig(3, [6.0] * 10)]
    assert all(s.material for s in classify(figs).stragglers)


def turns_window(first, late_at, late_ms=1.0, step=20.0):
    """Two ranks over steps first..first+len(late_at)-1: rank 1 enters late_ms late at the steps
    where late_at is true, rank 0 at the others (the ranks take turns, as on a busy host)."""
    n = len(late_at)
    figs = [steps_fig(0, [2.0 + late_ms if late else 2.0 for late in late_at], step=step),
            steps_fig(1, [2.0 if late else 2.0 + late_ms for late in late_at], step=step)]
    for f in figs:
        f.first_step, f.last_step = first, first + n - 1
    return figs


def test_a_rank_late_at_most_steps_but_not_all_is_named_only_once_it_persists():
    from placement.monitor.stragglers.naming import Naming

    # Rank 1 late 1 ms (5% of the step) at 7 steps of 10, rank 0 at the other 3: what a balanced
    # soak on a busy host shows for a few windows in a row, the ranks' DataLoader workers taking
    # turns on its cores. Material every window, not steady: named at persist_windows, not before.
    th = Thresholds()
    pattern = [True, True, False, True, True, False, True, True, False, True]
    rep = classify(turns_window(1, pattern), th=th)
    (s,) = rep.stragglers
    assert s.ranks == [1] and s.material
    assert (s.steps_late, s.steps_judged, s.steps_before_late) == (7, 10, 0)
    naming = Naming(th)
    named = [naming.decide(classify(turns_window(1 + 10 * i, pattern), th=th), 1 + 10 * i).names()
             for i in range(th.persist_windows + 1)]
    assert named == [[]] * (th.persist_windows - 1) + [[1], [1]]
    # the same rank late at every step: named at its second window
    naming = Naming(th)
    named = [naming.decide(classify(turns_window(1 + 10 * i, [True] * 10), th=th), 1 + 10 * i).names()
             for i in range(3)]
    assert named == [[], [1], [1]]


def test_a_slowdown_that_starts_inside_a_window_is_named_at_the_next():
    from placement.monitor.stragglers.naming import Naming

    # Rank 1 slows at the 4th step of its first window (7 of 10 late), then at every step: steady
    # from its first late step, so named in its second window as one slow from a window's start is.
    th = Thresholds()
    naming = Naming(th)
    first = classify(turns_window(1, [False] * 3 + [True] * 7), th=th)
    assert (first.stragglers[0].steps_late, first.stragglers[0].steps_before_late) == (7, 3)
    assert naming.decide(first, 1).names() == []
    assert naming.decide(classify(turns_window(11, [True] * 10), th=th), 11).names() == [1]
    # ... whereas 3 steps on time in its second window are 3 of its steps not late
    naming = Naming(th)
    naming.decide(classify(turns_window(1, [True] * 10), th=th), 1)
    assert naming.decide(classify(turns_window(11, [False] * 3 + [True] * 7), th=th), 11).names() == []


def test_a_starved_rank_is_as_steady_as_the_steps_its_collectives_were_slow():
    # Every rank enters together; the collectives take 14 ms against 4 at 8 steps of 10 and the
    # usual 4 at 2: rank 1's threads wait for a CPU. The steps that count are the slow ones.
    comm = [14.0] * 4 + [4.0] * 2 + [14.0] * 4
    figs = [steps_fig(0, comm, runq=0.2), steps_fig(1, [c + 0.1 for c in comm], runq=9.0)]
    for f in figs:
        f.nccl_runq_ms = None
    (s,) = classify(figs, baseline_transfer_ms=4.0).stragglers
    assert s.kind == "cpu-slow" and s.lateness_ms is None
    assert (s.steps_late, s.steps_judged, s.steps_before_late) == (8, 10, 0)
