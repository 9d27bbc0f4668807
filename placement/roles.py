"""Thread roles and how a live thread or process is recognised as one.

Names are the ones PyTorch and NCCL give their threads (comm names, 15 chars max):
`pt_data_pin` (pin-memory thread), `pt_data_worker` (DataLoader worker processes),
`pt_autograd_<n>` (autograd device threads), `NCCL <what> <n>` once
NCCL_SET_THREAD_NAME=1 (e.g. "NCCL Progress 0", "NCCL Service 0").
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from enum import Enum

from placement import _procfs


class ThreadRole(str, Enum):
    MAIN = "main"
    NCCL = "nccl"
    PIN_MEMORY = "pin_memory"
    DATALOADER = "dataloader"
    OTHER = "other"

    def __str__(self) -> str:  # prints as its value in tables and JSON keys
        return self.value


HOT_ROLES = (ThreadRole.MAIN, ThreadRole.NCCL, ThreadRole.PIN_MEMORY)


def role_of(name: str, *, is_main_thread: bool = False, in_worker_process: bool = False) -> ThreadRole:
    """The role of a thread from its comm name and where it lives."""
    if in_worker_process or name.startswith("pt_data_worker"):
        return ThreadRole.DATALOADER
    if is_main_thread:
        return ThreadRole.MAIN
    if name.startswith("NCCL"):
        return ThreadRole.NCCL
    if name.startswith("pt_data_pin"):
        return ThreadRole.PIN_MEMORY
    return ThreadRole.OTHER


@dataclass(frozen=True)
class ThreadInfo:
    pid: int  # the process holding the thread
    tid: int
    name: str
    role: ThreadRole


def _comm(pid: int, tid: int | None, proc: str) -> str | None:
    try:
        return _procfs.comm(pid, tid, proc)
    except (_procfs.ThreadGone, OSError):  # thread or process gone, or not ours to read
        return None


def scan_threads(pid: int | None = None, *, include_children: bool = True, proc: str = "/proc") -> list[ThreadInfo]:
    """Every thread of process `pid` (default: this one) with its role, plus the threads of its
    DataLoader worker child processes (recognised by name `pt_data_worker`), all as DATALOADER.

    Threads that exit during the scan are skipped, never raised.
    """
    pid = os.getpid() if pid is None else pid
    out: list[ThreadInfo] = []
    try:
        tids = _procfs.task_ids(pid, proc)
    except (_procfs.ThreadGone, OSError):
        return out
    for tid in tids:
        name = _comm(pid, tid, proc)
        if name is not None:
            out.append(ThreadInfo(pid, tid, name, role_of(name, is_main_thread=(tid == pid))))
    if include_children:
        try:
            kids = _procfs.children(pid, proc)
        except (_procfs.ThreadGone, OSError, ValueError):
            kids = []
        for child in kids:
            cname = _comm(child, None, proc)
            if cname is None or not cname.startswith("pt_data_worker"):
                continue
            try:
                ctids = _procfs.task_ids(child, proc)
            except (_procfs.ThreadGone, OSError):
                continue
            for tid in ctids:
                name = _comm(child, tid, proc)
                if name is not None:
                    out.append(ThreadInfo(child, tid, name, ThreadRole.DATALOADER))
    return out


def name_this_thread(name: bytes) -> None:
    """Set the kernel name (comm) of the calling thread, so it reads well in /proc and top -H."""
    try:
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
