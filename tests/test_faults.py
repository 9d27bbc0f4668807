"""Faults: a signal while the main thread writes the event log, a full filesystem, FIFO and
/dev/zero sysfs files, an absurd sysfs `present`. Nothing hangs, nothing is lost silently.

The file is also the training program: `python tests/test_faults.py MODE LOG_DIR`.
"""
from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

STEPS = 7
FULL_STEPS = 200  # per phase of the full-disk run: disk full, then space again


def _start(mode: str, log_dir, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, mode, str(log_dir), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _steps(log: Path) -> list[int]:
    out = []
    for line in log.read_bytes().split(b"\n"):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("type") == "step":
            out.append(d["step"])
    return out


# ---- a signal while the main thread is inside an event-log write -------------------------------
@pytest.mark.slow
def test_sigterm_while_the_main_thread_holds_the_log_lock_is_deferred_not_a_hang(tmp_path):
    """Deterministic: the program takes the log's lock as write_lines does, signals itself, and
    only then releases it. The handler must return at once (it used to block forever on the
    lock), and the signal must be delivered at the release: all steps written, death by SIGTERM."""
    p = _start("hold-lock", tmp_path)
    out, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGTERM, err
    assert "handler returned" in out and "released" not in out  # delivered at the release itself
    assert _steps(tmp_path / "rank0.jsonl") == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_sigterm_during_a_users_event_loop_never_hangs(tmp_path):
    """As a user hits it: the main thread writes events in a loop (handle.events.event) when
    torchrun's SIGTERM arrives. Three runs at once; each must die of the signal within the
    timeout with every step written."""
    runs = [(_start("event-loop", tmp_path / str(i)), tmp_path / str(i)) for i in range(3)]
    for p, _ in runs:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.2)  # well inside the loop
        p.send_signal(signal.SIGTERM)
    for p, d in runs:
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail("the rank hung on SIGTERM")
        assert p.returncode == -signal.SIGTERM, err
        assert _steps(d / "rank0.jsonl") == list(range(1, STEPS + 1))


