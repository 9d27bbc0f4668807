"""Placement for Ray workers (placement/integrations/ray.py), with a real local Ray cluster.

The Ray runs start `tests/ray_jobs/ray_job.py` (ray.init with the setup hook on 2 CPUs, Ray Train's
TorchTrainer on gloo or 2 plain actors) and read back what each worker saw in /proc and wrote to its
log; they take tens of seconds each on 2 cores, so they are `slow`. The rest checks the parts
without Ray: how a node is cut into shares, the host's claims (real flock between processes), a GPU
worker's share on a DGX-like tree, which thread is the rank's main, the settings in the environment.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from placement.config import EnvSettings, load_config
from placement.cpuset import parse_cpulist
from placement.errors import ConfigError, PlacementError
from placement.integrations.ray import gpu_share, shares_of_node, worker_runtime_env
from placement.roles import ThreadRole
from placerun_helpers import REPO
from sysfs_builder import make_tree

JOB = REPO / "tests" / "ray_jobs" / "ray_job.py"
CPUS = frozenset(os.sched_getaffinity(0))
# A Ray start, a fit and a shutdown: ~40 s on 2 quiet cores; under two spinners Ray's own processes
# take minutes to start and a 13 ms step takes ~300 ms.
RAY_TIMEOUT_S = 900


# ---- without Ray -----------------------------------------------------------------------------
def test_a_node_is_cut_into_the_shares_ray_counts_its_workers_holding():
    assert shares_of_node(node_cpus=64, worker_cpus=8, usable=64) == 8
    assert shares_of_node(node_cpus=2, worker_cpus=1, usable=2) == 2
    assert shares_of_node(node_cpus=64, worker_cpus=3, usable=64) == 21  # a remainder is left unplanned
    assert shares_of_node(node_cpus=64, worker_cpus=100, usable=64) == 1  # never less than one
    assert shares_of_node(node_cpus=128, worker_cpus=1, usable=16) == 16  # never more than one per usable CPU
    assert shares_of_node(node_cpus=0, worker_cpus=1, usable=4) == 4  # the node's Ray CPUs unknown


_CLAIMER = """
import sys
from placement.integrations.ray import SharedCpus
print(SharedCpus(int(sys.argv[1]), root=sys.argv[2]).claim(), flush=True)
sys.stdin.read()  # holds the claim until the test closes stdin or kills it
"""


def _claimer(count, root):
    p = subprocess.Popen([sys.executable, "-c", _CLAIMER, str(count), str(root)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=REPO)
    return p, p.stdout.readline().strip()


def test_workers_claim_distinct_shares_and_a_dead_workers_share_is_free_again(tmp_path):
    a, first = _claimer(2, tmp_path)
    b, second = _claimer(2, tmp_path)
    c, third = _claimer(2, tmp_path)
    try:
        assert (first, second, third) == ("0", "1", "None")  # the third finds every share held
        a.kill()  # a worker dies without any exit handler (ray.kill): the kernel drops its lock
        a.wait(timeout=30)
        d, again = _claimer(2, tmp_path)
        assert again == "0", "a restarted worker gets the dead one's share"
        d.kill()
    finally:
        for p in (a, b, c):
            p.kill()
            p.wait(timeout=30)
    # a plan in another number of shares claims files of its own
    e, other = _claimer(3, tmp_path)
    e.kill()
    e.wait(timeout=30)
    assert other == "0"


def dgx_gpu_cpus(root, gpu):
    from placement.topology import discover

    topo = discover(root=str(root))
    g = next(g for g in topo.gpus if g.index == gpu)
    return [c.id for c in topo.cpus if c.numa == g.numa]


@pytest.fixture(scope="module")
def dgx(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("dgx"), "dgx_h100")


def test_a_gpu_worker_gets_the_share_of_the_gpu_ray_gave_it(dgx, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # what Ray set for the task: not the node's view
    cfg = load_config()
    shares = {}
    for gpu in range(8):
        plan, share = gpu_share(cfg, [str(gpu)], root=dgx)
        assert share.count == len(plan.ranks) == 8
        rank_plan = plan.for_local_rank(share.index)
        assert rank_plan.gpu.index == gpu
        shares[gpu] = rank_plan.share()
    for g, cpus in shares.items():  # distinct GPUs, disjoint shares, with no agreement between workers
        assert all(not (cpus & other) for h, other in shares.items() if h != g)
        assert cpus <= frozenset(dgx_gpu_cpus(dgx, g)), "the GPU's own NUMA node"
    with pytest.raises(PlacementError, match="GPU id '9' matches no GPU"):
        gpu_share(cfg, ["9"], root=dgx)  # a raylet that sees GPUs the node does not: the worker runs unbound


_MAIN_THREAD = """
import os, threading, json
from placement.roles import ThreadRole, scan_threads, set_main_thread
seen = {}
def loop():
    set_main_thread(threading.get_ident(), threading.get_native_id())
    seen.update({t.tid: t.role.value for t in scan_threads(include_children=False)})
    seen["me"] = threading.get_native_id()
