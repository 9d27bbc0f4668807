"""Discovery of the live system (root "/"): facts read back from /proc and /sys, the affinity
mask in `allowed`, and the membind probe run in a throwaway thread so the caller is untouched."""
from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path

import pytest

from placement.cpuset import parse_cpulist
from placement.topology import discover
from placement.topology.kernel import membind_allowed
from sysfs_builder import make_tree

# Syscall numbers from the kernel's tables (arch/x86/entry/syscalls, include/uapi/asm-generic/unistd.h).
_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}
_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}


def test_live_discovery_matches_proc_and_sys():
    topo = discover()
    assert topo.root == "/"
    online = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
    assert {c.id for c in topo.cpus if c.online} == online
    assert topo.usable() <= frozenset(os.sched_getaffinity(0))
    assert topo.usable() <= online
    nb = Path("/proc/sys/kernel/numa_balancing")
    if nb.exists():
        assert topo.kernel.numa_balancing == int(nb.read_text())
    assert sorted(c for n in topo.numa_nodes for c in n.cpus) == sorted(online)
    assert isinstance(topo.kernel.membind_allowed, bool) or platform.machine() not in _SET_MEMPOLICY


def test_live_allowed_follows_the_affinity_mask():
    before = os.sched_getaffinity(0)
    one = {min(before)}
    try:
        os.sched_setaffinity(0, one)
        topo = discover()
    finally:
        os.sched_setaffinity(0, before)
    assert topo.usable() == frozenset(one)
    assert os.sched_getaffinity(0) == before


def test_non_live_root_never_probes(tmp_path):
    assert discover(make_tree(tmp_path, "small_cpu")).kernel.membind_allowed is None


def _mempolicy_mode() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    mode = ctypes.c_int(-1)
    assert libc.syscall(_GET_MEMPOLICY[platform.machine()], ctypes.byref(mode), None, ctypes.c_ulong(0),
                        None, ctypes.c_ulong(0)) == 0
    return mode.value


@pytest.mark.skipif(platform.machine() not in _GET_MEMPOLICY, reason="syscall numbers known for x86_64/aarch64")
def test_membind_probe_leaves_the_caller_untouched():
    before = _mempolicy_mode()
    assert membind_allowed() in (True, False)
    assert _mempolicy_mode() == before


def _deny_set_mempolicy() -> bool:
    """Install a seccomp filter in this (child) process that fails set_mempolicy with EPERM, as a
    container's default seccomp profile does without CAP_SYS_NICE."""
    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    nr = _SET_MEMPOLICY[platform.machine()]
    program = (SockFilter * 4)(SockFilter(0x20, 0, 0, 0),  # load the syscall number
                               SockFilter(0x15, 0, 1, nr),  # == set_mempolicy ?
                               SockFilter(0x06, 0, 0, 0x00050000 | 1),  # return ERRNO(EPERM)
                               SockFilter(0x06, 0, 0, 0x7FFF0000))  # allow
    libc = ctypes.CDLL(None, use_errno=True)
    prog = SockFprog(4, program)
    return libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0  # NO_NEW_PRIVS, SECCOMP


@pytest.mark.skipif(platform.machine() not in _SET_MEMPOLICY, reason="no set_mempolicy number for this arch")
def test_membind_probe_reports_a_refusing_container():
    if membind_allowed() is not True:
        pytest.skip("membind is not permitted here to begin with")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            verdict = b"s" if not _deny_set_mempolicy() else (b"r" if membind_allowed() is False else b"a")
            os.write(write, verdict)
        finally:
            os._exit(0)
    os.close(write)
    verdict = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    if verdict == b"s":
        pytest.skip("seccomp filters are not available here")
    assert verdict == b"r"
