"""Kernel counters of one thread, read through kept file descriptors with os.pread.

What
    One plain function per fact. Files (fields numbered as in proc(5)):
    - /proc/<pid>/task/<tid>/schedstat: 1 = on-CPU ns, 2 = runqueue wait ns
    - /proc/<pid>/task/<tid>/stat: 10 = minor faults, 39 = CPU it last ran on
    - /proc/<pid>/task/<tid>/status: nonvoluntary_ctxt_switches
    The calling thread's own faults and involuntary switches come cheaper from
    getrusage(RUSAGE_THREAD), and its CPU from sched_getcpu(3) (see MainThreadProbe).

    The files are parsed by placement._procfs (one parser per file, bounded reads). A thread
    that exits makes its reads fail with ESRCH/ENOENT: _procfs.ThreadGone, not an error.

Upstream
    The kernel folds a *running* thread's time into schedstat only at the next tick or switch,
    so a read while it runs is up to a tick (4 ms at HZ=250) stale, more than a whole step's
    worth of error. So on-CPU time of a thread of this process comes from its CPU clock
    (clock_gettime on the thread's clockid), not schedstat field 1: the thread clock is the
    same accounting (sum_exec_runtime) brought up to date. Threads of other processes
    (DataLoader workers) use schedstat field 1, read over spans of many steps.

Cost
    Every read here is a syscall, and the first syscall after a training step is the expensive
    one (caches and TLB are cold; figures: docs/monitor.md, Monitor cost), so the per-step path
    makes as few as it can: benchmarks/monitor_overhead.py prints these costs.
"""
from __future__ import annotations

import ctypes
import os
import resource
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from placement import _procfs
from placement.roles import main_thread, thread_cpu_clock

GONE_ERRNOS = _procfs.GONE_ERRNOS
ThreadGone = _procfs.ThreadGone  # the thread (or its process) exited; its probe is to be dropped


def _sched_getcpu() -> Optional[Callable[[], int]]:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return fn


current_cpu = _sched_getcpu()  # the CPU the calling thread runs on now, or None without libc support
_get_ident = threading.get_ident  # pthread_self: which thread calls (bound once: it is on the per-step path)


@dataclass
class ThreadCounters:
    """Cumulative counters of one thread at one instant; a figure not read is None."""

    cpu_ns: Optional[int] = None
    runq_ns: Optional[int] = None
    minflt: Optional[int] = None
    nivcsw: Optional[int] = None
    cpu: Optional[int] = None


@dataclass(slots=True)
class MainRead:
    """The main thread's counters at one probe step. Read on the training thread right after a
    step, when every code path is cold, so it only reads: its schedstat line stays raw there
    (`schedstat`) and parse() turns it into runq_ns on the monitor thread."""

    cpu_ns: Optional[int]  # on-CPU ns (its thread clock)
    runq_ns: Optional[int] = None  # runqueue wait ns (schedstat field 2), once parsed
    schedstat: Optional[bytes] = None  # the schedstat line as read, until parse()

    def parse(self, fail: Callable[[str, BaseException], None]) -> None:
        """Fill runq_ns from the raw line (idempotent); `fail` hears of a line not understood."""
        raw, self.schedstat = self.schedstat, None
        if raw is not None:
            try:
                self.runq_ns = _procfs.parse_schedstat(raw).runq_ns
            except (ValueError, IndexError) as e:
                fail("schedstat", e)


