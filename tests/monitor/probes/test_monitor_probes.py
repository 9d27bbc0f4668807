"""Probes against the kernel's own files: real /proc for this process, crafted files for
formats this machine cannot show (a comm with ') (' in it, cpufreq)."""
import os
import threading
import time

import pytest

from placement.monitor.probes.cpufreq import CoreFreq
from placement._procfs import nonvoluntary_switches_at, schedstat_at, stat_at
from placement.monitor.probes.counters import MainRead, MainThreadProbe, ThreadGone, ThreadProbe, thread_cpu_clock
from placement.monitor.warn import WarnOnce
from placerun_helpers import wait_thread_gone


def _spin(seconds: float) -> None:
    """Burn `seconds` of this thread's CPU time (wall time would depend on the machine's load)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _fd(path) -> int:
    return os.open(path, os.O_RDONLY)


def test_schedstat_stat_status_of_this_thread_follow_the_kernel():
    tid = threading.get_native_id()
    base = f"/proc/self/task/{tid}"
    fds = [_fd(f"{base}/{n}") for n in ("schedstat", "stat", "status")]
    try:
        cpu0, runq0 = schedstat_at(fds[0])
        _spin(0.05)
        time.sleep(0.01)  # a switch: the kernel folds the running time into schedstat
        cpu1, runq1 = schedstat_at(fds[0])
        assert cpu1 - cpu0 >= 40e6  # 50 ms spun, ns
        assert runq1 >= runq0 >= 0
        st = stat_at(fds[1])
        minflt, cpu = st.minflt, st.last_cpu
        assert cpu in os.sched_getaffinity(0) and minflt > 0
        with open(f"{base}/status") as f:
            want = int(next(l for l in f if l.startswith("nonvoluntary_ctxt_switches")).split()[1])
        assert nonvoluntary_switches_at(fds[2]) >= want
    finally:
        for fd in fds:
            os.close(fd)


def test_stat_parser_survives_a_thread_name_with_parens_and_spaces(tmp_path):
    # comm may hold ") (" and spaces; fields are counted after the last ')'.
    fields = ["S"] + [str(i) for i in range(4, 53)]
    fields[10 - 3] = "777"  # field 10: minflt
    fields[39 - 3] = "5"  # field 39: processor
    p = tmp_path / "stat"
    p.write_text(f"123 (evil) (name x) {' '.join(fields)}\n")
    fd = _fd(p)
    try:
        st = stat_at(fd)
        assert (st.name, st.state, st.minflt, st.last_cpu) == ("evil) (name x", "S", 777, 5)
    finally:
        os.close(fd)


def test_thread_cpu_clock_reads_another_thread_of_this_process():
    started, stop = threading.Event(), threading.Event()
    box = {}

    def busy():
        box["tid"] = threading.get_native_id()
        started.set()
        while not stop.is_set():
            pass

    t = threading.Thread(target=busy)
    t.start()
    started.wait()
    try:
        clock = thread_cpu_clock(box["tid"])
        a = time.clock_gettime_ns(clock)
        time.sleep(0.1)
        b = time.clock_gettime_ns(clock)
        assert b - a > 10e6  # it ran (with the GIL shared, at least a tenth of the time)
    finally:
        stop.set()
        t.join()


def test_probe_of_a_thread_that_exits_says_thread_gone():
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("tid", threading.get_native_id()))
    t.start()
    t.join()
    assert wait_thread_gone(box["tid"])
    with pytest.raises(ThreadGone):
        probe = ThreadProbe(os.getpid(), box["tid"], lambda *_: None)
        probe.schedstat()

    alive, stop = threading.Event(), threading.Event()

    def wait():
        box["tid2"] = threading.get_native_id()
        alive.set()
        stop.wait()

    t2 = threading.Thread(target=wait)
    t2.start()
    alive.wait()
    probe = ThreadProbe(os.getpid(), box["tid2"], lambda *_: None)
    assert probe.counters().cpu_ns is not None
    stop.set()
    t2.join()
    assert wait_thread_gone(box["tid2"])
    with pytest.raises(ThreadGone):
        probe.counters()
    probe.close()


def test_a_thread_reading_its_own_counters_gets_its_files_figures_for_fewer_reads():
    """The monitor thread reads itself at each span: getrusage(RUSAGE_THREAD) and sched_getcpu
    give the task fields its stat and status files print, with one system call for two."""
    box, ready, done = {}, threading.Event(), threading.Event()

    def body():
        probe = ThreadProbe(os.getpid(), threading.get_native_id(), lambda *_: None)
        read, files = probe._read, []
        probe._read = lambda name, reader: (files.append(name), read(name, reader))[1]
        box["probe"], box["own_files"] = probe, files
        box["before"] = probe.counters()
        buf = bytearray(2048 * 4096)
        for i in range(0, len(buf), 4096):  # a minor fault per page first touched
            buf[i] = 1
        box["after"] = probe.counters()
        ready.set()
        done.wait(30)

    t = threading.Thread(target=body)
    t.start()
    try:
        assert ready.wait(30)
        probe = box["probe"]
        own_files = list(box["own_files"])
        from_outside = probe.counters()  # this thread is not that one: its stat and status files
    finally:
        done.set()
        t.join()
    before, after = box["before"], box["after"]
    assert own_files == ["schedstat", "schedstat"]  # stat and status not read by the thread itself
    assert box["own_files"][2:] == ["schedstat", "stat", "status"]
    assert after.minflt - before.minflt >= 1024
    assert after.minflt <= from_outside.minflt <= after.minflt + 100  # the same counter, read later
    assert after.nivcsw <= from_outside.nivcsw
    assert {after.cpu, from_outside.cpu} <= os.sched_getaffinity(0)
    probe.close()


def test_main_thread_probe_per_step_and_per_span():
    probe = MainThreadProbe(lambda *_: None)
    fd = _fd(f"/proc/self/task/{os.getpid()}/schedstat")
    time.sleep(0.01)  # switched out: schedstat's on-CPU field is up to date now
    read0 = probe.step_read()
    kernel0, _ = schedstat_at(fd)
    _spin(0.03)
    time.sleep(0.01)
    read1 = probe.step_read()
    kernel1, _ = schedstat_at(fd)
    os.close(fd)
    # On the main thread the schedstat line is only read; it is parsed later (monitor thread).
    assert read1.runq_ns is None and read1.schedstat.count(b" ") == 2
    for read in (read0, read1):
        read.parse(lambda *_: pytest.fail("a real schedstat line did not parse"))
    assert read1.schedstat is None and read1.runq_ns is not None
    # The per-step on-CPU figure is the kernel's own accounting (to within a tick of noise).
    assert read1.cpu_ns - read0.cpu_ns > 1e6
    assert abs((read1.cpu_ns - read0.cpu_ns) - (kernel1 - kernel0)) < 2e6
    assert read1.runq_ns >= read0.runq_ns
    minflt, nivcsw, core = probe.span_read()
    assert minflt > 0 and nivcsw >= 0 and core in os.sched_getaffinity(0)
    probe.close()


def test_cpufreq_kept_fd_and_missing_file_warned_once(tmp_path, caplog):
    d = tmp_path / "sys/devices/system/cpu/cpu3/cpufreq"
    d.mkdir(parents=True)
    (d / "scaling_cur_freq").write_text("2400000\n")
    failures = []
    freq = CoreFreq(lambda what, e: failures.append(what), root=str(tmp_path))
    assert freq.mhz(3) == 2400.0
    (d / "scaling_cur_freq").write_text("3100000\n")  # same fd, re-read from offset 0
    assert freq.mhz(3) == 3100.0
    assert freq.mhz(0) is None and freq.mhz(0) is None and freq.mhz(None) is None
    assert failures == ["cpufreq"]  # opened once, failure said once
    freq.close()

    warn = WarnOnce()
    warn("k", "first")
    warn("k", "again")
    assert [r.getMessage() for r in caplog.records].count("placement: first") == 1
    assert "again" not in caplog.text


def test_a_schedstat_line_not_understood_is_told_once_and_leaves_runq_unknown():
    told = []
    read = MainRead(5, None, b"not numbers\n")
    read.parse(lambda what, e: told.append((what, type(e).__name__)))
    read.parse(lambda what, e: told.append((what, type(e).__name__)))  # parsed once: nothing more
    assert read.runq_ns is None and read.cpu_ns == 5 and told == [("schedstat", "ValueError")]
