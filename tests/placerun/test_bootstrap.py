"""Stage 1 in real worker processes, started the way placerun starts them: Python programs by
torchrun's own command with placerun's startup hook on PYTHONPATH, --no-python through
`python -m placement.bootstrap --no-python`. Mask, memory policy, env, event log, Session; the
program runs as under torchrun; a stage 1 that cannot run says so in one line and the program
runs unbound."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from placement.config import PlacementConfig
from placement.cpuset import parse_cpulist
from placement.handoff import Handoff, VirtualLocalRank
from placement.plan.model import MemoryPolicy, Plan, RankPlan, RoleAssignment
from placement.roles import ThreadRole

ALLOWED = sorted(os.sched_getaffinity(0))
MAIN, REST = ALLOWED[:1], ALLOWED[1:] or ALLOWED[:1]

REPORT = textwrap.dedent("""
    import json, os, sys, threading
    from placement.bind import session
    from placement.roles import ThreadRole
    def allowed(tid):
        for line in open(f"/proc/self/task/{tid}/status"):
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    s = session.current()
    before_torch = allowed(os.getpid())
    import torch  # main keeps the rank's share until torch's OpenMP runtime has counted it (bind/openmp.py)
    import numa
    print(json.dumps({
        "name": __name__, "argv": sys.argv, "path0": sys.path[0], "file": __file__,
        "pythonpath": os.environ.get("PYTHONPATH"), "hook_on_path": any("_worker_hook" in p for p in sys.path),
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "NCCL_SET_THREAD_NAME", "CUDA_DEVICE_ORDER")},
        "main_allowed": allowed(os.getpid()), "main_before_torch": before_torch,
        "membind": sorted(numa.memory.get_membind_nodes()),
        "session": None if s is None else {"rank": s.rank, "local_rank": s.local_rank, "world_size": s.world_size,
                                            "memory": s.memory and s.memory.applied.mode,
                                            "main_cpus": sorted(s.rank_plan.cpus(ThreadRole.MAIN))},
    }))
    sys.exit(int(os.environ.get("EXIT_WITH", "0")))
