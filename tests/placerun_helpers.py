"""Shared by the placerun tests: how to start placerun/torchrun, and independent /proc read-backs
(parsed here, not with placement's own readers, so the tests check the binder from outside)."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from placement.cpuset import parse_cpulist

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "tests" / "placerun_jobs"
BIN = Path(sys.executable).parent


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (a store or rendezvous a test starts binds it next)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def run_gloo_ranks(world: int, argv: list[str], timeout: float) -> None:
    """Run `python argv...` as ranks 0..world-1 of one env:// job on a free port (torchrun's
    variables set, one OpenMP thread each) and wait for all; a rank that fails (or the time
    running out) fails the test with its output's end."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    try:
        outs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out[-3000:]}"


def exit_without_gloo_teardown() -> None:
    """End a worker process once everything its test reads is written and closed, without
    tearing gloo down: its destructors sometimes abort with "terminate called without an
    active exception" (SIGABRT after a correct run, in destroy_process_group or at
    interpreter exit; seen in two sessions here, also pytorch/pytorch#190489), which would
    fail the test for torch's teardown, not for anything placement does."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def close_and_exit(handle) -> None:
    """A gloo worker's end: its monitor closed (every record written), every rank past the
    barrier (no peer's store read fails for a rank gone), then exit_without_gloo_teardown()."""
    import torch.distributed as dist

    handle.close()
    dist.barrier()
    exit_without_gloo_teardown()


def write_facts(out_dir: str, rank: int, facts: dict) -> None:
    """What a rank under placerun found, as facts<rank>.json for its test to read back."""
    import json

    with open(os.path.join(out_dir, f"facts{rank}.json"), "w") as f:
        json.dump(facts, f)


def launcher(name):
    """The installed console script when there is one, else the module behind it."""
    script = BIN / name
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "placement.launcher" if name == "placerun" else "torch.distributed.run"]


def start(cmd, log_prefix: Path, **kw):
    out = open(f"{log_prefix}.out", "w")
    err = open(f"{log_prefix}.err", "w")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLACEMENT_", "OMP_NUM_THREADS"))}
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO, env=env, start_new_session=True, **kw)
    _started.append(proc)
    return proc


_started: list[subprocess.Popen] = []


def reap_started(grace_s: float = 15.0) -> None:
    """Stop every launcher a test started and left running (a failed assertion, a timeout):
    SIGTERM lets the agent tear its workers down, SIGKILL to its process group after `grace_s`."""
    while _started:
        proc = _started.pop()
        if proc.poll() is not None:
            continue
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def text(log_prefix: Path, stream: str) -> str:
    return Path(f"{log_prefix}.{stream}").read_text()


def wait_for(paths, procs, timeout=120):
    """Wait until every path exists; fail early, with the launcher's stderr, if a launcher exits."""
    deadline = time.monotonic() + timeout
    while not all(Path(p).exists() for p in paths):
        for p, prefix in procs:
            if p.poll() is not None:
                raise AssertionError(f"launcher exited {p.returncode} early:\n{text(prefix, 'err')[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {paths}")
        time.sleep(0.1)


def allowed(pid, tid=None):
    """A process's (or one thread's) Cpus_allowed_list read from /proc; None when it is gone."""
    path = f"/proc/{pid}/status" if tid is None else f"/proc/{pid}/task/{tid}/status"
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("Cpus_allowed_list:"):
                    return parse_cpulist(line.split(":", 1)[1])
    except OSError:
        return None


def comm(pid, tid=None):
    path = f"/proc/{pid}/comm" if tid is None else f"/proc/{pid}/task/{tid}/comm"
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def tids(pid):
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return []


def wait_thread_gone(tid: int, timeout: float = 5.0) -> bool:
    """Wait, bounded, until this process's thread `tid` has left /proc/self/task; False if it
    has not. Python's Thread.join() returns when the thread state is torn down, before the
    pthread has exited and the kernel removed it (seen after ~1 join in 100 on 2 busy cores)."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/self/task/{tid}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def children(pid):
    kids = []
    for tid in tids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.extend(int(x) for x in f.read().split())
        except OSError:
            pass
    return kids


_KERNEL_POLICY = {"default": "none", "local": "none", "prefer": "preferred", "bind": "bind",
                  "interleave": "interleave"}


def memory_policy(pid, tid):
    """(mode, nodes) of a thread's policy, as /proc/<pid>/task/<tid>/numa_maps shows it for
    mappings that have none of their own (the first line's policy field)."""
    with open(f"/proc/{pid}/task/{tid}/numa_maps") as f:
        field = f.readline().split()[1]
    mode, _, nodes = field.partition(":")
    mode = _KERNEL_POLICY.get(mode.split("=")[0], mode)
    return mode, sorted(parse_cpulist(nodes)) if mode != "none" else []


def run_self_under_placerun(script: str, tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """A test file that is also its worker, run as 2 ranks by `placerun --standalone` with its logs
    in tmp_path/logs and tmp_path as its one argument; fails the test with the output's end unless
    it exits 0 (skips where placerun is not installed)."""
    import pytest
    placerun = shutil.which("placerun", path=str(BIN))
    if placerun is None:
        pytest.skip("placerun is not installed in this environment")
    p = subprocess.run([placerun, "--standalone", "--nproc-per-node", "2",
                        f"placement.monitor.log_dir={tmp_path / 'logs'}", "placement.strict=false", script,
                        str(tmp_path)], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p