# ---- a full filesystem -----------------------------------------------------------------------------
def _mount_tiny_tmpfs(path: Path) -> bool:
    """A 1 MiB tmpfs at `path`, mode 0700 (a log dir of ours: a tmpfs is 1777 by default, which the
    log refuses), needs CAP_SYS_ADMIN; False where it cannot be mounted."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


@pytest.mark.slow
def test_full_filesystem_is_said_once_counted_and_reported(tmp_path, capsys):
    """The log directory is a 1 MiB tmpfs that the program fills with a file before it trains
    (the kernel answers ENOSPC); without the right to mount, RLIMIT_FSIZE gives the same write
    failure (EFBIG). After FULL_STEPS steps the space comes back (the filler is removed, or the
    limit raised) for FULL_STEPS more."""
    from placement.cli import main as cli

    log_dir = tmp_path / "small"
    mounted = _mount_tiny_tmpfs(log_dir)
    try:
        p = _start("full-disk", log_dir, "tmpfs" if mounted else "rlimit")
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        said = [line for line in err.splitlines() if "cannot write" in line]
        total = [line for line in err.splitlines() if "could not be written" in line]
        assert len(said) == 1 and ("ENOSPC" in said[0] if mounted else "EFBIG" in said[0]), err
        assert len(total) == 1, err
        dropped = int(re.search(r"rank 0: (\d+) record\(s\) could not be written", total[0]).group(1))
        steps = _steps(log_dir / "rank0.jsonl")
        assert steps[-FULL_STEPS:] == list(range(FULL_STEPS + 1, 2 * FULL_STEPS + 1))  # space back: all written
        missing = 2 * FULL_STEPS - len(steps)
        assert missing >= FULL_STEPS // 2  # the full phase lost most of its records...
        assert missing <= dropped <= missing + 5  # ...and every one of them is counted (plus a few events)
        assert cli(["report", str(log_dir / "rank0.jsonl")]) == 0
        report = capsys.readouterr().out
        assert f"rank 0: {dropped} record(s) were lost" in report
    finally:
        if mounted:
            subprocess.run(["umount", str(log_dir)], capture_output=True)


# ---- sysfs files that are not files -----------------------------------------------------------------
def test_fifo_and_dev_zero_in_sysfs_are_one_warning_each_not_a_hang(tmp_path):
    from placement.topology import discover
    from sysfs_builder import make_tree

    root = Path(make_tree(tmp_path, "small_cpu"))
    cpu = root / "sys/devices/system/cpu"
    fifo = cpu / "cpu1/acpi_cppc/highest_perf"
    fifo.unlink()
    os.mkfifo(fifo)
    zero = cpu / "cpu0/cpufreq/cpuinfo_max_freq"
    zero.unlink()
    zero.symlink_to("/dev/zero")
    started = time.monotonic()
    topo = discover(str(root))
    assert time.monotonic() - started < 10
    assert [w for w in topo.warnings if str(fifo) in w] == [f"{fifo}: unreadable (is a FIFO, not a regular file)"]
    assert [w for w in topo.warnings if str(zero) in w] == [
        f"{zero}: unreadable (is a character device, not a regular file)"]
    assert len(topo.cpus) == 16 and all(c.online for c in topo.cpus)  # the rest of discovery stands


def test_absurd_sysfs_present_is_a_warning_not_a_memory_error(tmp_path):
    from placement.topology import discover
    from sysfs_builder import make_tree

    root = Path(make_tree(tmp_path, "small_cpu"))
    present = root / "sys/devices/system/cpu/present"
    present.write_text("0-4294967295\n")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    topo = discover(str(root))
    assert [w for w in topo.warnings if str(present) in w], topo.warnings
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100 * 1024  # KiB: no 4-billion-entry set


def test_a_cpu_directory_beyond_the_kernels_limit_is_a_warning_not_a_cpu(tmp_path):
    from placement.topology import discover
    from sysfs_builder import make_tree

    root = Path(make_tree(tmp_path, "small_cpu"))
    (root / "sys/devices/system/cpu/cpu99999999999").mkdir()
    topo = discover(str(root))
    assert max(c.id for c in topo.cpus) == 15
    assert [w for w in topo.warnings if "cpu99999999999 beyond the kernel's limit of 8192 cpus" in w]


# ---- the programs --------------------------------------------------------------------------------
def _attach(log_dir: str, flush_every: int):
    import placement

    return placement.attach(policy="none", tune={"enabled": False},
                            monitor={"log_dir": log_dir, "flush_every": flush_every, "summary_every": 0,
                                     "budget_pct": 0, "handover_min_s": 0})  # written at its flush steps


def main(mode: str, log_dir: str, *extra: str) -> None:
    if mode == "hold-lock":
        h = _attach(log_dir, 1000)  # only the exit paths write the steps
        for _ in range(STEPS):
            h.step()
        ev = h.events
        assert ev._acquire()  # as write_lines does: the main thread is inside a write
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode, lock held
        print("handler returned", flush=True)
        ev._release()  # the deferred SIGTERM is delivered here
        print("released", flush=True)
        time.sleep(30)
        return
    if mode == "event-loop":
        h = _attach(log_dir, 1000)
        for _ in range(STEPS):
            h.step()
        print("ready", flush=True)
        while True:
            h.events.event("user", payload="x" * 3000)
    if mode == "full-disk":
        how = extra[0]
        h = _attach(log_dir, 10)
        h.events.flush()
        filler = os.path.join(log_dir, "filler")
        if how == "tmpfs":
            with open(filler, "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * 4096)
                except OSError:
                    pass
        else:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(h.events.path) + 100, hard))
        for _ in range(FULL_STEPS):
            h.step()
        time.sleep(1.0)  # the monitor thread writes the full phase's records (and fails) before space is back
        if how == "tmpfs":
            os.unlink(filler)
        else:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        for _ in range(FULL_STEPS):
            h.step()
        h.close()
        return
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(*sys.argv[1:])
