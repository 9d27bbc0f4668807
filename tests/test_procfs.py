"""placement._procfs: one parser per /proc file, bounded reads, one "thread gone" convention,
one memory-policy get/set/probe; against this process's real /proc and crafted files."""
import errno
import os
import subprocess
import sys
import threading
import time

import pytest

from placement import _procfs


def _gone_thread() -> int:
    box = []
    t = threading.Thread(target=lambda: box.append(threading.get_native_id()))
    t.start()
    t.join()
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/self/task/{box[0]}") and time.monotonic() < deadline:
        time.sleep(0.001)
    return box[0]


def test_stat_parser_survives_parentheses_and_spaces_in_the_name():
    fields = ["R"] + [str(i) for i in range(4, 53)]
    fields[10 - 3], fields[20 - 3], fields[39 - 3] = "77", "9", "3"
    st = _procfs.parse_stat(f"42 (a) (b c) {' '.join(fields)}\n".encode())
    assert st == _procfs.TaskStat("a) (b c", "R", 77, 9, 3)
    with pytest.raises(ValueError):
        _procfs.parse_stat(b"garbage")
    with pytest.raises(ValueError):
        _procfs.parse_stat(b"1 (x) R 1 2")  # too few fields


def test_status_value_finds_whole_keys_only():
    raw = b"Name:\tx\nvoluntary_ctxt_switches:\t5\nnonvoluntary_ctxt_switches:\t7\nCpus_allowed_list:\t0-2,5\n"
    assert _procfs.status_value(raw, _procfs.NONVOLUNTARY_SWITCHES) == "7"
    assert _procfs.status_value(raw, b"voluntary_ctxt_switches:") == "5"
    assert _procfs.status_value(raw, _procfs.CPUS_ALLOWED_LIST) == "0-2,5"
    with pytest.raises(ValueError):
        _procfs.status_value(b"Name:\tx\n", _procfs.CPUS_ALLOWED_LIST)


def test_readers_follow_the_kernel_for_this_process():
    pid, tid = os.getpid(), threading.get_native_id()
    assert _procfs.cpus_allowed(pid, tid) == frozenset(os.sched_getaffinity(0))
    st = _procfs.stat(pid, tid)
    assert st.state == "R" and st.last_cpu in os.sched_getaffinity(0) and st.minflt > 0
    assert _procfs.stat(pid).num_threads == len(_procfs.task_ids(pid))
    assert tid in _procfs.task_ids(pid)
    assert _procfs.comm(pid) == open(f"/proc/{pid}/comm").read().strip()
    assert _procfs.schedstat(pid, tid).cpu_ns > 0
    assert _procfs.mems_allowed() and min(_procfs.mems_allowed()) >= 0
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in _procfs.children(pid)
    finally:
        child.kill()
        child.wait()


def test_every_reader_says_thread_gone_the_same_way():
    pid, gone = os.getpid(), _gone_thread()
    for read in (lambda: _procfs.cpus_allowed(pid, gone), lambda: _procfs.stat(pid, gone),
                 lambda: _procfs.comm(pid, gone), lambda: _procfs.schedstat(pid, gone),
                 lambda: _procfs.task_ids(2 ** 22 + 7)):
        with pytest.raises(_procfs.ThreadGone):
            read()


def test_kept_descriptor_of_an_exited_thread_says_thread_gone():
    ready, stop = threading.Event(), threading.Event()
    box = []

    def park():
        box.append(threading.get_native_id())
        ready.set()
        stop.wait()

    t = threading.Thread(target=park)
    t.start()
    ready.wait()
    fd = os.open(f"/proc/self/task/{box[0]}/schedstat", os.O_RDONLY)
    try:
        assert _procfs.schedstat_at(fd).cpu_ns >= 0
        stop.set()
        t.join()
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/self/task/{box[0]}") and time.monotonic() < deadline:
            time.sleep(0.001)
        with pytest.raises(_procfs.ThreadGone):
            _procfs.schedstat_at(fd)
    finally:
        os.close(fd)


def test_bounded_read_refuses_fifos_devices_and_oversized_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(_procfs.NotRegularFile, match="FIFO"):
        _procfs.read_bounded(str(fifo), 4096)  # no writer: a blocking open would hang here
    assert time.monotonic() - started < 5
    with pytest.raises(_procfs.NotRegularFile, match="character device"):
        _procfs.read_bounded("/dev/zero", 4096)
    (tmp_path / "zero").symlink_to("/dev/zero")
    with pytest.raises(_procfs.NotRegularFile):
        _procfs.read_bounded(str(tmp_path / "zero"), 4096)
    big = tmp_path / "big"
    big.write_bytes(b"1" * 5000)
    with pytest.raises(_procfs.FileTooLarge):
        _procfs.read_bounded(str(big), 4096)
    assert _procfs.read_bounded(str(big), 5000) == b"1" * 5000
    with pytest.raises(FileNotFoundError):
        _procfs.read_bounded(str(tmp_path / "missing"), 10)


@pytest.mark.skipif(not _procfs.mempolicy_supported(), reason="no mempolicy syscall numbers for this arch")
def test_mempolicy_get_set_probe_in_one_vocabulary():
    assert _procfs.get_mempolicy() == _procfs.Mempolicy("none", ())
    node = min(_procfs.mems_allowed())
    allowed = _procfs.probe_mempolicy("bind", [node])
    assert _procfs.get_mempolicy().mode == "none"  # the probe ran in its own thread
    assert _procfs.probe_mempolicy("bind", [_procfs.MAX_NUMNODES]) == errno.EINVAL
    if allowed != 0:
        pytest.skip(f"set_mempolicy(MPOL_BIND) is refused here ({errno.errorcode.get(allowed)})")
    box = []

    def set_and_read():
        box.append(_procfs.set_mempolicy("bind", [node]))
        box.append(_procfs.get_mempolicy())

    t = threading.Thread(target=set_and_read)
    t.start()
    t.join()
    assert box == [0, _procfs.Mempolicy("bind", (node,))]
