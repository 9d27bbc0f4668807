"""attach() without placerun plans this rank (plan_for_node) and binds it: the main thread's
affinity read back from /proc is the plan's `main` set, the monitor sees it run there, and the
binder's events are in the same log; torch's thread count is the plan's while attached, and
close() puts back the affinity (every thread), memory policy and thread count it found. What it
did is said on stderr: the plan's warnings in one line. Run in a child process: binding changes
its affinity.

The file is also the child: `python tests/test_attach_bind.py LOG_DIR [bind|reserve-all]`.
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


def _process_allowed() -> list[int]:
    """Cpus_allowed_list of /proc/self/status (the main thread's, as the process shows it)."""
    from placement.cpuset import parse_cpulist

    with open("/proc/self/status") as f:
        line = next(l for l in f if l.startswith("Cpus_allowed_list:"))
    return sorted(parse_cpulist(line.split(":", 1)[1]))


def _memory_policy(tid: int) -> str:
    """The thread's memory policy as /proc/self/task/<tid>/numa_maps shows it (first mapping)."""
    with open(f"/proc/self/task/{tid}/numa_maps") as f:
        return f.readline().split()[1]


def _child(tmp_path, mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", RANK="0", WORLD_SIZE="1")
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run([sys.executable, __file__, str(tmp_path), mode], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_attach_binds_main_to_the_planned_core_and_monitors_it(tmp_path):
    p = _child(tmp_path, "bind")
    assert p.returncode == 0, p.stderr[-3000:]
    facts = json.loads(p.stdout.strip().splitlines()[-1])
    assert facts["main_allowed"] == facts["plan_main"]
    assert set(facts["record_cpus"]) <= set(facts["plan_main"])
    assert facts["session_while_attached"] and not facts["session_after_close"]
    # torch was imported first: the plan's OMP_NUM_THREADS reaches it through torch.set_num_threads
    assert facts["torch_threads_attached"] == int(facts["plan_omp"]) != facts["torch_threads_before"]
    # close() puts back what attach() found: /proc/self/status, a thread started before attach(),
    # the main thread's memory policy, torch's thread count
    assert facts["process_after"] == facts["process_before"]
    assert facts["helper_after"] == facts["helper_before"] == facts["process_before"]
    assert facts["helper_attached"] != facts["helper_before"] or len(facts["process_before"]) == 1
    assert facts["memory_after"] == facts["memory_before"]
    assert facts["torch_threads_after"] == facts["torch_threads_before"]
    lines = [json.loads(l) for l in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    binds = [l for l in lines if l["type"] == "bind"]
    assert any(b.get("role") == "main" and b["applied"] == facts["plan_main"] and b["ok"] for b in binds)
    assert sum(l.get("steps", 1) for l in lines if l["type"] == "step") == 30  # (a record may hold several)
    assert any(l["type"] == "memory" for l in lines)


@pytest.mark.slow
def test_a_plan_warning_reaches_stderr_in_one_line(tmp_path):
    """attach(reserved_cpus=<every CPU>) run with plain python: nothing is usable, so nothing is
    bound, and the rank says so on stderr in one line (every warning is in the event log)."""
    p = _child(tmp_path, "reserve-all")
    assert p.returncode == 0, p.stderr[-3000:]
    said = [line for line in p.stderr.splitlines() if line.startswith("placement: rank 0: plan warning: ")]
    assert len(said) == 1 and "leaves no usable CPU" in said[0] and "degraded plan: no binding" in said[0], p.stderr
    facts = json.loads(p.stdout.strip().splitlines()[-1])
    assert facts["process_attached"] == facts["process_before"], "nothing was bound"
    lines = [json.loads(l) for l in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert any(l["type"] == "warning" and "leaves no usable CPU" in l["message"] for l in lines)


def reserve_all(log_dir: str) -> None:
    import placement
    from placement.cpuset import format_cpulist

    before = _process_allowed()
    h = placement.attach(reserved_cpus=format_cpulist(os.sched_getaffinity(0)), tune={"enabled": False},
                         monitor={"log_dir": log_dir, "summary_every": 0})
    facts = {"process_before": before, "process_attached": _process_allowed()}
    h.close()
    print(json.dumps(facts))


def child(log_dir: str) -> None:
    import threading

    import torch

    import placement
    from placement.bind import session

    torch.set_num_threads(97)  # no plan sizes a rank's `other` set to 97 threads here
    release = threading.Event()
    helper_tid = []
    helper = threading.Thread(target=lambda: (helper_tid.append(threading.get_native_id()), release.wait()))
    helper.start()
    while not helper_tid:
        time.sleep(0.001)
    before = {"process_before": _process_allowed(), "helper_before": _allowed(helper_tid[0]),
              "memory_before": _memory_policy(os.getpid()), "torch_threads_before": torch.get_num_threads()}
    h = placement.attach(policy="auto", strict=False, tune={"enabled": False},
                         monitor={"log_dir": log_dir, "summary_every": 0})
    before["torch_threads_attached"] = torch.get_num_threads()
    before["plan_omp"] = h.rank_plan.env["OMP_NUM_THREADS"]
    before["helper_attached"] = _allowed(helper_tid[0])
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
    facts.update(before, process_after=_process_allowed(), helper_after=_allowed(helper_tid[0]),
                 memory_after=_memory_policy(os.getpid()), torch_threads_after=torch.get_num_threads())
    release.set()
    helper.join()
    print(json.dumps(facts))


if __name__ == "__main__":
    {"bind": child, "reserve-all": reserve_all}[sys.argv[2]](sys.argv[1])
