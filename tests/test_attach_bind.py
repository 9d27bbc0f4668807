"""attach() without placerun plans this rank (plan_for_node) and binds it: the main thread's
affinity read back from /proc is the plan's `main` set, the monitor sees it run there, and the
binder's events are in the same log. Run in a child process: binding changes its affinity.

The file is also the child: `python tests/test_attach_bind.py LOG_DIR`.
"""
import json
import os
import subprocess
import sys
import time

import pytest


def _allowed(tid: int) -> list[int]:
    from placement.cpuset import parse_cpulist

    with open(f"/proc/self/task/{tid}/status") as f:
        line = next(l for l in f if l.startswith("Cpus_allowed_list:"))
    return sorted(parse_cpulist(line.split(":", 1)[1]))


@pytest.mark.slow
def test_attach_binds_main_to_the_planned_core_and_monitors_it(tmp_path):
    env = dict(os.environ, LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", RANK="0", WORLD_SIZE="1")
    p = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    facts = json.loads(p.stdout.strip().splitlines()[-1])
    assert facts["main_allowed"] == facts["plan_main"]
    assert set(facts["record_cpus"]) <= set(facts["plan_main"])
    assert facts["session_while_attached"] and not facts["session_after_close"]
    lines = [json.loads(l) for l in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    binds = [l for l in lines if l["type"] == "bind"]
    assert any(b.get("role") == "main" and b["applied"] == facts["plan_main"] and b["ok"] for b in binds)
    assert sum(1 for l in lines if l["type"] == "step") == 30
    assert any(l["type"] == "memory" for l in lines)


def child(log_dir: str) -> None:
    import placement
    from placement.bind import session

    h = placement.attach(policy="auto", strict=False, tune={"enabled": False},
                         monitor={"log_dir": log_dir, "summary_every": 0})
    cpus = set()
    h.add_observer(lambda r: cpus.update(r.roles["main"].cpus))
    for _ in range(30):
        end = time.thread_time() + 0.002
        while time.thread_time() < end:
            pass
        h.step()
    facts = {"plan_main": sorted(h.rank_plan.roles[next(r for r in h.rank_plan.roles if r.value == "main")].cpus),
             "main_allowed": _allowed(os.getpid()), "session_while_attached": session.current() is not None}
    h.close()
    facts["record_cpus"] = sorted(cpus)
    facts["session_after_close"] = session.current() is not None
    print(json.dumps(facts))


if __name__ == "__main__":
    child(sys.argv[1])
