"""NUMA memory policy of the calling thread: probed, applied through libnuma, verified.

The policy is per thread and inherited by threads and children created later, so stage 1
sets it on the main thread before torch starts any. Containers often refuse MPOL_BIND
(seccomp answers EPERM without CAP_SYS_NICE), and libnuma's setters return void and only
print on error, so the order is:
  probe   the raw set_mempolicy syscall in a throwaway thread (policy dies with it) -> errno;
  apply   through libnuma in the calling thread;
  verify  with the raw get_mempolicy syscall;
(probe and verify are placement._procfs's, the one memory-policy get/set/probe.)
stepping down bind/interleave -> preferred -> none when a step is refused. What was applied
is returned and logged as a `memory` event, never assumed, with where the pages already
resident are (residence.py: a move_pages sample; pages touched before the policy was set stay
where they were, and the event says so).
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
from dataclasses import dataclass
from typing import Any, Optional

from placement import _procfs
from placement.events import EventKind
from placement import residence
from placement.plan.model import MemoryPolicy

@dataclass
class AppliedMemory:
    planned: MemoryPolicy
    applied: MemoryPolicy  # as read back with get_mempolicy ("none" = the kernel's default policy)
    verified: bool  # applied was read back, not assumed
    fallback: Optional[str] = None  # why applied differs from planned; None when it matches
    resident: Optional[residence.Residence] = None  # where the process's pages are, sampled after applying
    resident_null: Optional[str] = None  # why `resident` could not be read

    def to_dict(self) -> dict[str, Any]:
        return {"planned": {"mode": self.planned.mode, "nodes": list(self.planned.nodes)},
                "applied": {"mode": self.applied.mode, "nodes": list(self.applied.nodes)},
                "verified": self.verified, "fallback": self.fallback,
                "resident": None if self.resident is None else self.resident.to_dict(),
                **({"resident_null": self.resident_null} if self.resident_null else {})}


def with_residence(outcome: AppliedMemory, query: Optional[residence.Query] = None) -> AppliedMemory:
    """The outcome with the process's residence on the planned nodes sampled now."""
    planned = residence.planned_nodes(outcome.planned.mode, outcome.planned.nodes)
    outcome.resident, outcome.resident_null = residence.safe(lambda: residence.sample_process(planned, query=query))
    return outcome


def read_mempolicy() -> Optional[MemoryPolicy]:
    """The calling thread's policy from the get_mempolicy syscall; None where it cannot be read."""
    got = _procfs.get_mempolicy()
    return None if got is None else MemoryPolicy(got.mode, list(got.nodes))


def apply_memory_policy(policy: MemoryPolicy, events=None) -> AppliedMemory:
    """Set the calling thread's memory policy, stepping down on refusal; log and return what holds."""
    outcome = with_residence(_apply(policy))
    if events is not None:
        events.event(EventKind.MEMORY, **outcome.to_dict())
        if outcome.fallback:
            events.event(EventKind.WARNING, message=f"memory policy: {outcome.fallback}")
    return outcome


def _apply(policy: MemoryPolicy) -> AppliedMemory:
    planned = MemoryPolicy(policy.mode, list(policy.nodes))
    if planned.mode == "none" or not planned.nodes:
        return _verified(planned, MemoryPolicy("none"), None)
    libnuma, why = _load_libnuma()
    if libnuma is None:
        return _verified(planned, MemoryPolicy("none"), f"{planned.mode} {planned.nodes} not applied: {why}")
    reasons: list[str] = []
    for step in _steps(planned):
        code = _procfs.probe_mempolicy(step.mode, step.nodes)
        if code:  # None: cannot be probed here; the libnuma call and its verification decide
            reasons.append(f"{step.mode} {step.nodes} refused: {errno.errorcode.get(code, code)} "
                           f"{os.strerror(code)}")
            continue
        _set_with_libnuma(libnuma, step)
        got = read_mempolicy()
        if got is None or (got.mode == step.mode and got.nodes == step.nodes):
            fallback = "; ".join(reasons) or None
            if step.mode != planned.mode or step.nodes != planned.nodes:
                fallback = (fallback + "; " if fallback else "") + f"applied {step.mode} {step.nodes} instead"
            applied = step if got is None else got
            return AppliedMemory(planned, applied, got is not None, fallback)
        reasons.append(f"{step.mode} {step.nodes} set through libnuma but the kernel reports "
                       f"{got.mode} {got.nodes}")
    return _verified(planned, MemoryPolicy("none"), "; ".join(reasons) + "; the policy was left as it was")


def _steps(planned: MemoryPolicy) -> list[MemoryPolicy]:
    """The step-down ladder: the plan, then preferred on its first node (libnuma prefers one node)."""
    steps = [planned] if planned.mode != "preferred" else []
    steps.append(MemoryPolicy("preferred", planned.nodes[:1]))
    return steps


def _verified(planned: MemoryPolicy, expected: MemoryPolicy, fallback: Optional[str]) -> AppliedMemory:
    got = read_mempolicy()
    return AppliedMemory(planned, got if got is not None else expected, got is not None, fallback)


def _set_with_libnuma(libnuma, step: MemoryPolicy) -> None:
    lib = libnuma.LIBNUMA
    if step.mode == "preferred":
        lib.numa_set_preferred(step.nodes[0])
        return
    lib.numa_bitmask_setbit.argtypes = [ctypes.POINTER(libnuma.bitmask_t), ctypes.c_uint]
    lib.numa_bitmask_setbit.restype = ctypes.POINTER(libnuma.bitmask_t)
    lib.numa_bitmask_free.argtypes = [ctypes.POINTER(libnuma.bitmask_t)]
    lib.numa_bitmask_free.restype = None
    mask = lib.numa_allocate_nodemask()
    try:
        for n in step.nodes:
            lib.numa_bitmask_setbit(mask, n)
        if step.mode == "bind":
            lib.numa_set_membind(mask)
        else:
            lib.numa_set_interleave_mask(mask)
    finally:
        lib.numa_bitmask_free(mask)


@functools.lru_cache(maxsize=None)
def _load_libnuma():
    """(module numa, None) or (None, one-line reason); imported once, never raising."""
    try:
        import numa  # py-libnuma: ctypes over libnuma.so
    except ImportError as e:  # the Python half is missing
        return None, (f"the Python package py-libnuma is not installed ({e}); "
                      "pip install py-libnuma (it also needs libnuma1 / numactl-libs)")
    except Exception as e:  # libnuma.so missing makes py-libnuma fail at import
        return None, (f"libnuma.so is not available ({type(e).__name__}: {e}); "
                      "install libnuma1 (Debian/Ubuntu) or numactl-libs (RHEL)")
    if numa.LIBNUMA.numa_available() < 0:
        return None, "the kernel has no NUMA support (numa_available() < 0)"
    return numa, None
