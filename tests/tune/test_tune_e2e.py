"""End to end on this machine: a foreign hog pinned to the main thread's core makes the tuner
move the main thread (read back from /proc), the step time recovers, and the tune event names
the rule and the measured effect.

"Recovers" is judged against a reference measured under the same load: the same training loop
and step hook, attached without binding or tuner, pinned by the test to the cores the hogs are
not on, run while the hogs still spin, right after the tuned run. A figure from before the hogs
is no such reference on a busy machine: there the other load fits on the other core and main
may have its core to itself, while with the hogs holding one core that load shares main's new
core, so main is slower for reasons no tuner can remove (seen with two foreign spinners on 2
cores: 19.3 and 16.2 ms after the move vs 9.9 and 8.3 ms before the hogs). The reference
process starts with the worker and is warmed up by then, so its steps follow the worker's last
ones within milliseconds: load that comes and goes on a shared machine weighs on both alike.

The hogs are armed first (forked, pinned, blocked on a FIFO) and the worker lets them go at
the first step of a tune window while no action is in flight: forking 8 of them from pytest
can outlast a window, and a window half hogged moves main on evidence of its own (CI: a kept
move whose trigger window ended before the old "hogs started" step). Recovery is the median of
every step after the window the move was judged on, not of the last ten: a passing load of a
few steps decided the old figure (6.64 vs 5.03 ms in CI).

The training process is a child (this file run as a script) that calls placement.attach()
(real plan, binder, monitor and tuner), so pytest's own threads are never re-bound; the hogs
are forked from pytest, foreign to the training process.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

WINDOW = 10  # placement.tune.window for the run
QUIET_STEPS = 60
HOG_STEPS = 120
REFERENCE_STEPS = 30  # timed steps of the reference loop, after WINDOW untimed warm-up steps
# Spinning processes pinned to main's core: main gets a ninth of it. With 3 (a quarter), other
# load the machine has already takes much of a move's gain: two foreign spinners on a 2-core
# machine share main's new core, a quarter becomes a third (+25%), within the noise band of such
# a machine, and the tuner rightly rolls the move back. A ninth becomes a third: a clear signal.
HOGS = 8
ATTEMPTS = 3  # the machine may be shared: another process may keep the free core busy a while


def _allowed(pid: int, tid: int) -> frozenset[int]:
    from placement.bind.affinity import read_allowed

    got = read_allowed(pid, tid)
    assert got is not None, f"thread {tid} of {pid} is gone"
    return got


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"worker exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {path.name}"
        time.sleep(0.02)


def _idle_fraction(interval: float = 1.0) -> float:
    """Share of all CPUs' time idle over `interval`, from /proc/stat."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, total

    idle0, total0 = sample()
    time.sleep(interval)
    idle1, total1 = sample()
    return (idle1 - idle0) / max(1, total1 - total0)


def _wait_for_a_spare_cpu(timeout: float = 30.0) -> None:
    """The machine may be shared: give each attempt a fair chance by starting it when at least
    one CPU's worth of time is idle (or after `timeout`, whatever the load)."""
    want = 1.0 / os.cpu_count()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _idle_fraction() < want:
        pass


