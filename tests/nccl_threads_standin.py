"""A stand-in for NCCL's host threads, built from the upstream lines it cites (NVIDIA/nccl, tag
v2.28.9-1; the thread names and the affinity dance are the same from v2.21 on, NCCL_PROXY_CPUSET
exists from v2.28, NCCL RAS from v2.24). No GPU exists here: what NCCL does on the CPU side of a
communicator's life is reproduced on real threads, with real names and real affinity syscalls.

- Names: ncclSetThreadName (src/debug.cc:419) calls pthread_setname_np(thread, name) from the
  *creating* thread, right after pthread_create, only when NCCL_SET_THREAD_NAME=1 (NCCL_PARAM
  SetThreadName, src/debug.cc:417, read once and cached), into a 16-byte buffer (vsnprintf, so
  "NCCL UDS Service  0" becomes "NCCL UDS Servic"). Unnamed, a thread keeps its creator's comm.
- A new thread inherits its creator's CPU mask (clone(2)).
- ncclCommInitRank runs bootstrapInit (src/init.cc:1577): the bootstrap receive thread
  "NCCL BootstrapR" (src/bootstrap.cc:404) and, 2.24+, RAS ("NCCL RAS", src/ras/ras.cc:107).
- initTransportsRank (src/init.cc:840): ncclTopoGetCpuAffinity (src/graph/topo.cc:1728) takes the
  caller's mask & the GPU's local CPUs (CPU_AND, topo.cc:1750); if not empty, the caller's mask
  is saved (sched_getaffinity, init.cc:1001) and set to it (init.cc:1002); ncclProxyCreate
  (init.cc:1259) creates "NCCL Service %2d" and "NCCL UDS Service %2d" (src/proxy.cc:1879/1884);
  at the end the saved mask is restored (init.cc:1395).
- The service threads first set their own affinity to NCCL_PROXY_CPUSET when set (ncclProxyService
  src/proxy.cc:1603, ncclProxyServiceUDS proxy.cc:1797; parsed once per process as a comma list,
  src/include/cpuset.h:70).
- The progress thread "NCCL Progress%2d" is created by the service thread at the first proxy
  connection (ncclProxyProgressCreate, src/proxy.cc:1014, called from proxy.cc:1393), lazily by
  default (NCCL_RUNTIME_CONNECT=1, src/init.cc:57): here, at the first collective.
"""
from __future__ import annotations

import ctypes
import os
import queue
import threading
from typing import Callable, Optional

_libc = ctypes.CDLL(None, use_errno=True)
_libc.pthread_setname_np.argtypes = [ctypes.c_ulong, ctypes.c_char_p]
NCCL_THREAD_NAMELEN = 16


class _Env:
    """NCCL's once-read parameters (NCCL_PARAM caches on first use; pthread_once for the cpuset)."""

    def __init__(self, environ):
        self._environ = environ
        self._name: Optional[bool] = None
        self._cpuset: Optional[frozenset[int]] = None

    def set_thread_name(self) -> bool:
        if self._name is None:
            self._name = self._environ.get("NCCL_SET_THREAD_NAME", "0") == "1"
        return self._name

    def proxy_cpuset(self) -> frozenset[int]:
        if self._cpuset is None:
            text = self._environ.get("NCCL_PROXY_CPUSET", "")
            cpus = set()
            for token in filter(None, text.split(",")):  # strtoull per token, as cpuset.h:77
                digits = ""
                for ch in token.strip():
                    if not ch.isdigit():
                        break
                    digits += ch
                cpus.add(int(digits or "0"))
            self._cpuset = frozenset(cpus)
        return self._cpuset


class _NcclThread:
    """pthread_create + ncclSetThreadName, from the calling thread. The thread runs `body` (its
    first lines in NCCL), then serves calls (work NCCL does on that thread later) until closed."""

    def __init__(self, env: _Env, body: Callable[[], None], name: str):
        self.tid: Optional[int] = None
        self._calls: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        started = threading.Event()
        self._t = threading.Thread(target=self._run, args=(body, started), daemon=True)
        self._t.start()  # inherits the creator's mask, like pthread_create
        started.wait()
        if env.set_thread_name():  # ncclSetThreadName, from the creator, right after pthread_create
            _libc.pthread_setname_np(ctypes.c_ulong(self._t.ident), name.encode()[:NCCL_THREAD_NAMELEN - 1])

    def _run(self, body, started):
        self.tid = threading.get_native_id()
        started.set()
        body()
        while True:
            fn = self._calls.get()
            if fn is None:
                return
            fn()

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn on this thread and wait for it."""
        done = threading.Event()
        self._calls.put(lambda: (fn(), done.set()))
        done.wait(10)

    def close(self):
        self._calls.put(None)
        self._t.join(timeout=5)


class StandInComm:
    """One rank's communicator as NCCL creates it, on the thread that calls init()."""

    def __init__(self, gpu_local_cpus, cuda_dev: int = 0, environ=os.environ, ras: bool = True,
                 after_proxy_create: Optional[Callable[[], None]] = None):
        self.gpu_local = frozenset(gpu_local_cpus)
        self.cuda_dev = cuda_dev
        self.env = _Env(environ)
        self.ras = ras
        self.after_proxy_create = after_proxy_create  # a test's hook: NCCL still holds the narrow mask
        self.threads: dict[str, _NcclThread] = {}
        self.narrowed_to: Optional[frozenset[int]] = None

    def init(self) -> None:
        """ncclCommInitRank on the calling thread: bootstrapInit, then initTransportsRank."""
        self.threads["bootstrap"] = _NcclThread(self.env, lambda: None, "NCCL BootstrapR")
        if self.ras:
            self.threads["ras"] = _NcclThread(self.env, lambda: None, "NCCL RAS")
        mask = frozenset(os.sched_getaffinity(0))
        affinity = mask & self.gpu_local  # ncclTopoGetCpuAffinity: CPU_AND
        saved = None
        if affinity:
            saved = mask  # init.cc:1001
            os.sched_setaffinity(0, affinity)  # init.cc:1002: the calling thread only
            self.narrowed_to = affinity
        try:
            self.threads["service"] = _NcclThread(self.env, self._pin_to_proxy_cpuset,
                                                  f"NCCL Service {self.cuda_dev:2d}")
            self.threads["uds"] = _NcclThread(self.env, self._pin_to_proxy_cpuset,
                                              f"NCCL UDS Service {self.cuda_dev:2d}")
            if self.after_proxy_create is not None:
                self.after_proxy_create()
        finally:
            if saved is not None:
                os.sched_setaffinity(0, saved)  # init.cc:1395 (the exit: label)

    def _pin_to_proxy_cpuset(self) -> None:
        cpus = self.env.proxy_cpuset()
        if cpus:
            os.sched_setaffinity(0, cpus)  # proxy.cc:1603 / 1797: the service thread itself

    def first_collective(self) -> None:
        """The first proxy connection: ncclProxyProgressCreate on the service thread (proxy.cc:1393),
        so the progress thread inherits the service thread's mask and is named by it."""
        def create():
            # "NCCL Progress%2d" with proxyState->tpLocalnRanks (proxy.cc:1014): 1 rank per process here
            self.threads["progress"] = _NcclThread(self.env, lambda: None, f"NCCL Progress{1:2d}")

        self.threads["service"].call(create)

    def tids(self) -> dict[str, int]:
        return {k: t.tid for k, t in self.threads.items()}

    def close(self):
        for t in self.threads.values():
            t.close()
