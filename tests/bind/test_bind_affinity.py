"""Thread and process affinity: set by syscall, read back from /proc, failures reported not raised."""
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from placement._procfs import ThreadGone
from placement.bind import apply_process_mask, bind_thread, read_allowed, read_last_cpu
from placement.roles import ThreadRole
from placerun_helpers import allowed

ALLOWED = sorted(os.sched_getaffinity(0))


@pytest.fixture
def parked_thread():
    """A real thread that waits until the test ends; yields its tid."""
    started, stop = threading.Event(), threading.Event()
    tid = []

    def body():
        tid.append(threading.get_native_id())
        started.set()
        stop.wait()

    t = threading.Thread(target=body)
    t.start()
    started.wait()
    yield tid[0]
    stop.set()
    t.join()


def test_bind_thread_sets_only_that_thread_and_reads_back(parked_thread):
    pid, target = os.getpid(), frozenset(ALLOWED[-1:])
    before_main = allowed(pid, pid)
    r = bind_thread(pid, parked_thread, "parked", ThreadRole.OTHER, target)
    assert r is not None and r.ok and r.error is None
    assert r.applied == target == allowed(pid, parked_thread)
    assert read_allowed(pid, parked_thread) == target
    assert allowed(pid, pid) == before_main  # the caller's own mask is untouched
    assert r.to_dict()["planned"] == sorted(target) and r.to_dict()["role"] == "other"


def test_bind_to_no_existing_cpu_reports_einval_with_thread_and_mask(parked_thread):
    bad = frozenset({max(ALLOWED) + 4096})
    r = bind_thread(os.getpid(), parked_thread, "parked", ThreadRole.NCCL, bad)
    assert r is not None and not r.ok
    assert "EINVAL" in r.error and str(parked_thread) in r.error and str(max(bad)) in r.error
    assert "'parked'" in r.error and "nccl" in r.error
    assert allowed(os.getpid(), parked_thread) == frozenset(ALLOWED)  # unchanged


def test_partly_impossible_mask_is_a_mismatch_not_a_success(parked_thread):
    asked = frozenset({ALLOWED[0], max(ALLOWED) + 4096})  # the kernel keeps only the CPU that exists
    r = bind_thread(os.getpid(), parked_thread, "parked", ThreadRole.MAIN, asked)
    assert r is not None and not r.ok
    assert r.applied == frozenset({ALLOWED[0]}) == allowed(os.getpid(), parked_thread)
    assert "asked for" in r.error and "runs on" in r.error


def test_exited_thread_is_skipped_silently():
    tid = []
    t = threading.Thread(target=lambda: tid.append(threading.get_native_id()))
    t.start()
    t.join()
    # join() returns when Python is done with the thread; the kernel task goes a moment later.
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/self/task/{tid[0]}") and time.monotonic() < deadline:
        time.sleep(0.001)
    assert bind_thread(os.getpid(), tid[0], "gone", ThreadRole.OTHER, frozenset(ALLOWED[:1])) is None
    with pytest.raises(ThreadGone):  # the one "thread gone" convention of placement._procfs
        read_allowed(os.getpid(), tid[0])


def test_last_cpu_is_an_allowed_cpu():
    assert read_last_cpu(os.getpid(), os.getpid()) in ALLOWED


def test_process_mask_covers_existing_and_later_threads():
    """In a child process (the mask is process-wide): threads alive at the call and threads made
    after it all read back the mask from /proc."""
    code = textwrap.dedent(f"""
        import os, threading, json
        from placement.bind import apply_process_mask
        stop = threading.Event()
        early = threading.Thread(target=stop.wait); early.start()
        r = apply_process_mask(frozenset({{{ALLOWED[0]}}}))
        late = threading.Thread(target=stop.wait); late.start()
        print(json.dumps({{"ok": r.ok, "applied": sorted(r.applied), "tids": os.listdir("/proc/self/task")}}),
              flush=True)
        input()
        stop.set()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        import json

        out = json.loads(p.stdout.readline())
        assert out["ok"] and out["applied"] == [ALLOWED[0]]
        assert len(out["tids"]) == 3
        for tid in out["tids"]:
            assert allowed(p.pid, int(tid)) == frozenset({ALLOWED[0]})
    finally:
        p.communicate("\n", timeout=30)
    assert p.returncode == 0


def test_process_mask_failure_is_reported_not_raised():
    r = apply_process_mask(frozenset({max(ALLOWED) + 4096}))
    assert not r.ok and "EINVAL" in r.error and r.role is None
    assert allowed(os.getpid(), os.getpid()) == frozenset(ALLOWED)