def _start_hog(cpus: frozenset[int], release: Path) -> int:
    """A foreign CPU hog: a forked process pinned to `cpus` that spins, until killed, from the
    moment a writer opens the FIFO `release` (the worker does, at the first step of a tune
    window)."""
    pid = os.fork()
    if pid == 0:  # child: pin, wait for the release, spin; never returns into pytest
        try:
            os.sched_setaffinity(0, cpus)
            os.close(os.open(release, os.O_RDONLY))  # blocks until the worker opens it for writing
            while True:
                pass
        finally:
            os._exit(0)
    return pid


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _attempt(tmp: Path) -> dict:
    """One run: quiet steps, then HOGS foreign spinners pinned to main's core, then the reference
    loop on the other cores while they still spin. Returns what was read."""
    worker = subprocess.Popen([sys.executable, __file__, "worker", str(tmp)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ref = subprocess.Popen([sys.executable, __file__, "reference", str(tmp)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hogs: list[int] = []
    try:
        _wait_for(tmp / "reference_ready", ref)
        _wait_for(tmp / "ready", worker)
        hog_core = _allowed(worker.pid, worker.pid)  # where the plan (or tuner) has main now
        assert hog_core < os.sched_getaffinity(0), f"main is not bound to a core of its own: {hog_core}"
        # Forking and pinning 8 hogs from pytest can take longer than a tune window: they are
        # armed first, each pinned and blocked on the FIFO, and the worker lets them all go at
        # once at the first step of a tune window, so the window that shows them is hogged whole.
        os.mkfifo(tmp / "hogs_release")
        hogs = [_start_hog(hog_core, tmp / "hogs_release") for _ in range(HOGS)]
        for h in hogs:
            while _allowed(h, h) != hog_core:
                time.sleep(0.01)
        (tmp / "hogs_armed").touch()
        _wait_for(tmp / "done", worker)
        moved_to = _allowed(worker.pid, worker.pid)  # read back while the hogs still run
        # The reference: the same loop on the cores the hogs are not on, while they still run.
        (tmp / "reference_cpus.tmp").write_text(json.dumps(sorted(set(os.sched_getaffinity(0)) - set(hog_core))))
        (tmp / "reference_cpus.tmp").rename(tmp / "reference_cpus")
        _, err = ref.communicate(timeout=60)
        assert ref.returncode == 0, f"reference run failed ({ref.returncode}): {err[-3000:]}"
        (tmp / "exit").touch()
        _, err = worker.communicate(timeout=60)
        assert worker.returncode == 0, err[-3000:]
    finally:
        for h in hogs:
            _stop(h)
        for p in (worker, ref):
            if p.poll() is None:
                p.kill()
                p.wait()
    result = json.loads((tmp / "result.json").read_text())
    reference_times = json.loads((tmp / "reference.json").read_text())
    events = [json.loads(line) for line in (tmp / "rank0.jsonl").read_text().splitlines()]
    return {"hog_core": sorted(hog_core), "moved_to": moved_to, "hog_pids": set(hogs),
            "times": result["times_ms"], "hog_step": result["hog_step"],
            "reference": statistics.median(reference_times), "reference_times": reference_times,
            "events": events}


def _check(run: dict) -> None:
    hog_core, times, hog_at = run["hog_core"], run["times"], run["hog_step"]
    assert not run["moved_to"] & set(hog_core), f"main still on the hogs' core {hog_core}: {run['moved_to']}"
    # The hogs spin from the start of step hog_at, the first step of a tune window.
    kept = [e for e in run["events"] if e["type"] == "tune" and e.get("phase") == "kept"
            and e["change"]["from"] == hog_core and e["evidence"]["window"][0] >= hog_at]
    assert kept, (f"no kept move off {hog_core} after step {hog_at}: "
                  + "; ".join(e.get("message", e["type"]) for e in run["events"]
                              if e["type"] in ("tune", "rollback")))
    k = kept[0]
    assert k["rule"] == "runqueue" and k["role"] == "main"
    assert set(k["change"]["to"]) == set(run["moved_to"])
    assert k["effect"]["gain_pct"] > 20 and k["effect"]["after_median_ms"] < k["effect"]["before_median_ms"]
    assert {f["pid"] for f in k["evidence"]["foreign"] if f["pinned"]} & run["hog_pids"]
    # Recovered: the steps after the window the kept move was judged on (times[i] is step i + 1),
    # all of them, so a passing load of a few steps on this machine does not decide it.
    after = times[k["judged_steps"][1]:]
    assert len(after) >= WINDOW, f"the move was judged at step {k['judged_steps'][1]}, too late to see recovery"
    last = statistics.median(after)
    assert last < 1.3 * run["reference"], (
        f"step did not recover: {last:.2f} ms vs {run['reference']:.2f} ms for the same loop pinned off the "
        f"hogs' core ({statistics.median(times[WINDOW:hog_at - 1]):.2f} ms before the hogs); steps after the verdict "
        f"{[round(t, 2) for t in after]}, reference {[round(t, 2) for t in run['reference_times']]}")


@pytest.mark.slow
def test_hog_on_main_core_moves_main_and_step_time_recovers(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs to move the main thread anywhere")
    failures = []
    for i in range(ATTEMPTS):
        tmp = tmp_path / f"attempt{i}"
        tmp.mkdir()
        _wait_for_a_spare_cpu()
        try:
            _check(_attempt(tmp))
            print("; ".join(failures))  # earlier attempts' failures: shown by pytest -rP
            return
        except AssertionError as e:
            failures.append(f"attempt {i}: {str(e).splitlines()[0][:500]}")
    pytest.fail("; ".join(failures))


# ---- the training process ----------------------------------------------------------------
def _train_step() -> Callable[[], None]:
    """One training step of a small MLP on one intra-op thread (the worker's and the reference's)."""
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 512), torch.randn(64, 512)

    def step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def _reference_run(tmp: Path) -> None:
    """The tuned run's yardstick: the same loop and step hook, attached with no binding and no
    tuner, warmed up at once, then idle until the test names its CPUs, then timed there."""
    import torch

    import placement

    torch.set_num_threads(1)
    handle = placement.attach(config=[f"monitor.log_dir={tmp / 'reference'}", "policy=none", "tune.enabled=false",
                                      f"monitor.flush_every={WINDOW // 2}", "monitor.summary_every=0"])
    train = _train_step()
    for _ in range(WINDOW):
        train()
        handle.step()
    (tmp / "reference_ready").touch()
    while not (tmp / "reference_cpus").exists():
        time.sleep(0.005)
    cpus = json.loads((tmp / "reference_cpus").read_text())
    for tid in os.listdir("/proc/self/task"):  # every thread, the monitor's too, as the worker's are
        os.sched_setaffinity(int(tid), cpus)
    times = []
    for _ in range(REFERENCE_STEPS):
        t0 = time.perf_counter()
        train()
        handle.step()
        times.append((time.perf_counter() - t0) * 1000.0)
    handle.close()
    (tmp / "reference.json").write_text(json.dumps(times))


def _worker(tmp: Path) -> None:
    """A training-like loop under placement.attach() (plan, binding, monitor and tuner all real)."""
    import torch

    import placement
    from placement.tune.tuner import TunerState

    torch.set_num_threads(1)
    # tune.window_min_s 0: the hogs are let go at the first step of a window of WINDOW steps
    handle = placement.attach(config=[f"monitor.log_dir={tmp}", f"tune.window={WINDOW}", "tune.window_min_s=0",
                                      f"monitor.flush_every={WINDOW // 2}", "monitor.summary_every=0"])
    train = _train_step()
    times: list[float] = []  # times[i] is the monitor's step i + 1
    hog_step = None  # the monitor's number of the first step the hogs spin through
    release = None
    while hog_step is None or handle.steps - hog_step + 1 < HOG_STEPS:
        step = handle.steps + 1  # the step about to run
        idle = handle.tuner.state is TunerState.WATCHING  # no action in flight or cooling down
        if step > QUIET_STEPS and idle and not (tmp / "ready").exists():
            (tmp / "ready").touch()  # main stays where it is when the hogs come
        if hog_step is None and idle and (tmp / "hogs_armed").exists() \
                and handle.tuner.window_end(step - 1) == step - 1 + WINDOW:
            # step opens a tune window: let the hogs go (the write end stays open, so a hog that
            # reaches its open() late goes at once)
            release = os.open(tmp / "hogs_release", os.O_WRONLY | os.O_NONBLOCK)
            hog_step = step
        t0 = time.perf_counter()
        train()
        handle.step()
        times.append((time.perf_counter() - t0) * 1000.0)
    (tmp / "result.json").write_text(json.dumps({"times_ms": times, "hog_step": hog_step}))
    handle.events.flush()
    (tmp / "done").touch()
    while not (tmp / "exit").exists():
        time.sleep(0.01)
    handle.close()
    os.close(release)


if __name__ == "__main__":
    if sys.argv[1] == "reference":
        _reference_run(Path(sys.argv[2]))
    else:
        _worker(Path(sys.argv[2]))
