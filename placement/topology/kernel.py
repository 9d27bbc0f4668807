"""Kernel facts that change how placement behaves: automatic NUMA balancing, the cpufreq
governor, turbo/boost, and (live system only) whether set_mempolicy(MPOL_BIND) is permitted.
"""
from __future__ import annotations

from typing import Optional

from placement import _procfs
from placement.topology._sysfs import SysfsReader
from placement.topology.cpus import CPU_DIR
from placement.topology.model import KernelFacts


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


def membind_allowed() -> Optional[bool]:
    """Whether this process may set_mempolicy(MPOL_BIND) to its allowed nodes, tried in a throwaway
    thread (placement._procfs.probe_mempolicy) so the caller's policy never changes; no fork, so it
    is safe under attach() in a threaded process. None when it cannot be tried here."""
    try:
        nodes = sorted(_procfs.mems_allowed()) or [0]
    except (OSError, ValueError, _procfs.ThreadGone):
        nodes = [0]
    code = _procfs.probe_mempolicy("bind", nodes)
    return None if code is None else code == 0


def kernel_facts(fs: SysfsReader, online: frozenset[int], live: bool) -> KernelFacts:
    return KernelFacts(numa_balancing=numa_balancing(fs), governor=governor(fs, online), turbo=turbo(fs),
                       membind_allowed=membind_allowed() if live else None)
