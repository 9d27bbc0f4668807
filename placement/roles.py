"""Thread roles and how a live thread or process is recognised as one.

Names are the ones PyTorch and NCCL give their threads (comm names, 15 chars max):
`pt_data_pin` (pin-memory thread), `pt_data_worker` (DataLoader worker processes),
`pt_autograd_<device>` (torch/csrc/autograd/engine.cpp, Engine::thread_init: one thread per
non-CPU device, started by start_device_threads; on GPU it runs all CUDA backward work while
the main thread waits in backward(), so it is hot), and NCCL's threads, named only when
NCCL_SET_THREAD_NAME=1 (src/debug.cc ncclSetThreadName, NCCL_PARAM(SetThreadName, ..., 0):
read once and cached; vsnprintf into NCCL_THREAD_NAMELEN=16, so "NCCL UDS Service  0" is
cut to "NCCL UDS Servic"). Where NCCL (v2.28.9-1) names them:
  hot (they move the data):
    "NCCL Service %2d", "NCCL UDS Service %2d"  src/proxy.cc:1879/1884 ncclProxyCreate, from
                                                 initTransportsRank (src/init.cc:1259)
    "NCCL Progress%2d"   src/proxy.cc:1014 ncclProxyProgressCreate, on the service thread at the
                         first proxy connection (lazy: NCCL_RUNTIME_CONNECT=1, src/init.cc:57)
    "NCCL GIN Progress%2d" src/gin/gin_host.cc:151; "NCCL RMA Proxy Progress%2d" (2.30
                         src/rma/rma_proxy.cc:455); "NCCL Sock%c%1u%2u%2u" socket helper
                         threads (src/transport/net_socket.cc:512)
  background (`other`):
    "NCCL RAS" (2.24+, src/ras/ras.cc:107, from bootstrapInit), "NCCL BootstrapR"
    (src/bootstrap.cc:404), "NCCL IbAsync %2d" (src/transport/net_ib.cc:806), any other "NCCL ...".
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass
from enum import Enum

from placement import _procfs


class ThreadRole(str, Enum):
    MAIN = "main"
    BACKWARD = "backward"
    NCCL = "nccl"
    PIN_MEMORY = "pin_memory"
    DATALOADER = "dataloader"
    OTHER = "other"

    def __str__(self) -> str:  # prints as its value in tables and JSON keys
        return self.value


HOT_ROLES = (ThreadRole.MAIN, ThreadRole.BACKWARD, ThreadRole.NCCL, ThreadRole.PIN_MEMORY)

# Prefixes of NCCL's hot thread names as the kernel keeps them (15 characters): proxy service
# (and its UDS twin), proxy progress, GIN and RMA progress, socket transport helpers.
NCCL_HOT_PREFIXES = ("NCCL Service", "NCCL UDS Servic", "NCCL Progress", "NCCL GIN Progre",
                     "NCCL RMA Proxy", "NCCL Sock")
AUTOGRAD_PREFIX = "pt_autograd_"


def is_nccl_thread(name: str) -> bool:
    """Any thread NCCL named (hot or background)."""
    return name.startswith("NCCL ")


def role_of(name: str, *, is_main_thread: bool = False, in_worker_process: bool = False) -> ThreadRole:
    """The role of a thread from its comm name and where it lives."""
    if in_worker_process or name.startswith("pt_data_worker"):
        return ThreadRole.DATALOADER
    if is_main_thread:
        return ThreadRole.MAIN
    if name.startswith(NCCL_HOT_PREFIXES):
        return ThreadRole.NCCL
    if name.startswith(AUTOGRAD_PREFIX):
        return ThreadRole.BACKWARD
    if name.startswith("pt_data_pin"):
        return ThreadRole.PIN_MEMORY
    return ThreadRole.OTHER


@dataclass(frozen=True)
class MainThread:
    """The rank's main thread: the one that runs its training loop and ends its steps. The
    process's main thread unless set: Ray Train runs the loop on a thread of its own
    (ray/train/v2/_internal/execution/worker_group/thread_runner.py, "TrainingThread(...)"),
    found at the first optimizer step (placement/integrations/ray.py)."""
    ident: int  # threading.get_ident() of it (pthread_self)
    tid: int  # its kernel thread id (/proc/<pid>/task/<tid>)


_main: "MainThread | None" = None  # None: the process's main thread


def main_thread() -> MainThread:
    if _main is not None:
        return _main
    t = threading.main_thread()
    return MainThread(t.ident or 0, os.getpid())


def set_main_thread(ident: int, tid: int) -> None:
    """The calling program's training loop runs on this thread (not the process's main thread)."""
    global _main
    _main = MainThread(ident, tid)


def _forget_main_thread() -> None:
    global _main
    _main = None  # a forked child has one thread, its main


os.register_at_fork(after_in_child=_forget_main_thread)


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
    main_tid = main_thread().tid if pid == os.getpid() else pid
    out: list[ThreadInfo] = []
    try:
        tids = _procfs.task_ids(pid, proc)
    except (_procfs.ThreadGone, OSError):
        return out
    for tid in tids:
        name = _comm(pid, tid, proc)
        if name is not None:
            out.append(ThreadInfo(pid, tid, name, role_of(name, is_main_thread=(tid == main_tid))))
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


def thread_cpu_clock(tid: int) -> int:
    """The clockid of thread `tid`'s CPU clock (MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED));
    valid for threads of the calling process only."""
    return ((~tid) << 3) | 6


class OwnThreads:
    """placement's own threads in this process (the monitor's, the binder's watcher, rank 0's
    peer watch, the exchange's posts, the flight recorder's dumps, the log's compression), and
    the CPU they have spent: with the step hook's time, what placement's presence costs the
    rank (the `monitor` and `end` events' placement_cpu_us_per_step, the budget's figure).

    Each is started here, named in the kernel (comm, so /proc and top -H show it), and read by
    its own CPU clock (clock_gettime on MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED): one system
    call, no file, no GIL-held parsing); a thread that ends adds its CPU to the total as it ends
    (its clock dies with it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # native tid -> its CPU clock id
        self._ended_ns = 0  # the CPU of the threads that ended
        os.register_at_fork(after_in_child=self._forget)  # a forked child has none of them

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._live = {}
        self._ended_ns = 0

    def start(self, target, name: str, args: tuple = ()) -> threading.Thread:
        """Start `target(*args)` on a daemon thread of ours named `name` (at most 15 bytes)."""
        thread = threading.Thread(target=self._run, args=(target, name, args), name=name, daemon=True)
        thread.start()
        return thread

    def _run(self, target, name: str, args: tuple) -> None:
        name_this_thread(name.encode())
        tid = threading.get_native_id()
        with self._lock:
            self._live[tid] = thread_cpu_clock(tid)
        try:
            target(*args)
        finally:
            spent = time.thread_time_ns()
            with self._lock:
                self._live.pop(tid, None)
                self._ended_ns += spent

    def cpu_ns(self) -> int:
        """The CPU all of them have spent so far (the ones that ended included)."""
        with self._lock:  # a thread ending meanwhile waits: counted once, live or ended
            total = self._ended_ns
            for clock in self._live.values():
                try:
                    total += time.clock_gettime_ns(clock)
                except OSError:  # ending: its CPU is in _ended_ns as soon as it has the lock
                    pass
            return total

    def names(self) -> list[str]:
        """The kernel names of the live ones."""
        with self._lock:
            tids = list(self._live)
        return [n for n in (_comm(os.getpid(), t, "/proc") for t in tids) if n]


OWN_THREADS = OwnThreads()  # the process's one ledger