t = threading.Thread(target=loop, name="TrainingThread")
t.start(); t.join()
print(json.dumps({"roles": {str(k): v for k, v in seen.items() if k != "me"}, "me": seen["me"], "pid": os.getpid()}))
"""


def test_the_thread_that_runs_the_loop_is_the_ranks_main_thread_in_proc():
    out = json.loads(subprocess.run([sys.executable, "-c", _MAIN_THREAD], capture_output=True, text=True,
                                    check=True, cwd=REPO, timeout=60).stdout)
    roles = {int(k): v for k, v in out["roles"].items()}
    assert roles[out["me"]] == ThreadRole.MAIN.value
    assert roles[out["pid"]] == ThreadRole.OTHER.value  # the process's own main thread is not the loop's
    assert list(roles.values()).count(ThreadRole.MAIN.value) == 1


def test_settings_from_the_environment():
    env = EnvSettings.read({"PLACEMENT_OVERRIDES": "placement.policy=node  monitor.flush_every=5"})
    cfg = env.config()
    assert (cfg.policy, cfg.monitor.flush_every) == ("node", 5)
    assert not EnvSettings.read({}) and EnvSettings.read({}).config() == load_config()
    # a command line's words come after the environment's
    assert env.load(["placement.policy=none"]).policy == "none"
    with pytest.raises(ConfigError) as e:
        EnvSettings.read({"PLACEMENT_OVERRIDES": "placement.policy=fast"}).config()
    assert "PLACEMENT_OVERRIDES='placement.policy=fast'" in str(e.value) and "auto" in str(e.value)
    with pytest.raises(ConfigError, match="does not split"):
        EnvSettings.read({"PLACEMENT_OVERRIDES": "placement.monitor.log_dir='unclosed"})


@pytest.mark.slow
def test_a_bad_setting_in_a_ray_worker_is_one_line_and_the_worker_runs_unbound():
    code = ("import os, torch; from placement.integrations.ray import setup; setup(); "
            "print(sorted(os.sched_getaffinity(0)) == sorted(%r))" % (sorted(CPUS),))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "PLACEMENT_OVERRIDES": "placement.memory=fast"})
    assert p.returncode == 0 and p.stdout.strip() == "True", p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "PLACEMENT_OVERRIDES='placement.memory=fast'" in lines[0] and "runs unbound" in lines[0], lines[0]


def test_worker_runtime_env_sets_the_variable_ray_reads_and_keeps_the_rest():
    ray_constants = pytest.importorskip("ray._private.ray_constants", reason="the `ray` extra is not installed")
    env = worker_runtime_env(env_vars={"PLACEMENT_OVERRIDES": "placement.policy=node"}, pip=["x"])
    assert env["env_vars"] == {"PLACEMENT_OVERRIDES": "placement.policy=node",
                               ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR: "placement.integrations.ray.setup"}
    assert env["pip"] == ["x"]


# ---- with a real local Ray cluster -----------------------------------------------------------
def _ray_job(tmp_path, *args):
    pytest.importorskip("ray", reason="the `ray` extra is not installed: pip install 'placement[ray]'")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(JOB), *args, "--out", str(out)], capture_output=True, text=True,
                       cwd=REPO, timeout=RAY_TIMEOUT_S, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-6000:])
    workers = {}
    for r in range(3):
        if r < 2 or (out / f"worker{r}.json").exists():
            with open(out / f"worker{r}.json") as f:
                workers[r] = json.load(f)
    return p, json.loads(p.stdout.strip().splitlines()[-1]), workers, out


def _log(out, rank):
    with open(out / "logs" / f"rank{rank}.jsonl") as f:
        return [json.loads(line) for line in f]


def _check_bound(workers):
    """Each worker's loop thread on its planned main CPUs and its process inside its share, read
    back from /proc by the worker itself; the two shares disjoint."""
    shares = []
    for w in workers.values():
        plan = w["planned"]
        assert plan is not None, w
        assert parse_cpulist(w["allowed"]["thread"]) == frozenset(plan["main"]), w
        assert parse_cpulist(w["allowed"]["process_main"]) <= frozenset(plan["share"]), w
        shares.append(frozenset(plan["share"]))
    assert not (shares[0] & shares[1]) and shares[0] | shares[1] <= CPUS, shares


def _steps(log):
    return [e for e in log if e["type"] == "step"]


def _covered(log) -> int:
    """The steps the log's step records hold (a record may hold several: records/step.py)."""
    return sum(e.get("steps", 1) for e in _steps(log))