class ThreadProbe:
    """Kept fds on one thread's schedstat, stat and status files.

    `fail(kind, exc)` is told about a read that failed for another reason than the thread
    leaving (a file unreadable, a format not understood); the figure is then None.
    """

    def __init__(self, pid: int, tid: int, fail: Callable[[str, BaseException], None], proc: str = "/proc"):
        self.pid = pid
        self.tid = tid
        self._fail = fail
        self._clock = thread_cpu_clock(tid) if pid == os.getpid() and proc == "/proc" else None
        base = f"{proc}/{'self' if pid == os.getpid() else pid}/task/{tid}"
        self._fds: dict[str, int] = {}
        for name in ("schedstat", "stat", "status"):
            try:
                self._fds[name] = os.open(f"{base}/{name}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                if e.errno in GONE_ERRNOS:
                    self.close()
                    raise ThreadGone(tid) from None
                fail(name, e)

    def _read(self, name: str, reader):
        fd = self._fds.get(name)
        if fd is None:
            return None
        try:
            return reader(fd)
        except ThreadGone:
            raise ThreadGone(self.tid) from None
        except (OSError, ValueError, IndexError) as e:
            self._fail(name, e)
        return None

    def schedstat(self) -> tuple[Optional[int], Optional[int]]:
        """(on-CPU ns, runqueue wait ns); on-CPU from the thread clock when it has one."""
        got = self._read("schedstat", _procfs.schedstat_at)
        cpu_ns, runq_ns = got if got is not None else (None, None)
        if self._clock is not None:
            try:
                cpu_ns = time.clock_gettime_ns(self._clock)
            except OSError:  # EINVAL: the thread is gone
                raise ThreadGone(self.tid) from None
        return cpu_ns, runq_ns

    def counters(self, schedstat: bool = True) -> ThreadCounters:
        """Every counter, schedstat's left None when not asked for (raises ThreadGone). The
        calling thread's own (the monitor thread reads itself at each span) from getrusage and
        sched_getcpu: the same task fields as its stat and status files, one system call for two."""
        cpu_ns, runq_ns = self.schedstat() if schedstat else (None, None)
        if self._clock is not None and self.tid == threading.get_native_id():
            ru = resource.getrusage(resource.RUSAGE_THREAD)
            return ThreadCounters(cpu_ns, runq_ns, ru.ru_minflt, ru.ru_nivcsw,
                                  current_cpu() if current_cpu is not None else None)
        stat = self._read("stat", _procfs.stat_at)
        minflt, cpu = (stat.minflt, stat.last_cpu) if stat is not None else (None, None)
        return ThreadCounters(cpu_ns, runq_ns, minflt, self._read("status", _procfs.nonvoluntary_switches_at), cpu)

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()


class MainThreadProbe:
    """The rank's main thread (placement.roles.main_thread: the process's, or the thread a Ray
    Train worker runs its loop on).

    Every step: on-CPU ns (its thread clock) and runqueue ns (schedstat): two syscalls, the
    least the per-step figures need. Whether the caller is the main thread is told by
    threading.get_ident (pthread_self, no syscall). Every span: faults and involuntary
    switches (getrusage(RUSAGE_THREAD) on that thread) and the CPU it is on (sched_getcpu);
    from another thread, all of these from its /proc files.
    """

    def __init__(self, fail: Callable[[str, BaseException], None], proc: str = "/proc"):
        main = main_thread()
        self.tid = main.tid
        self._files = ThreadProbe(os.getpid(), self.tid, fail, proc)
        self._fail = fail
        # The main thread's pthread id when probing the live /proc (else never matched).
        self._ident = main.ident if proc == "/proc" else -1
        self._schedstat_fd = self._files._fds.get("schedstat")
        self._clock = self._files._clock  # main's CPU clock (None when probing another /proc)

    def step_read(self) -> MainRead:
        """On-CPU and runqueue ns: two syscalls, and no parsing (the line is parsed by
        MainRead.parse at the hand-over): on the main thread right after a step, and on the
        monitor thread woken for one reading, every code path is cold, and each frame and
        parse costs microseconds (benchmarks/monitor_thread.py)."""
        fd = self._schedstat_fd
        if _get_ident() == self._ident:
            raw = None
            if fd is not None:
                try:  # the main thread reading its own file: it cannot be gone
                    raw = os.pread(fd, _procfs.SCHEDSTAT_MAX, 0)
                except OSError as e:
                    self._fail("schedstat", e)
            return MainRead(time.thread_time_ns(), None, raw)
        clock = self._clock
        if fd is not None and clock is not None:
            try:  # from the monitor thread: schedstat, then main's thread clock
                raw = os.pread(fd, _procfs.SCHEDSTAT_MAX, 0)
                return MainRead(time.clock_gettime_ns(clock), None, raw)
            except OSError:
                pass  # gone (ESRCH, EINVAL) or unreadable: the careful path below tells which
        try:
            cpu_ns, runq_ns = self._files.schedstat()
        except ThreadGone:  # the main thread exited while others run on
            cpu_ns = runq_ns = None
        return MainRead(cpu_ns, runq_ns)

    def span_read(self) -> tuple[Optional[int], Optional[int], Optional[int]]:
        """(minor faults, involuntary context switches, CPU it is on now)."""
        if threading.get_ident() == self._ident:
            ru = resource.getrusage(resource.RUSAGE_THREAD)
            return ru.ru_minflt, ru.ru_nivcsw, current_cpu() if current_cpu is not None else None
        c = self._files.counters(schedstat=False)
        return c.minflt, c.nivcsw, c.cpu

    def close(self) -> None:
        self._schedstat_fd = None  # never a pread on a number the kernel may give to another file
        self._files.close()
