"""Kernel facts that change how placement behaves: automatic NUMA balancing, the cpufreq
governor, turbo/boost, and (live system only) whether set_mempolicy(MPOL_BIND) is permitted.
"""
from __future__ import annotations

import ctypes
import os
import platform
from typing import Optional

from placement.cpuset import parse_cpulist
from placement.topology._sysfs import SysfsReader
from placement.topology.cpus import CPU_DIR
from placement.topology.model import KernelFacts

MPOL_BIND = 2
# set_mempolicy(2) syscall numbers; glibc has no wrapper (libnuma does, but is optional).
_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "arm64": 237, "riscv64": 237, "loongarch64": 237,
                  "ppc64le": 261, "ppc64": 261, "s390x": 270}


def numa_balancing(fs: SysfsReader) -> Optional[int]:
    return fs.integer("proc/sys/kernel/numa_balancing")


def governor(fs: SysfsReader, online: frozenset[int]) -> Optional[str]:
    """The cpufreq governor; several in use are listed sorted, comma-separated."""
    seen = set()
    for cpu in sorted(online):
        if not fs.has(f"{CPU_DIR}/cpu{cpu}", "cpufreq"):
            continue
        g = fs.text(f"{CPU_DIR}/cpu{cpu}/cpufreq/scaling_governor")
        if g:
            seen.add(g)
    return ",".join(sorted(seen)) or None


def turbo(fs: SysfsReader) -> Optional[bool]:
    no_turbo = fs.integer(f"{CPU_DIR}/intel_pstate/no_turbo")
    if no_turbo is not None:
        return no_turbo == 0
    boost = fs.integer(f"{CPU_DIR}/cpufreq/boost")
    return None if boost is None else boost == 1


def _mems_allowed() -> list[int]:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Mems_allowed_list:"):
                return sorted(parse_cpulist(line.split(":", 1)[1]))
    return [0]


def membind_allowed() -> Optional[bool]:
    """Whether this process may set_mempolicy(MPOL_BIND) to its allowed nodes, tried in a forked
    child so the caller's policy never changes. None when it cannot be tried here."""
    nr = _SET_MEMPOLICY.get(platform.machine())
    if nr is None:
        return None
    try:
        nodes = _mems_allowed()
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except OSError:
        return None
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    words = max(nodes) // bits + 1
    mask = (ctypes.c_ulong * words)()
    for n in nodes:
        mask[n // bits] |= 1 << (n % bits)
    try:
        pid = os.fork()
    except OSError:  # out of processes: the fact stays unknown, discovery goes on
        return None
    if pid == 0:  # child: one syscall, then leave without running any Python cleanup
        try:
            rc = syscall(nr, MPOL_BIND, mask, ctypes.c_ulong(words * bits + 1))
            os._exit(0 if rc == 0 else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return {0: True, 1: False}.get(code)


def kernel_facts(fs: SysfsReader, online: frozenset[int], live: bool) -> KernelFacts:
    return KernelFacts(numa_balancing=numa_balancing(fs), governor=governor(fs, online), turbo=turbo(fs),
                       membind_allowed=membind_allowed() if live else None)
