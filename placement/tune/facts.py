"""Host facts the rules ask for, read live from /proc and /sys (read-only).

Rules see these only through the HostFacts protocol, so unit tests hand them a fixed
set of facts instead. Every reader returns None or empty on a file it cannot read.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Protocol

from placement.cpuset import parse_cpulist

# get_mempolicy(2) modes, flags masked off.
MEMPOLICY_MODES = {0: "default", 1: "preferred", 2: "bind", 3: "interleave", 4: "local",
                   5: "preferred_many", 6: "weighted_interleave"}
_MPOL_MODE_MASK = 0xFF


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
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def thread_state_and_cpu(stat_text: str) -> tuple[str, int] | None:
    """State letter and last CPU (field 39) from a /proc/<pid>/task/<tid>/stat line."""
    close = stat_text.rfind(")")
    if close < 0:
        return None
    fields = stat_text[close + 2:].split()
    try:
        return fields[0], int(fields[36])
    except (IndexError, ValueError):
        return None


def affinity_of(status_text: str) -> frozenset[int]:
    """Cpus_allowed_list of a /proc status file; empty when absent."""
    for line in status_text.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            try:
                return parse_cpulist(line.split(":", 1)[1])
            except ValueError:
                return frozenset()
    return frozenset()


def running_threads_on(cpus: frozenset[int], exclude_pids: Iterable[int], proc: str = "/proc") -> list[ForeignThread]:
    """Runnable threads of other processes whose last CPU is in `cpus` or whose affinity lies
    within `cpus`. One snapshot; threads that vanish mid-scan are skipped."""
    skip = set(exclude_pids)
    out: list[ForeignThread] = []
    try:
        pids = [int(p) for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        if pid in skip:
            continue
        try:
            tids = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            base = f"{proc}/{pid}/task/{tid}"
            stat = _read(f"{base}/stat")
            parsed = thread_state_and_cpu(stat) if stat else None
            if parsed is None or parsed[0] != "R":
                continue
            status = _read(f"{base}/status") or ""
            affinity = affinity_of(status)
            if parsed[1] in cpus or (affinity and affinity <= cpus):
                name = stat[stat.find("(") + 1: stat.rfind(")")]
                out.append(ForeignThread(pid, int(tid), name, parsed[1], affinity))
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


def _load_libnuma() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL("libnuma.so.1", use_errno=True)
    except OSError:
        return None


def memory_policy() -> Optional[str]:
    """The calling thread's memory policy mode from get_mempolicy(2) (via libnuma's wrapper)."""
    lib = _load_libnuma()
    if lib is None:
        return None
    mode = ctypes.c_int(0)
    if lib.get_mempolicy(ctypes.byref(mode), None, ctypes.c_ulong(0), None, ctypes.c_ulong(0)) != 0:
        return None
    return MEMPOLICY_MODES.get(mode.value & _MPOL_MODE_MASK, str(mode.value))


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
