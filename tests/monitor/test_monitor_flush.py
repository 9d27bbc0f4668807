"""Records are not lost when training ends badly: SIGTERM (the previous handler still runs
afterwards) and an uncaught exception flush every measured step.

The file is also the training program: `python tests/monitor/test_monitor_flush.py MODE LOG_DIR`.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

STEPS = 7


def _run(tmp_path, mode, send_sigterm):
    p = subprocess.Popen([sys.executable, __file__, mode, str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if send_sigterm:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    steps = [json.loads(l) for l in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    return p.returncode, err, [s for s in steps if s["type"] == "step"]


@pytest.mark.slow
def test_sigterm_flushes_then_dies_of_the_signal(tmp_path):
    rc, err, steps = _run(tmp_path, "plain", send_sigterm=True)
    assert rc == -signal.SIGTERM, err
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_sigterm_flushes_then_runs_the_programs_own_handler(tmp_path):
    rc, err, steps = _run(tmp_path, "own-handler", send_sigterm=True)
    assert rc == 3, err
    assert (tmp_path / "handler-ran").exists()
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_uncaught_exception_flushes_and_keeps_its_traceback(tmp_path):
    rc, err, steps = _run(tmp_path, "exception", send_sigterm=False)
    assert rc == 1
    assert "RuntimeError: loss is nan" in err
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_a_forked_child_killed_by_sigterm_does_not_write_the_ranks_buffered_lines(tmp_path):
    # A DataLoader worker is forked with the rank's unflushed log buffer and its handlers;
    # torch terminates slow workers with SIGTERM.
    rc, err, steps = _run(tmp_path, "fork", send_sigterm=False)
    assert rc == 0, err
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))  # once each


def main(mode: str, log_dir: str) -> None:
    import placement

    if mode == "own-handler":
        def handler(signum, frame):
            open(os.path.join(log_dir, "handler-ran"), "w").close()
            sys.exit(3)

        signal.signal(signal.SIGTERM, handler)
    # flush_every far beyond the run: only the exit paths can write these records.
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": log_dir, "flush_every": 1000, "summary_every": 0})
    for _ in range(STEPS):
        time.sleep(0.002)
        h.step()
    if mode == "exception":
        raise RuntimeError("loss is nan")
    if mode == "fork":
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        time.sleep(0.2)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        return
    print("ready", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
