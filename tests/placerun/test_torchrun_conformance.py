"""Side by side: the same small worker (placerun_jobs/conform.py) under real `torchrun` and under
`placerun`, for every way torchrun starts a job. Compared: the launcher's exit code, each
worker's whole environment, sys.argv, __name__, __file__, sys.path (so sys.path[0]), the
interpreter, the sitecustomize it loaded, the program named in torch's failure summary, and the
frames of a worker's traceback. The only differences allowed are the product's, listed in ALLOWED.

All cases are started at once in batches (a module fixture, a few launchers at a time), so the
file costs about what its slowest batch does; each test then asserts on its case's results.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from placerun_helpers import JOBS, free_port, launcher

pytestmark = pytest.mark.slow

# The product: CPU affinity and memory policy (not in the env), placement's hand-off variables,
# the env stage 1 sets (placement.bind.env), and the plan banner on stderr. Nothing else may differ.
ALLOWED_ENV_PREFIXES = ("PLACEMENT_", "NCCL_")
ALLOWED_ENV = {"OMP_NUM_THREADS",  # sized to the rank's share by the plan (torchrun: 1 with a warning)
               "CUDA_DEVICE_ORDER"}  # PCI_BUS_ID when unset, so GPU indices match the plan's
# Also allowed: placement's own modules in the worker's sys.modules (placement.*, py-libnuma's `numa`
# for the memory policy; not torch, numpy or psutil, which the worker reports). And where the interpreter has no sitecustomize of its own, placerun's startup hook stays
# in sys.modules under that name (a module cannot take itself out while it is being imported).
# Different on every run of either launcher (so not compared by value, only by presence).
PER_RUN_ENV = {"TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MASTER_PORT", "CONFORM_OUT"}
CONCURRENT_LAUNCHERS = 4
TIMEOUT_S = 240


@dataclass
class Case:
    name: str
    flags: list  # torchrun flags, {port} filled per launcher
    program: list = field(default_factory=lambda: ["conform.py", "--lr", "0.1"])
    env: dict = field(default_factory=dict)
    nproc: int = 2  # workers expected
    exit_code: int = 0
    sigterm: bool = False  # SIGTERM the launcher once every worker has reported


CASES = [
    Case("standalone", ["--standalone", "--nproc-per-node", "2"]),
    Case("c10d_elastic", ["--nnodes=1:2", "--nproc-per-node", "2", "--rdzv-backend=c10d",
                          "--rdzv-endpoint=localhost:{port}", "--rdzv-id=conform",
                          "--rdzv-conf=join_timeout=30,last_call_timeout=1"]),
    Case("max_restarts", ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2"],
         env={"CONFORM_ACTION": "fail_once", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
    Case("run_path", ["--standalone", "--nproc-per-node", "2", "--run-path"]),
    Case("module", ["--standalone", "--nproc-per-node", "2", "-m"], program=["conform", "--lr", "0.1"]),
    Case("no_python", ["--standalone", "--nproc-per-node", "2", "--no-python"],
         program=["./conform_exec", "--lr", "0.1"]),
    Case("logs_redirects_tee", ["--standalone", "--nproc-per-node", "2", "--log-dir", "{logdir}",
                                "--redirects", "3", "--tee", "3"]),
    Case("local_ranks_filter", ["--standalone", "--nproc-per-node", "2", "--tee", "3",
                                "--local-ranks-filter", "1"]),
    Case("role", ["--standalone", "--nproc-per-node", "2", "--role", "trainer"]),
    Case("pet_env", [], env={"PET_STANDALONE": "1", "PET_NPROC_PER_NODE": "2", "PET_ROLE": "petrole"}),
    Case("nproc_auto", ["--standalone", "--nproc-per-node", "auto"], nproc=os.cpu_count()),
    Case("nproc_cpu", ["--standalone", "--nproc-per-node", "cpu"], nproc=os.cpu_count()),
    Case("nproc_over_cores", ["--standalone", "--nproc-per-node", str(os.cpu_count() + 2)],
         nproc=os.cpu_count() + 2),
    Case("virtual_local_rank", ["--standalone", "--nproc-per-node", "2", "--virtual-local-rank"]),
    Case("python_exec", ["--standalone", "--nproc-per-node", "2"], env={"PYTHON_EXEC": "/usr/bin/python3"}),
    Case("worker_exits_3", ["--standalone", "--nproc-per-node", "2"], env={"CONFORM_ACTION": "exit3"},
         exit_code=1),
    Case("worker_raises", ["--standalone", "--nproc-per-node", "2"], env={"CONFORM_ACTION": "raise"},
         exit_code=1),
    Case("worker_killed", ["--standalone", "--nproc-per-node", "2"], env={"CONFORM_ACTION": "kill"},
         exit_code=1),
    Case("sigterm_launcher", ["--standalone", "--nproc-per-node", "2"], env={"CONFORM_ACTION": "sleep"},
         exit_code=None, sigterm=True),
]


@dataclass
class Run:
    code: Optional[int]
    stdout: str
    stderr: str
    reports: dict  # "rank{R}.r{restart}" -> what the worker saw
    logs: dict  # log-dir files below the run's own directory -> contents
    leftover_workers: list


def _launch(case: Case, name: str, tmp: Path) -> Run:
    work = tmp / case.name / name
    out = work / "out"
    out.mkdir(parents=True)
    (work / "conform.py").write_text((JOBS / "conform.py").read_text())
    exec_prog = work / "conform_exec"
    exec_prog.write_text(f"#!{sys.executable}\n" + (JOBS / "conform.py").read_text())
    exec_prog.chmod(0o755)
    flags = [f.format(port=free_port("localhost"), logdir=work / "logs") for f in case.flags]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLACEMENT_", "PET_", "OMP_NUM_THREADS"))}
    env.update(case.env, CONFORM_OUT=str(out))
    proc = subprocess.Popen([*launcher(name), *flags, *case.program], cwd=work, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        if case.sigterm:
            deadline = time.monotonic() + TIMEOUT_S
            while len(list(out.iterdir())) < case.nproc and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reports = {p.stem: json.loads(p.read_text()) for p in out.iterdir()}
    leftover = [r["env"]["RANK"] for r in reports.values() if _alive(r)]
    logs = {}
    if (work / "logs").exists():
        for p in (work / "logs").rglob("*"):
            if p.is_file():
                logs[str(Path(*p.relative_to(work / "logs").parts[1:]))] = p.read_text()
    return Run(proc.returncode, stdout, stderr, reports, logs, leftover)


def _alive(report) -> bool:
    pid = report.get("pid")
    return bool(pid) and os.path.exists(f"/proc/{pid}")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conformance")
    jobs = [(case, name) for case in CASES for name in ("torchrun", "placerun")]
    with ThreadPoolExecutor(CONCURRENT_LAUNCHERS) as pool:
        runs = list(pool.map(lambda job: _launch(*job, tmp), jobs))
    table = {}
    for (case, name), run in zip(jobs, runs):
        table.setdefault(case.name, {})[name] = run
    return table


def _comparable_env(env: dict) -> dict:
    return {k: ("<per run>" if k in PER_RUN_ENV else v) for k, v in env.items()
            if not k.startswith(ALLOWED_ENV_PREFIXES) and k not in ALLOWED_ENV}


def _seen(report: dict) -> dict:
    """All a worker saw, with the per-launcher work directory written as <work>."""
    work = str(Path(report["env"]["CONFORM_OUT"]).parent)
    seen = {k: v for k, v in report.items() if k not in ("allowed", "env", "pid")}
    if seen["sitecustomize"] and "_worker_hook" in seen["sitecustomize"]:
        seen["sitecustomize"] = None  # ALLOWED: the hook stays as `sitecustomize` where Python has none
    seen["env"] = _comparable_env(report["env"])
    return json.loads(json.dumps(seen).replace(work, "<work>"))


def _summary_program(stderr: str) -> Optional[str]:
    m = re.search(r"^(\S+) FAILED$", stderr, re.M)
    return m and m.group(1)


def _traceback_frames(stderr: str, work: str) -> list:
    return [line.strip().replace(work, "<work>") for line in stderr.splitlines() if line.strip().startswith("File ")
            and "conform" in line]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_placerun_runs_the_job_as_torchrun_does(results, case):
    torch_run, place_run = results[case.name]["torchrun"], results[case.name]["placerun"]
    context = f"\n--- placerun stderr:\n{place_run.stderr[-3000:]}\n--- torchrun stderr:\n{torch_run.stderr[-3000:]}"
    assert place_run.code == torch_run.code, context
    if case.exit_code is not None:
        assert torch_run.code == case.exit_code, context
    assert sorted(place_run.reports) == sorted(torch_run.reports), context
    assert len({k.split(".")[0] for k in torch_run.reports}) == case.nproc, context
    for key, torch_report in torch_run.reports.items():
        assert _seen(place_run.reports[key]) == _seen(torch_report), key
    assert _summary_program(place_run.stderr) == _summary_program(torch_run.stderr), context
    assert sorted(place_run.stdout.splitlines()) == sorted(torch_run.stdout.splitlines())
    assert place_run.logs.keys() == torch_run.logs.keys()
    for name, text in torch_run.logs.items():
        if name.endswith(("stdout.log", "stderr.log")) and "conform rank" in text:
            assert place_run.logs[name] == text, name


def test_the_failure_summary_names_the_users_program(results):
    for case in ("worker_exits_3", "worker_raises", "worker_killed"):
        assert _summary_program(results[case]["placerun"].stderr) == "conform.py", case


def test_a_raising_worker_shows_only_its_own_frames(results):
    runs = results["worker_raises"]
    frames = {name: _traceback_frames(run.stderr, str(Path(run.reports["rank1.r0"]["file"]).parent))
              for name, run in runs.items()}
    assert frames["placerun"] == frames["torchrun"] and frames["torchrun"], frames
    assert "bootstrap" not in runs["placerun"].stderr and "runpy" not in runs["placerun"].stderr


def test_restart_reaches_every_worker_again(results):
    runs = results["max_restarts"]
    assert {k for k in runs["placerun"].reports} == {"rank0.r0", "rank1.r0", "rank0.r1", "rank1.r1"}


def test_python_workers_are_bound_by_the_plan_of_their_own_local_rank(results):
    """The product's difference, checked: each placerun worker's mask is its own local rank's plan,
    also under --virtual-local-rank, where torch hands every worker LOCAL_RANK=0."""
    from placement.config import load_config
    from placement.cpuset import parse_cpulist
    from placement.plan import plan_for_node
    from placement.roles import ThreadRole

    _, plan = plan_for_node(load_config([]), 2)
    for case in ("standalone", "virtual_local_rank", "module"):
        for key, report in results[case]["placerun"].reports.items():
            local_rank = int(report["env"]["RANK"])  # one node: the global rank is the local rank
            assert parse_cpulist(report["allowed"]) == plan.for_local_rank(local_rank).cpus(ThreadRole.MAIN), (case, key)
    assert {r["env"]["LOCAL_RANK"] for r in results["virtual_local_rank"]["placerun"].reports.values()} == {"0"}


@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="needs a second interpreter, /usr/bin/python3")
def test_python_exec_runs_the_workers_under_that_interpreter(results):
    """Each placerun worker is bound by its plan, or (placement not importable there) one line says it
    runs unbound; test_bootstrap covers the interpreter that cannot import placement."""
    from placement.config import load_config
    from placement.cpuset import parse_cpulist
    from placement.plan import plan_for_node
    from placement.roles import ThreadRole

    _, plan = plan_for_node(load_config([]), 2)
    run = results["python_exec"]["placerun"]
    assert {r["executable"] for r in run.reports.values()} == {"/usr/bin/python3"}
    unbound = sum(parse_cpulist(r["allowed"]) != plan.for_local_rank(int(r["env"]["RANK"])).cpus(ThreadRole.MAIN)
                  for r in run.reports.values())
    assert unbound == sum("runs unbound" in line for line in run.stderr.splitlines()), run.stderr[-2000:]


def test_sigterm_stops_the_workers_as_under_torchrun(results):
    for name, run in results["sigterm_launcher"].items():
        assert len(run.reports) == 2 and not run.leftover_workers, name


def test_launch_ends_with_os_environ_as_it_was(tmp_path, monkeypatch):
    """In-process, as PyTorch's own launcher tests call torch.distributed.run.main."""
    from placement.launcher import main

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    (tmp_path / "t.py").write_text("")
    before = dict(os.environ)
    assert main(["--standalone", "--nproc-per-node", "1", str(tmp_path / "t.py")]) == 0
    assert dict(os.environ) == before