@pytest.mark.slow
def test_ray_train_workers_are_bound_monitored_and_a_slow_one_is_named(tmp_path):
    iters = 240
    logs = tmp_path / "out" / "logs"
    p, result, workers, out = _ray_job(
        tmp_path, "trainer", "--hook", "job", "--iters", str(iters), "--work-ms", "10", "--slow-rank", "1",
        "--slow-pct", "30",
        "--overrides", f"placement.monitor.log_dir={logs} placement.monitor.straggler_steady_pct=75")
    assert all(not w["is_process_main"] for w in workers.values())  # Ray Train's loop runs on a thread of its own
    assert [w["planned"]["rank"] for w in workers.values()] == [0, 1]
    _check_bound(workers)
    for r in (0, 1):
        log = _log(out, r)
        assert {e["rank"] for e in log} == {r}, "a worker's log is named by the rank its program has"
        started = [e for e in log if e["type"] == "start" and e.get("source") == "monitor"]
        assert started and started[0]["ddp_hook"] and started[0]["exchange"], started
        # every step written, the monitor closed as the training thread ended (Ray then kills the worker)
        assert iters - 1 <= _covered(log) <= iters, _covered(log)
        assert [e for e in log if e["type"] == "end" and e.get("source") == "monitor"], "closed at the thread's end"
    # 30% of its own step time, measured by the worker over its first steps (a busy host's steps
    # are ~20 times a quiet one's): a fixed delay would be 30% on one host and 2% on the other
    assert workers[1]["delay_ms"] > 0 and workers[0]["delay_ms"] == 0
    named = [s for e in _log(out, 0) if e["type"] == "straggler" for s in e["stragglers"]]
    assert named and {r for s in named for r in s["ranks"]} == {1}, named[:3]


@pytest.mark.slow
def test_ray_actors_given_the_hook_in_their_own_runtime_env_are_placed_and_the_others_untouched(tmp_path):
    # worker_runtime_env() for two actors (as for Ray Train's RunConfig(worker_runtime_env=...)), a
    # third given nothing; no hook for the job
    logs = tmp_path / "out" / "logs"
    p, result, workers, out = _ray_job(tmp_path, "actors", "--hook", "workers", "--bare-actor", "--iters", "60",
                                       "--attach-rank", "1", "--overrides", f"placement.monitor.log_dir={logs}")
    bare = workers.pop(2)
    assert bare["planned"] is None and parse_cpulist(bare["allowed"]["thread"]) == CPUS, bare
    assert all(w["is_process_main"] for w in workers.values())
    _check_bound(workers)
    # no process group and no RANK: each actor is the rank of its share on the node
    assert sorted(w["planned"]["rank"] for w in workers.values()) == [0, 1]
    assert sorted(os.listdir(logs)) == ["rank0.events", "rank0.jsonl", "rank1.events", "rank1.jsonl"]
    for w in workers.values():
        log = _log(out, w["planned"]["rank"])
        # every step written when Ray ends the actors gracefully (__ray_terminate__)
        assert _covered(log) >= 59 and [e for e in log if e["type"] == "end" and e.get("source") == "monitor"]
        started = [e["steps"] for e in log if e["type"] == "start" and e.get("source") == "monitor"]
        # the actor that calls placement.attach() itself has that one monitor, the other the automatic one
        assert started == (["attach"] if w["rank"] == 1 else ["auto"]), started
