"""Each tune rule fires on its evidence and stays quiet on noise (synthetic record streams)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from placement.config import TUNE_RULES
from placement.roles import ThreadRole
from placement.tune.layout import RoleLayout
from placement.tune.rules import RULES, RuleContext
from placement.tune.window import summarize
from tune_fakes import FakeFacts, hog, rank_plan, topology, tune_cfg, window

MAIN, NCCL, PIN, DL, OTHER = (ThreadRole.MAIN, ThreadRole.NCCL, ThreadRole.PIN_MEMORY,
                              ThreadRole.DATALOADER, ThreadRole.OTHER)


def ctx(records, roles, *, topo=None, facts=None, niced=True, memory="bind", **cfg):
    topo = topo or topology(8)
    return RuleContext(stats=summarize(records), layout=RoleLayout.from_plan(rank_plan(roles, memory, topo)),
                       cfg=tune_cfg(**cfg), facts=facts or FakeFacts(), memory_mode=memory,
                       background_niced=niced)


PLAN = {"main": [0], "nccl": [1], "pin_memory": [1], "dataloader": [4, 5], "other": [2, 3, 4, 5, 6, 7]}
NCCL_IDLE = {"cpu_ms": 0.02}  # NCCL threads exist (and hold their core) but barely run


def test_rule_names_match_config():
    assert tuple(RULES) == TUNE_RULES


# ---- runqueue -------------------------------------------------------------------
def test_runqueue_moves_main_off_a_foreign_hog_to_the_fastest_free_core():
    topo = topology(8, perf_rank={6: 0, 7: 0, 2: 1, 3: 1, 0: 1, 1: 1, 4: 1, 5: 1})
    roles = {"main": [0], "nccl": [1], "dataloader": [4, 5], "other": [2, 3, 6, 7]}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.4, "cpus": [0]}})
    facts = FakeFacts(foreign=[hog(0)])
    p = RULES["runqueue"]().propose(ctx(recs, roles, topo=topo, facts=facts))
    assert p is not None and p.role is MAIN
    assert p.cpus == {6}  # fastest free core; 0 has the hog, 1 is nccl's
    assert p.evidence["foreign"][0]["pid"] == 4242 and p.evidence["foreign"][0]["pinned"]
    assert p.evidence["runq_pct"] == pytest.approx(40.0)
    assert "hog" in p.reason


def test_runqueue_scans_proc_only_when_a_move_can_follow():
    # A rank alone on its core (the 2-core plan: main, nccl and other share CPU 0) whose main
    # waits in every window: no other core to go to, so no /proc scan of the machine's threads
    # (a scan reads every thread of every process: it was most of the monitor thread's CPU in a
    # DDP job with DataLoader workers, benchmarks/job_cost.py).
    roles = {"main": [0], "nccl": [0], "pin_memory": [0], "other": [0]}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.4}, "nccl": NCCL_IDLE})
    facts = FakeFacts(foreign=[hog(0)])
    rule = RULES["runqueue"]()
    for _ in range(3):
        assert rule.propose(ctx(recs, roles, topo=topology(1), facts=facts)) is None
    assert facts.foreign_calls == 0
    # With a free core the scan is made and names the hog.
    facts = FakeFacts(foreign=[hog(0)])
    p = RULES["runqueue"]().propose(ctx(recs, {"main": [0], "nccl": [0], "other": [1]}, topo=topology(2), facts=facts))
    assert p is not None and p.cpus == {1} and facts.foreign_calls >= 1
    assert p.evidence["foreign"][0]["pid"] == 4242


def test_a_hot_role_without_live_threads_holds_no_core():
    roles = {"main": [0], "nccl": [1], "pin_memory": [1], "other": [1]}  # the 2-CPU plan of a CPU-only job
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.4}})
    p = RULES["runqueue"]().propose(ctx(recs, roles, topo=topology(2), facts=FakeFacts(foreign=[hog(0)])))
    assert p.role is MAIN and p.cpus == {1}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.4}, "nccl": NCCL_IDLE})
    assert RULES["runqueue"]().propose(ctx(recs, roles, topo=topology(2), facts=FakeFacts(foreign=[hog(0)]))) is None


def test_fleeing_a_hog_onto_our_workers_core_swaps_them_in_one_action():
    # The 2-CPU plan under a hog on main's CPU 0: main goes to CPU 1, and the DataLoader
    # workers that ran there take CPU 0 in the same action (one judgement); `other` (threads
    # of this process, GIL holders) stays with main rather than be descheduled behind the hog.
    plan = {"main": [0], "nccl": [1], "pin_memory": [1], "dataloader": [1], "other": [1]}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.4, "cpus": [0]}, "dataloader": {"cpu_ms": 0.3}})
    p = RULES["runqueue"]().propose(ctx(recs, plan, topo=topology(2), facts=FakeFacts(foreign=[hog(0)])))
    assert p.role is MAIN and p.cpus == {1}
    assert dict(p.also) == {DL: {0}} and "dataloader makes room: 1 -> 0" in p.reason
    # with CPUs of their own left, the workers only give up the core main takes
    plan = {"main": [0], "nccl": [1], "dataloader": [2, 3], "other": [2, 3]}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.4, "cpus": [0]}, "nccl": NCCL_IDLE})
    p = RULES["runqueue"]().propose(ctx(recs, plan, topo=topology(4), facts=FakeFacts(foreign=[hog(0)])))
    assert p.cpus == {2} and dict(p.also) == {DL: {3}}


def test_main_stays_off_a_core_where_our_own_threads_are_busy_and_says_so_once():
    # A CPU-only rank computing on its intra-op pool: main's OpenMP team has a thread on
    # `other`'s CPU 1, busy most of the step. Main moved there would share a core with a thread
    # of its own team (contention --pool: steps 7 -> 96 ms); with the hog on CPU 0 it stays.
    plan = {"main": [0], "nccl": [1], "pin_memory": [1], "dataloader": [1], "other": [1]}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.4, "cpus": [0]}, "other": {"cpu_ms": 0.6}})
    rule = RULES["runqueue"]()
    c = ctx(recs, plan, topo=topology(2), facts=FakeFacts(foreign=[hog(0)]))
    p = rule.propose(c)
    assert p is not None and not p.is_move and p.role is None
    assert p.evidence["held_by_own"] == [{"core": [1], "role": "other", "cpu_pct_per_cpu": 60.0}]
    assert "stays" in p.reason and "other 60% per CPU" in p.reason
    assert rule.propose(c) is None  # said once
    # the same plan whose other threads barely run (main computes alone): main flees to CPU 1
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.4, "cpus": [0]}, "other": {"cpu_ms": 0.02}})
    p = RULES["runqueue"]().propose(ctx(recs, plan, topo=topology(2), facts=FakeFacts(foreign=[hog(0)])))
    assert p.is_move and p.role is MAIN and p.cpus == {1}
    # busy per CPU counts: an other set of 4 CPUs, 60% busy in all, leaves each of them free
    plan = {"main": [0], "nccl": [1], "dataloader": [2, 3], "other": [2, 3, 4, 5]}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.4, "cpus": [0]}, "nccl": NCCL_IDLE,
                             "other": {"cpu_ms": 0.6}})
    p = RULES["runqueue"]().propose(ctx(recs, plan, topo=topology(6), facts=FakeFacts(foreign=[hog(0)])))
    assert p.is_move and p.role is MAIN and p.cpus == {4}  # of those, the one without DataLoader workers


def test_runqueue_skips_a_core_with_a_pinned_foreign_thread():
    roles = {"main": [0], "nccl": [1], "other": [2, 3]}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.3}, "nccl": NCCL_IDLE})
    facts = FakeFacts(foreign=[hog(0), hog(2, pid=99)])
    p = RULES["runqueue"]().propose(ctx(recs, roles, topo=topology(4), facts=facts))
    assert p.cpus == {3}


def test_runqueue_moves_our_busy_co_runner_before_the_hot_thread():
    roles = {"main": [0], "nccl": [2], "pin_memory": [0], "other": [3, 4, 5, 6, 7]}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.3}, "nccl": NCCL_IDLE,
                             "pin_memory": {"cpu_ms": 0.4, "runq_ms": 0.1}})
    facts = FakeFacts()
    p = RULES["runqueue"]().propose(ctx(recs, roles, facts=facts))
    assert p.role is PIN and p.cpus == {3}  # a free core of the share (1 is not in it), not main's
    assert p.evidence["co_runner"]["role"] == "pin_memory"


def test_runqueue_takes_the_hot_core_out_of_a_background_set():
    roles = {"main": [0], "nccl": [1], "dataloader": [0, 2, 3], "other": [2, 3]}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.3}, "dataloader": {"cpu_ms": 1.2}})
    p = RULES["runqueue"]().propose(ctx(recs, roles, topo=topology(4)))
    assert p.role is DL and p.cpus == {2, 3}


def test_after_fleeing_a_hog_main_evicts_our_workers_to_the_hogged_core():
    # The 2-CPU plan after the runqueue rule moved main off the hog on CPU 0: main now shares
    # CPU 1 with the DataLoader workers. No free core is left, but the workers run niced and
    # may share the hog's core; main may not.
    plan = {"main": [0], "nccl": [1], "pin_memory": [1], "dataloader": [1], "other": [1]}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.2, "cpus": [1]}, "dataloader": {"cpu_ms": 0.3}})
    c = ctx(recs, plan, topo=topology(2), facts=FakeFacts(foreign=[hog(0)]))
    c = replace(c, layout=c.layout.with_role(MAIN, frozenset({1})))
    p = RULES["runqueue"]().propose(c)
    assert p.role is DL and p.cpus == {0}
    # main itself is never sent back onto the hogged core
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.2, "cpus": [1]}})
    assert RULES["runqueue"]().propose(replace(c, stats=summarize(recs))) is None
    assert p.evidence["co_runner"]["role"] == "dataloader"


def test_runqueue_ignores_an_idle_co_runner_and_looks_in_proc():
    roles = {"main": [0], "nccl": [1], "pin_memory": [0], "other": [2, 3]}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.3}, "pin_memory": {"cpu_ms": 0.01},
                             "nccl": NCCL_IDLE})
    facts = FakeFacts(foreign=[hog(0)])
    p = RULES["runqueue"]().propose(ctx(recs, roles, topo=topology(4), facts=facts))
    assert p.role is MAIN and p.cpus == {2}
    assert facts.foreign_calls >= 1


def test_runqueue_quiet_on_noise_below_threshold():
    recs = window(40, jitter=0.3, roles={"main": {"cpu_ms": 0.8, "runq_ms": 0.05}, "nccl": {"runq_ms": 0.08}})
    facts = FakeFacts(foreign=[hog(0)])
    assert RULES["runqueue"]().propose(ctx(recs, PLAN, facts=facts)) is None
    assert facts.foreign_calls == 0  # no /proc scan without evidence


def test_runqueue_quiet_when_only_a_few_steps_wait():
    recs = window(20, roles={"main": {"cpu_ms": 0.8, "runq_ms": 0.0}})
    for r in recs[:8]:  # 8 of 20 steps: the median does not move
        r.roles["main"].runq_ms = 0.5 * r.step_ms
    assert RULES["runqueue"]().propose(ctx(recs, PLAN)) is None


def test_runqueue_gives_up_without_a_free_core():
    roles = {"main": [0], "nccl": [1]}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.4}, "nccl": NCCL_IDLE})
    assert RULES["runqueue"]().propose(ctx(recs, roles, topo=topology(2), facts=FakeFacts(foreign=[hog(0)]))) is None


def test_runqueue_moves_a_whole_core_when_main_holds_a_whole_core():
    topo = topology(8, smt=True)  # cores {0,4} {1,5} {2,6} {3,7}
    roles = {"main": [0, 4], "nccl": [1, 5], "other": [2, 3, 6, 7]}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.4}, "nccl": NCCL_IDLE})
    p = RULES["runqueue"]().propose(ctx(recs, roles, topo=topo, facts=FakeFacts(foreign=[hog(4)])))
    assert p.cpus == {2, 6}
    roles.update(main=[0], other=[2, 3, 4, 6, 7])  # one thread of its core: moves to one thread of another
    p = RULES["runqueue"]().propose(ctx(recs, roles, topo=topo, facts=FakeFacts(foreign=[hog(0)])))
    assert p.cpus == {2}


# ---- nccl_core ---------------------------------------------------------------------
def test_nccl_core_fires_when_comm_heavy_and_sharing_main():
    roles = {"main": [0], "nccl": [0], "pin_memory": [1], "other": [2, 3, 4, 5, 6, 7]}
    recs = window(20, comm_frac=0.5, roles={"main": {"cpu_ms": 0.4}, "nccl": {"cpu_ms": 0.3, "threads": 2},
                                            "pin_memory": {"cpu_ms": 0.01}})
    p = RULES["nccl_core"]().propose(ctx(recs, roles))
    assert p.role is NCCL and p.cpus == {2}
    assert p.evidence["shares_with"] == "main" and p.evidence["comm_pct"] == pytest.approx(50.0)


def test_nccl_core_spreads_threads_crowded_on_one_core():
    roles = {"main": [0], "nccl": [1], "other": [2, 3, 4, 5, 6, 7]}
    recs = window(20, comm_frac=0.5, roles={"main": {"cpu_ms": 0.4}, "nccl": {"cpu_ms": 0.3, "threads": 3}})
    p = RULES["nccl_core"]().propose(ctx(recs, roles))
    assert p.cpus == {1, 2}


@pytest.mark.parametrize("comm_frac, roles", [
    (0.1, {"main": [0], "nccl": [0], "other": [2, 3]}),  # comm light
    (0.5, {"main": [0], "nccl": [1], "other": [2, 3]}),  # a core of its own already
])
def test_nccl_core_quiet(comm_frac, roles):
    recs = window(20, comm_frac=comm_frac, jitter=0.2, roles={"main": {"cpu_ms": 0.4}, "nccl": {"cpu_ms": 0.3}})
    assert RULES["nccl_core"]().propose(ctx(recs, roles, topo=topology(4))) is None


# ---- dataloader_size ---------------------------------------------------------------
def test_dataloader_grows_onto_a_spare_core_when_saturated():
    roles = {"main": [0], "nccl": [1], "dataloader": [2], "other": [2, 3]}
    recs = window(20, data_frac=0.4, roles={"main": {"cpu_ms": 0.5}, "dataloader": {"cpu_ms": 0.95, "threads": 2},
                                            "nccl": NCCL_IDLE})
    p = RULES["dataloader_size"]().propose(ctx(recs, roles, topo=topology(4)))
    assert p.role is DL and p.cpus == {2, 3}
    assert p.evidence["workers_busy_pct_per_cpu"] == pytest.approx(95.0)


def test_dataloader_borrows_a_waiting_hot_core_only_when_workers_are_niced():
    roles = {"main": [0], "dataloader": [1]}
    recs = window(20, data_frac=0.5, roles={"main": {"cpu_ms": 0.3}, "dataloader": {"cpu_ms": 0.9, "runq_ms": 0.1}})
    p = RULES["dataloader_size"]().propose(ctx(recs, roles, topo=topology(2), niced=True))
    assert p.cpus == {0, 1} and "niced" in p.reason
    assert RULES["dataloader_size"]().propose(ctx(recs, roles, topo=topology(2), niced=False)) is None


def test_dataloader_shrinks_when_idle_and_main_waits_on_a_shared_core():
    roles = {"main": [0], "nccl": [1], "dataloader": [0, 2, 3], "other": [2, 3]}
    recs = window(20, roles={"main": {"cpu_ms": 0.5, "runq_ms": 0.2}, "dataloader": {"cpu_ms": 0.1}})
    p = RULES["dataloader_size"]().propose(ctx(recs, roles, topo=topology(4)))
    assert p.cpus == {2, 3} and p.evidence["removed"] == [0]


@pytest.mark.parametrize("data_frac, dl_cpu, main_runq", [
    (0.05, 0.95, 0.0),  # saturated workers but the step does not wait for data
    (0.5, 0.5, 0.0),  # waits for data, workers not saturated: more CPUs would not help
    (0.0, 0.1, 0.02),  # idle workers, main does not wait
])
def test_dataloader_quiet(data_frac, dl_cpu, main_runq):
    roles = {"main": [0], "nccl": [1], "dataloader": [0, 2], "other": [2, 3]}
    recs = window(20, data_frac=data_frac, jitter=0.2,
                  roles={"main": {"cpu_ms": 0.5, "runq_ms": main_runq}, "dataloader": {"cpu_ms": 2 * dl_cpu}})
    assert RULES["dataloader_size"]().propose(ctx(recs, roles, topo=topology(4))) is None


# ---- faster_core -------------------------------------------------------------------
def test_faster_core_by_perf_rank():
    topo = topology(4, perf_rank={0: 2, 1: 1, 2: 0, 3: 1})
    roles = {"main": [0], "nccl": [1], "other": [2, 3]}
    recs = window(20, roles={"main": {"cpu_ms": 0.9, "cpus": [0]}})
    p = RULES["faster_core"]().propose(ctx(recs, roles, topo=topo))
    assert p.role is MAIN and p.cpus == {2}
    assert p.evidence["perf_rank"] == 2 and p.evidence["free_perf_rank"] == 0


def test_faster_core_by_measured_mhz_when_ranks_tie():
    roles = {"main": [0], "nccl": [1], "other": [2, 3]}
    recs = window(20, roles={"main": {"cpu_ms": 0.9, "mhz": 2000.0}})
    facts = FakeFacts(mhz={2: 2100.0, 3: 3400.0})
    p = RULES["faster_core"]().propose(ctx(recs, roles, topo=topology(4), facts=facts))
    assert p.cpus == {3} and p.evidence["free_mhz"] == 3400.0


@pytest.mark.parametrize("cpu_frac, mhz", [(0.9, {2: 2100.0, 3: 2150.0}), (0.1, {3: 3400.0})])
def test_faster_core_quiet(cpu_frac, mhz):
    roles = {"main": [0], "nccl": [1], "other": [2, 3]}
    recs = window(20, jitter=0.2, roles={"main": {"cpu_ms": cpu_frac, "mhz": 2000.0}})
    assert RULES["faster_core"]().propose(ctx(recs, roles, topo=topology(4), facts=FakeFacts(mhz=mhz))) is None


# ---- numa_balancing ----------------------------------------------------------------
def _numa_windows(bursty_last=True, migrations=4, n=40):
    """Two calm windows, then one whose fault rate bursts with spikes (per-step figures)."""
    calm = [window(n, start=i * n, jitter=0.05, roles={"main": {"cpu_ms": 0.8, "minflt": 10, "migrations": 0}})
            for i in range(2)]
    last = window(n, start=2 * n, jitter=0.05, roles={"main": {"cpu_ms": 0.8, "minflt": 10, "migrations": 0}})
    if bursty_last:
        for i in (5, 17, 30):
            last[i].step_ms *= 3
            last[i].roles["main"].migrations = migrations
        for r in last:
            r.roles["main"].minflt = 400
    return calm + [last]


def _drive(rule, windows, facts, memory="bind"):
    out = [rule.propose(ctx(w, PLAN, facts=facts, memory=memory)) for w in windows]
    assert all(p is None for p in out[:-1])
    return out[-1]


def test_numa_balancing_warns_once_and_says_memory_binding_is_off():
    facts = FakeFacts(balancing=1, policy="default",
                      counters=[{"numa_hint_faults": 100}, {"numa_hint_faults": 900}])
    rule = RULES["numa_balancing"]()
    p = _drive(rule, _numa_windows(), facts)
    assert p is not None and not p.is_move
    assert p.evidence["spike_steps"] == 3 and p.evidence["kernel.numa_balancing"] == 1
    assert p.evidence["faults_per_step"] == 400 and p.evidence["usual_faults_per_step"] == 10
    assert "NOT in force" in p.reason and "kernel.numa_balancing=1" in p.reason
    assert rule.propose(ctx(_numa_windows()[-1], PLAN, facts=facts)) is None  # once per run


def test_numa_balancing_with_span_means_and_page_migrations_only():
    """The monitor's span sampling: faults only every 20th step, as per-step means; the thread
    is pinned (no thread migrations) but the kernel migrated pages."""
    wins = _numa_windows(migrations=0)
    for w in wins:
        for i, r in enumerate(w):
            if i % 20 != 19:
                r.roles["main"].minflt = None
    facts = FakeFacts(balancing=0, policy="bind", counters=[{"numa_pages_migrated": 100}, {"numa_pages_migrated": 900}])
    p = _drive(RULES["numa_balancing"](), wins, facts)
    assert p.evidence["numa_counter_deltas"] == {"numa_pages_migrated": 800}
    assert "is in force (policy bind)" in p.reason


@pytest.mark.parametrize("case", ["noise", "no_spikes", "no_migrations", "kernel_not_balancing"])
def test_numa_balancing_quiet(case):
    facts = FakeFacts(balancing=1, counters=[{"numa_pages_migrated": 5}])
    wins = _numa_windows()
    if case == "noise":
        wins = [window(40, start=i * 40, jitter=0.3, roles={"main": {"minflt": 10 + 5 * i, "migrations": 1}})
                for i in range(3)]
    elif case == "no_spikes":
        for r in wins[-1]:
            r.step_ms = 10.0
    elif case == "no_migrations":
        wins = _numa_windows(migrations=0)
    else:
        facts = FakeFacts(balancing=0, counters=[{"numa_hint_faults": 5}])
    assert _drive(RULES["numa_balancing"](), wins, facts) is None


def test_runqueue_moves_the_backward_thread_off_a_foreign_hog():
    # A GPU rank's plan: backward on its own core 1 next to main's 0; a foreign hog on 1.
    roles = {"main": [0], "backward": [1], "nccl": [2], "pin_memory": [2], "other": [3, 4, 5, 6, 7]}
    recs = window(20, roles={"main": {"cpu_ms": 0.1, "runq_ms": 0.0, "cpus": [0]},
                             "backward": {"cpu_ms": 0.5, "runq_ms": 0.4, "cpus": [1]}, "nccl": NCCL_IDLE})
    p = RULES["runqueue"]().propose(ctx(recs, roles, facts=FakeFacts(foreign=[hog(1)])))
    assert p is not None and p.role is ThreadRole.BACKWARD
    assert p.cpus and not p.cpus & {0, 1, 2}  # a free core of the share: not the hog's, no other hot role's
