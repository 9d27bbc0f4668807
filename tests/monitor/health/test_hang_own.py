"""A rank that stops stepping is named by its own monitor thread: a `stall` event within
2 x monitor.hang_min_s, with its main thread's kernel wait channel, state and Python stack;
one `resumed` event when steps go on; `placement report` puts it at the top."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

import placement
from placement.cli import main as cli
from placement.monitor.health.hang import HangWatch

HANG_MIN_S = 2.0


def _events(log: Path, kind: str) -> list[dict]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if d.get("type") == kind:
            out.append(d)
    return out


def _hung_in_a_lock(release: threading.Event) -> None:
    release.wait(timeout=30)  # the main thread waits on a futex, as in a hung collective's wait()


@pytest.mark.slow
def test_a_rank_that_stops_stepping_is_named_with_where_its_main_thread_waits(tmp_path, capsys):
    handle = placement.attach(policy="none", tune={"enabled": False},
                              monitor={"log_dir": str(tmp_path), "flush_every": 10, "summary_every": 0,
                                       "hang_min_s": HANG_MIN_S})
    log = tmp_path / "rank0.jsonl"
    for _ in range(30):
        time.sleep(0.002)
        handle.step()
    last_step_at = time.monotonic()
    seen: dict = {}
    release = threading.Event()

    def watch():  # what an operator's `tail -f` sees, timed from the last step
        while not release.is_set():
            if _events(log, "stall"):
                seen["after_s"] = time.monotonic() - last_step_at
                release.set()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    _hung_in_a_lock(release)  # blocks until the watcher saw the event (or 30 s)
    watcher.join()
    for _ in range(5):
        handle.step()
    handle.close()  # at once: steps after a hang that take less than one watch poll are resumed too
    stalls = _events(log, "stall")
    assert "after_s" in seen, "no stall event within 30 s"
    assert seen["after_s"] <= 2 * HANG_MIN_S, seen
    first = stalls[0]
    assert first["phase"] == "stalled" and first["rank"] == 0 and first["last_step"] == 30
    assert HANG_MIN_S <= first["stalled_s"] <= 2 * HANG_MIN_S
    main = first["main"]
    assert main["state"] == "S" and "futex" in main["wchan"], main  # blocked on a lock, not running
    assert any("_hung_in_a_lock" in line for line in main["stack"]), main["stack"]
    assert [e["phase"] for e in stalls] == ["stalled", "resumed"] and stalls[1]["resumed_step"] > 30

    # The report of the hung job as it was killed (its log up to the stall event): at the top.
    lines = log.read_text().splitlines()
    hung = tmp_path / "hung" / "rank0.jsonl"
    hung.parent.mkdir()
    hung.write_text("\n".join(lines[:next(i for i, l in enumerate(lines) if '"stall"' in l) + 1]) + "\n")
    capsys.readouterr()
    assert cli(["report", str(hung)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("HUNG: 1 rank(s)") and "rank 0 after step 30" in out, out[:400]
    capsys.readouterr()
    assert cli(["report", str(log)]) == 0  # it resumed: not flagged, the events say what happened
    out = capsys.readouterr().out
    assert not out.startswith("HUNG") and "rank 0 resumed" in out and "futex" in out, out


def test_the_limit_is_the_median_step_times_the_factor_with_a_floor():
    w = HangWatch(factor=10.0, min_s=1.0)
    assert w.threshold_s() == 1.0  # no step measured yet
    w.step_times([500.0] * 5)  # 0.5 s steps: 5 s before a stall
    assert w.threshold_s() == 5.0
    w.progress(7, 0)
    assert w.check(7, int(4.9e9)) is None
    s = w.check(7, int(5.1e9))
    assert s is not None and s.last_step == 7 and s.threshold_s == 5.0
    assert w.check(7, int(9e9)) is None  # one event per stall
    assert w.check(8, int(9.1e9)) is None and w.resumed == 8