""")


def make_plan(policy="auto", memory="bind"):
    def rank(lr):
        roles = {} if policy == "none" else {
            ThreadRole.MAIN: RoleAssignment(MAIN, "fastest core"),
            ThreadRole.NCCL: RoleAssignment(REST, "next core"),
            ThreadRole.PIN_MEMORY: RoleAssignment(REST, "near main"),
            ThreadRole.DATALOADER: RoleAssignment(REST, "the rest"),
            ThreadRole.OTHER: RoleAssignment(REST, "the rest")}
        return RankPlan(local_rank=lr, gpu=None, numa=[0], memory=MemoryPolicy(memory, [0] if memory != "none" else []),
                        env={} if policy == "none" else {"OMP_NUM_THREADS": "3"}, roles=roles)
    return Plan(policy=policy, ranks=[rank(0), rank(1)])


@pytest.fixture
def handoff(tmp_path):
    def write(plan=None, keep_env=(), virtual=None, **env):
        cfg = PlacementConfig()
        cfg.monitor.log_dir = str(tmp_path / "logs")
        path = Handoff(cfg, plan or make_plan(), tuple(keep_env), virtual).write(str(tmp_path))
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("PLACEMENT_", "OMP_", "NCCL_", "CUDA_"))}
        base.update(PLACEMENT_PLAN_FILE=path, LOCAL_RANK="1", RANK="5", WORLD_SIZE="8")
        base.update(env)
        return base
    return write


def bootstrap(args, env, cwd, timeout=60):
    """The worker command placerun gives torch for `args` (torchrun's program arguments)."""
    from placement.launcher import parse_placerun_args, worker_launch
    from torch.distributed.run import config_from_args

    launch = worker_launch(parse_placerun_args(["--nproc-per-node", "1", *args]).torch_args, environ=env)
    _, cmd, cmd_args = config_from_args(launch.torch_args)
    return subprocess.run([cmd, *cmd_args], env={**env, **launch.environ}, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def events(tmp_path, rank=5):
    return [json.loads(line) for line in open(tmp_path / "logs" / f"rank{rank}.jsonl")]


@pytest.mark.slow
def test_script_runs_as_main_with_its_argv_after_stage1(tmp_path, handoff):
    script = tmp_path / "sub" / "train.py"
    script.parent.mkdir()
    script.write_text(REPORT)
    env = handoff()
    p = bootstrap([str(script), "--lr", "0.1", "placement.policy=node"], env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["pythonpath"] == env.get("PYTHONPATH")  # the hook restored the user's
    assert out["name"] == "__main__" and out["file"] == str(script)
    assert out["argv"] == [str(script), "--lr", "0.1", "placement.policy=node"]
    assert out["path0"] == str(script.parent) and not out["hook_on_path"]  # as `python train.py` sets it
    assert out["env"] == {"OMP_NUM_THREADS": "3", "NCCL_SET_THREAD_NAME": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    # CPU-only rank: main narrowed as soon as the program has imported torch, the share until then
    assert parse_cpulist(out["main_allowed"]) == frozenset(MAIN)
    assert parse_cpulist(out["main_before_torch"]) == frozenset(MAIN) | frozenset(REST)
    assert out["membind"] == [0]
    assert out["session"] == {"rank": 5, "local_rank": 1, "world_size": 8, "memory": "bind", "main_cpus": MAIN}
    ev = events(tmp_path)
    assert [e["type"] for e in ev[:3]] == ["start", "bind", "memory"]
    start, stage1 = ev[0], ev[1]
    assert start["plan"]["local_rank"] == 1 and start["env"]["OMP_NUM_THREADS"] == "3"
    assert stage1["role"] is None and stage1["planned"] == sorted(set(MAIN) | set(REST)) == stage1["applied"]
    assert ev[-1]["type"] == "end"  # flushed and closed at exit


@pytest.mark.slow
def test_module_mode_and_exit_code_pass_through(tmp_path, handoff):
    (tmp_path / "mytrain.py").write_text(REPORT)
    p = bootstrap(["-m", "mytrain", "x"], handoff(EXIT_WITH="3"), cwd=tmp_path)
    assert p.returncode == 3, p.stderr
    out = json.loads(p.stdout)
    assert out["name"] == "__main__" and out["argv"] == [str(tmp_path / "mytrain.py"), "x"]


@pytest.mark.slow
def test_user_set_env_is_kept(tmp_path, handoff):
    (tmp_path / "t.py").write_text(REPORT)
    env = handoff(OMP_NUM_THREADS="7", keep_env=["OMP_NUM_THREADS"], CUDA_DEVICE_ORDER="FASTEST_FIRST")
    out = json.loads(bootstrap(["t.py"], env, cwd=tmp_path).stdout)
    assert out["env"]["OMP_NUM_THREADS"] == "7" and out["env"]["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


def test_no_python_execs_with_the_stage1_mask(tmp_path, handoff):
    p = bootstrap(["--no-python", "grep", "Cpus_allowed_list", "/proc/self/status"], handoff(), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert parse_cpulist(p.stdout.split(":", 1)[1]) == frozenset(MAIN) | frozenset(REST)  # the whole share
    assert [e["type"] for e in events(tmp_path)] == ["start", "bind", "memory", "end"]


@pytest.mark.slow
def test_policy_none_binds_nothing(tmp_path, handoff):
    (tmp_path / "t.py").write_text(REPORT)
    p = bootstrap(["t.py"], handoff(make_plan(policy="none", memory="none")), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert parse_cpulist(out["main_allowed"]) == frozenset(ALLOWED)
    assert out["session"]["memory"] is None and out["env"]["OMP_NUM_THREADS"] is None
    # Nothing bound; the one warning is the automatic monitor's: the script steps no optimizer.
    assert [(e["type"], e.get("source")) for e in events(tmp_path)] == [("start", None), ("warning", "monitor"),
                                                                         ("end", None)]


@pytest.mark.slow
def test_memory_fallback_is_logged_and_printed(tmp_path, handoff):
    (tmp_path / "t.py").write_text(REPORT)
    plan = make_plan()
    plan.ranks[1].memory = MemoryPolicy("bind", [4000])  # no such node: refused, stepped down
    p = bootstrap(["t.py"], handoff(plan), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "placement: rank 5: memory policy bind [4000]" in p.stderr and "EINVAL" in p.stderr
    memory = [e for e in events(tmp_path) if e["type"] == "memory"][0]
    assert memory["planned"] == {"mode": "bind", "nodes": [4000]} and memory["applied"]["mode"] == "none"


@pytest.mark.parametrize("virtual, env_change, message", [
    (None, {"PLACEMENT_PLAN_FILE": "/nonexistent/plan.json"}, "cannot read the plan file '/nonexistent/plan.json'"),
    (None, {"LOCAL_RANK": "9"}, "plan has no local rank 9"),
    (VirtualLocalRank(("4", "6")), {"CUDA_VISIBLE_DEVICES": "5"}, "'5' is not an entry"),
])
def test_a_stage1_that_cannot_run_is_one_line_and_the_program_runs_unbound(tmp_path, handoff, virtual, env_change,
                                                                            message):
    (tmp_path / "t.py").write_text("open('ran', 'w')")
    env = handoff(virtual=virtual)
    env.update(env_change)
    p = bootstrap(["t.py"], env, cwd=tmp_path)
    assert p.returncode == 0 and (tmp_path / "ran").exists()
    assert p.stderr.count("\n") == 1 and message in p.stderr and p.stderr.startswith("placement: rank 5: ")
    assert p.stderr.rstrip().endswith("this rank runs unbound")


def test_an_interpreter_that_cannot_import_placement_runs_the_program_unbound(tmp_path, handoff):
    shadow = tmp_path / "shadow" / "placement"  # stands for an interpreter (PYTHON_EXEC) without placement
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no placement in this interpreter')")
    (tmp_path / "t.py").write_text("import sys; print(sys.argv)")
    p = bootstrap(["t.py", "x"], handoff(PYTHONPATH=str(shadow.parent)), cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == "['t.py', 'x']"
    assert p.stderr.count("\n") == 1 and p.stderr.startswith(f"placement: rank 5: cannot import placement in {sys.executable}")
    assert "this rank runs unbound" in p.stderr


@pytest.mark.slow
def test_without_a_plan_the_hook_does_nothing(tmp_path, handoff):
    (tmp_path / "t.py").write_text(REPORT)
    env = handoff()
    del env["PLACEMENT_PLAN_FILE"]
    p = bootstrap(["t.py"], env, cwd=tmp_path)
    assert p.returncode == 0 and p.stderr == "" and json.loads(p.stdout)["session"] is None


@pytest.mark.slow
@pytest.mark.parametrize("parent, visible, local_rank", [(None, "1", 1), (["GPU-a", "GPU-b"], "GPU-b", 1),
                                                         (["4", "6"], "4", 0)])
def test_virtual_local_rank_is_found_from_the_device_torch_gave_the_worker(tmp_path, handoff, parent, visible,
                                                                           local_rank):
    """torch sets LOCAL_RANK=0 for every worker under --virtual-local-rank; the plan is the rank's own."""
    (tmp_path / "t.py").write_text(REPORT)
    env = handoff(LOCAL_RANK="0", CUDA_VISIBLE_DEVICES=visible,
                  virtual=VirtualLocalRank(None if parent is None else tuple(parent)))
    p = bootstrap(["t.py"], env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["session"]["local_rank"] == local_rank


def test_a_sitecustomize_of_the_users_still_runs(tmp_path, handoff):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = '1'\n")
    (tmp_path / "t.py").write_text("import os, sys\nprint(os.environ.get('USER_SITE_RAN'), sys.modules['sitecustomize'].__file__)")
    p = bootstrap(["t.py"], handoff(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1", str(site / "sitecustomize.py")]


def test_missing_script_fails_as_python_does(tmp_path, handoff):
    p = bootstrap(["nope.py"], handoff(), cwd=tmp_path)
    assert p.returncode == 2 and "can't open file" in p.stderr and "nope.py" in p.stderr


def rewrite_handoff(env, part, value):
    """The hand-off file with one part (plan, config) replaced."""
    with open(env["PLACEMENT_PLAN_FILE"]) as f:
        d = json.load(f)
    d[part] = value
    with open(env["PLACEMENT_PLAN_FILE"], "w") as f:
        json.dump(d, f)


def test_corrupt_plan_file_is_one_line(tmp_path, handoff):
    env = handoff()
    (tmp_path / "t.py").write_text("")
    rewrite_handoff(env, "plan", {"schema": "placement.plan/9", "policy": "auto", "ranks": []})
    p = bootstrap(["t.py"], env, cwd=tmp_path)
    assert p.returncode == 0 and "is not a placement plan" in p.stderr and p.stderr.count("\n") == 1


def test_config_file_with_an_unknown_key_is_one_line(tmp_path, handoff):
    env = handoff()
    (tmp_path / "t.py").write_text("")
    rewrite_handoff(env, "config", {"polcy": "auto"})
    p = bootstrap(["t.py"], env, cwd=tmp_path)
    assert p.returncode == 0 and "is not a placement config" in p.stderr and "polcy" in p.stderr
    assert p.stderr.count("\n") == 1
