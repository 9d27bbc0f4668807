"""CPU affinity of one thread or of the whole process, set by syscall and read back from /proc.

`os.sched_setaffinity` takes a thread id on Linux, so every thread of this process and
of its DataLoader worker processes can be placed on its own. What the kernel applied
is read back from /proc/<pid>/task/<tid>/status (Cpus_allowed_list, through placement._procfs):
a cgroup cpuset may narrow a request silently, and that must show up as a mismatch, not be assumed away.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any, Optional

from placement import _procfs
from placement.cpuset import format_cpulist
from placement.roles import ThreadRole


@dataclass(frozen=True)
class BindResult:
    """One binding: what was planned for a thread and what the kernel reports it got."""

    pid: int
    tid: int
    name: str
    role: Optional[ThreadRole]  # None for the stage-1 process mask (every thread at once)
    planned: frozenset[int]
    applied: frozenset[int]  # Cpus_allowed_list read back; empty when the call failed
    ok: bool  # the call succeeded and the read-back equals the plan
    error: Optional[str] = None  # one line naming the thread, the mask and the reason

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "tid": self.tid, "name": self.name,
                "role": None if self.role is None else self.role.value,
                "planned": sorted(self.planned), "applied": sorted(self.applied),
                "ok": self.ok, "error": self.error}


def read_allowed(pid: int, tid: int) -> frozenset[int]:
    """Cpus_allowed_list of one thread, read back from /proc (raises _procfs.ThreadGone)."""
    return _procfs.cpus_allowed(pid, tid)


def read_last_cpu(pid: int, tid: int) -> int:
    """The CPU the thread last ran on (stat field 39; raises _procfs.ThreadGone)."""
    return _procfs.stat(pid, tid).last_cpu


def bind_thread(pid: int, tid: int, name: str, role: Optional[ThreadRole],
                cpus: frozenset[int]) -> Optional[BindResult]:
    """Set one thread's affinity to `cpus` and read it back. None when the thread exited (ESRCH)."""
    try:
        os.sched_setaffinity(tid, cpus)
    except ProcessLookupError:
        return None
    except OSError as e:
        code = errno.errorcode.get(e.errno or 0, str(e.errno))
        return BindResult(pid, tid, name, role, cpus, _allowed_or_empty(pid, tid), False,
                          f"cannot bind thread {tid} ({name!r}, role {role or 'process'}) "
                          f"to cpus {format_cpulist(cpus)}: {code} {e.strerror}")
    try:
        applied = read_allowed(pid, tid)
    except _procfs.ThreadGone:
        return None
    if applied != cpus:
        return BindResult(pid, tid, name, role, cpus, applied, False,
                          f"thread {tid} ({name!r}, role {role or 'process'}) asked for cpus "
                          f"{format_cpulist(cpus)} but runs on {format_cpulist(applied)} "
                          "(the kernel narrowed it: CPUs offline or outside the cgroup cpuset)")
    return BindResult(pid, tid, name, role, cpus, applied, True)


def apply_process_mask(cpus: frozenset[int]) -> BindResult:
    """Stage 1: put every thread of this process on `cpus`; threads created later inherit it.

    Returns the main thread's result; a failure on any other thread is folded into it.
    """
    pid = os.getpid()
    cpus = frozenset(cpus)
    main = bind_thread(pid, pid, _comm(pid), None, cpus)
    assert main is not None  # the calling process cannot have exited
    errors = [] if main.ok else [main.error]
    for tid in _procfs.task_ids(pid):
        if tid == pid:
            continue
        r = bind_thread(pid, tid, _comm(pid, tid), None, cpus)
        if r is not None and not r.ok:
            errors.append(r.error)
    if errors:
        return BindResult(pid, pid, main.name, None, cpus, main.applied, False, "; ".join(errors))
    return main


def _comm(pid: int, tid: Optional[int] = None) -> str:
    try:
        return _procfs.comm(pid, tid)
    except (_procfs.ThreadGone, OSError):
        return ""


def _allowed_or_empty(pid: int, tid: int) -> frozenset[int]:
    try:
        return read_allowed(pid, tid)
    except (_procfs.ThreadGone, OSError, ValueError):
        return frozenset()
