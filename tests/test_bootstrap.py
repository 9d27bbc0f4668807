"""Stage 1 (placement.bootstrap) in real worker processes: mask, memory policy, env, event log,
Session; then the user's program run exactly as torchrun would (script, -m, --no-python)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from placement.config import PlacementConfig
from placement.cpuset import parse_cpulist
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
    import numa
    print(json.dumps({
        "name": __name__, "argv": sys.argv, "path0": sys.path[0], "file": __file__,
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "NCCL_SET_THREAD_NAME", "CUDA_DEVICE_ORDER")},
        "main_allowed": allowed(os.getpid()),
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
    def write(plan=None, **env):
        cfg = PlacementConfig()
        cfg.monitor.log_dir = str(tmp_path / "logs")
        (tmp_path / "plan.json").write_text(json.dumps((plan or make_plan()).to_dict()))
        (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("PLACEMENT_", "OMP_", "NCCL_", "CUDA_"))}
        base.update(PLACEMENT_PLAN_FILE=str(tmp_path / "plan.json"), PLACEMENT_CONFIG_FILE=str(tmp_path / "config.json"),
                    LOCAL_RANK="1", RANK="5", WORLD_SIZE="8")
        base.update(env)
        return base
    return write


def bootstrap(args, env, cwd, timeout=60):
    return subprocess.run([sys.executable, "-u", "-m", "placement.bootstrap", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def events(tmp_path, rank=5):
    return [json.loads(line) for line in open(tmp_path / "logs" / f"rank{rank}.jsonl")]


def test_script_runs_as_main_with_its_argv_after_stage1(tmp_path, handoff):
    script = tmp_path / "sub" / "train.py"
    script.parent.mkdir()
    script.write_text(REPORT)
    p = bootstrap([str(script), "--lr", "0.1", "placement.policy=node"], handoff(), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["name"] == "__main__" and out["file"] == str(script)
    assert out["argv"] == [str(script), "--lr", "0.1", "placement.policy=node"]
    assert out["path0"] == str(script.parent)  # as `python train.py` sets it
    assert out["env"] == {"OMP_NUM_THREADS": "3", "NCCL_SET_THREAD_NAME": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert parse_cpulist(out["main_allowed"]) == frozenset(MAIN)  # CPU-only rank: main narrowed at once
    assert out["membind"] == [0]
    assert out["session"] == {"rank": 5, "local_rank": 1, "world_size": 8, "memory": "bind", "main_cpus": MAIN}
    ev = events(tmp_path)
    assert [e["type"] for e in ev[:3]] == ["start", "bind", "memory"]
    start, stage1 = ev[0], ev[1]
    assert start["plan"]["local_rank"] == 1 and start["env"]["OMP_NUM_THREADS"] == "3"
    assert stage1["role"] is None and stage1["planned"] == sorted(set(MAIN) | set(REST)) == stage1["applied"]
    assert ev[-1]["type"] == "end"  # flushed and closed at exit


def test_module_mode_and_exit_code_pass_through(tmp_path, handoff):
    (tmp_path / "mytrain.py").write_text(REPORT)
    p = bootstrap(["-m", "mytrain", "x"], handoff(EXIT_WITH="3"), cwd=tmp_path)
    assert p.returncode == 3, p.stderr
    out = json.loads(p.stdout)
    assert out["name"] == "__main__" and out["argv"] == [str(tmp_path / "mytrain.py"), "x"]


def test_user_set_env_is_kept(tmp_path, handoff):
    (tmp_path / "t.py").write_text(REPORT)
    env = handoff(OMP_NUM_THREADS="7", PLACEMENT_KEEP_ENV="OMP_NUM_THREADS", CUDA_DEVICE_ORDER="FASTEST_FIRST")
    out = json.loads(bootstrap(["t.py"], env, cwd=tmp_path).stdout)
    assert out["env"]["OMP_NUM_THREADS"] == "7" and out["env"]["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


def test_no_python_execs_with_the_stage1_mask(tmp_path, handoff):
    p = bootstrap(["--no-python", "grep", "Cpus_allowed_list", "/proc/self/status"], handoff(), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert parse_cpulist(p.stdout.split(":", 1)[1]) == frozenset(MAIN) | frozenset(REST)  # the whole share
    assert [e["type"] for e in events(tmp_path)] == ["start", "bind", "memory", "end"]


def test_policy_none_binds_nothing(tmp_path, handoff):
    (tmp_path / "t.py").write_text(REPORT)
    p = bootstrap(["t.py"], handoff(make_plan(policy="none", memory="none")), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert parse_cpulist(out["main_allowed"]) == frozenset(ALLOWED)
    assert out["session"]["memory"] is None and out["env"]["OMP_NUM_THREADS"] is None
    assert [e["type"] for e in events(tmp_path)] == ["start", "end"]


def test_memory_fallback_is_logged_and_printed(tmp_path, handoff):
    (tmp_path / "t.py").write_text(REPORT)
    plan = make_plan()
    plan.ranks[1].memory = MemoryPolicy("bind", [4000])  # no such node: refused, stepped down
    p = bootstrap(["t.py"], handoff(plan), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "placement: rank 5: memory policy bind [4000]" in p.stderr and "EINVAL" in p.stderr
    memory = [e for e in events(tmp_path) if e["type"] == "memory"][0]
    assert memory["planned"] == {"mode": "bind", "nodes": [4000]} and memory["applied"]["mode"] == "none"


@pytest.mark.parametrize("env_change, message", [
    ({"PLACEMENT_PLAN_FILE": None}, "PLACEMENT_PLAN_FILE is not set"),
    ({"PLACEMENT_PLAN_FILE": "/nonexistent/plan.json"}, "cannot read the plan file '/nonexistent/plan.json'"),
    ({"LOCAL_RANK": "9"}, "plan has no local rank 9"),
])
def test_bad_handoff_is_one_line_exit_2(tmp_path, handoff, env_change, message):
    (tmp_path / "t.py").write_text("open('ran', 'w')")
    env = handoff()
    for k, v in env_change.items():
        env.pop(k) if v is None else env.__setitem__(k, v)
    p = bootstrap(["t.py"], env, cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and message in p.stderr and p.stderr.startswith("placement bootstrap: ")
    assert not (tmp_path / "ran").exists()


def test_missing_script_fails_as_python_does(tmp_path, handoff):
    p = bootstrap(["nope.py"], handoff(), cwd=tmp_path)
    assert p.returncode == 2 and "can't open file" in p.stderr and "nope.py" in p.stderr


def test_corrupt_plan_file_is_one_line(tmp_path, handoff):
    env = handoff()
    (tmp_path / "plan.json").write_text('{"schema": "placement.plan/9", "policy": "auto", "ranks": []}')
    p = bootstrap(["t.py"], env, cwd=tmp_path)
    assert p.returncode == 2 and "is not a placement plan" in p.stderr and p.stderr.count("\n") == 1


def test_config_file_with_an_unknown_key_is_one_line(tmp_path, handoff):
    env = handoff()
    (tmp_path / "config.json").write_text('{"polcy": "auto"}')
    p = bootstrap(["t.py"], env, cwd=tmp_path)
    assert p.returncode == 2 and "is not a placement config" in p.stderr and "polcy" in p.stderr
    assert p.stderr.count("\n") == 1
