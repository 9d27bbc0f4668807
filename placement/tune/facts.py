"""Host facts the rules ask for, read live from /proc and /sys (read-only).

Rules see these only through the HostFacts protocol, so unit tests hand them a fixed
set of facts instead. Every reader returns None or empty on a file it cannot read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Protocol

from placement import _procfs

_FILE_MAX = 1024 * 1024  # /proc/vmstat and /proc/self/sched are a few KiB


@dataclass(frozen=True)
class ForeignThread:
    """A runnable thread of another process seen on (or pinned to) CPUs we asked about."""

    pid: int
    tid: int
    name: str
    last_cpu: int
    affinity: frozenset[int]

    def pinned_within(self, cpus: frozenset[int]) -> bool:
        return bool(self.affinity) and self.affinity <= cpus


class HostFacts(Protocol):
    def foreign_threads(self, cpus: frozenset[int]) -> list[ForeignThread]: ...
    def cpu_mhz(self, cpu: int) -> Optional[float]: ...
    def numa_balancing(self) -> Optional[int]: ...
    def numa_counters(self) -> dict[str, int]: ...
    def memory_policy(self) -> Optional[str]: ...


def _read(path: str) -> Optional[str]:
    try:
        return _procfs.read_bounded(path, _FILE_MAX).decode(errors="replace")
    except OSError:
        return None


def running_threads_on(cpus: frozenset[int], exclude_pids: Iterable[int], proc: str = "/proc") -> list[ForeignThread]:
    """Runnable threads of other processes whose last CPU is in `cpus` or whose affinity lies
    within `cpus`. One snapshot; threads that vanish mid-scan (or cannot be read) are skipped."""
    skip = set(exclude_pids)
    out: list[ForeignThread] = []
    try:
        pids = _procfs.pids(proc)
    except OSError:
        return out
    for pid in pids:
        if pid in skip:
            continue
        try:
            tids = _procfs.task_ids(pid, proc)
        except (_procfs.ThreadGone, OSError):
            continue
        for tid in tids:
            try:
                st = _procfs.stat(pid, tid, proc)
                if st.state != "R":
                    continue
                affinity = _procfs.cpus_allowed(pid, tid, proc)
            except (_procfs.ThreadGone, OSError, ValueError):
                continue
            if st.last_cpu in cpus or (affinity and affinity <= cpus):
                out.append(ForeignThread(pid, tid, st.name, st.last_cpu, affinity))
    return out


def cpu_mhz(cpu: int, sys: str = "/sys") -> Optional[float]:
    """Current MHz of a CPU from cpufreq's scaling_cur_freq (kHz); None without cpufreq."""
    text = _read(f"{sys}/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq")
    try:
        return int(text) / 1000.0 if text else None
    except ValueError:
        return None


def numa_balancing(proc: str = "/proc") -> Optional[int]:
    """kernel.numa_balancing (0 off, 1 on, 2/3 memory tiering modes); None when absent."""
    text = _read(f"{proc}/sys/kernel/numa_balancing")
    try:
        return int(text) if text else None
    except ValueError:
        return None


def numa_counters(proc: str = "/proc") -> dict[str, int]:
    """Cumulative NUMA-balancing counters: this process's (from /proc/self/sched, prefixed
    "task_") and the system's numa_* lines of /proc/vmstat."""
    out: dict[str, int] = {}
    for line in (_read(f"{proc}/self/sched") or "").splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("numa_pages_migrated", "total_numa_faults"):
            try:
                out["task_" + key] = int(value.strip())
            except ValueError:
                pass
    for line in (_read(f"{proc}/vmstat") or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].startswith("numa_"):
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                pass
    return out


def memory_policy() -> Optional[str]:
    """The calling thread's memory policy mode (placement._procfs.MEMPOLICY_NAMES); None when unknown."""
    got = _procfs.get_mempolicy()
    return None if got is None else got.mode


class WindowFacts:
    """HostFacts for one window: the /proc scan for foreign threads runs at most once, over
    the whole share, and every question about a subset of it is answered from that scan."""

    def __init__(self, facts: HostFacts, share: frozenset[int]):
        self._facts = facts
        self._share = share
        self._foreign: Optional[list[ForeignThread]] = None

    def foreign_threads(self, cpus: frozenset[int]) -> list[ForeignThread]:
        if not cpus <= self._share:
            return self._facts.foreign_threads(cpus)
        if self._foreign is None:
            self._foreign = self._facts.foreign_threads(self._share)
        return [t for t in self._foreign if t.last_cpu in cpus or t.pinned_within(cpus)]

    def cpu_mhz(self, cpu: int) -> Optional[float]:
        return self._facts.cpu_mhz(cpu)

    def numa_balancing(self) -> Optional[int]:
        return self._facts.numa_balancing()

    def numa_counters(self) -> dict[str, int]:
        return self._facts.numa_counters()

    def memory_policy(self) -> Optional[str]:
        return self._facts.memory_policy()


class LiveFacts:
    """HostFacts read from this machine; `own_pids` names the processes that are ours."""

    def __init__(self, own_pids: Callable[[], Iterable[int]], proc: str = "/proc", sys: str = "/sys"):
        self._own_pids = own_pids
        self._proc = proc
        self._sys = sys

    def foreign_threads(self, cpus: frozenset[int]) -> list[ForeignThread]:
        return running_threads_on(cpus, set(self._own_pids()) | {os.getpid()}, self._proc)

    def cpu_mhz(self, cpu: int) -> Optional[float]:
        return cpu_mhz(cpu, self._sys)

    def numa_balancing(self) -> Optional[int]:
        return numa_balancing(self._proc)

    def numa_counters(self) -> dict[str, int]:
        return numa_counters(self._proc)

    def memory_policy(self) -> Optional[str]:
        return memory_policy()
