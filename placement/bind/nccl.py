"""What placement asks of NCCL, and how it tells whether NCCL has started in this process.

Sources (NVIDIA/nccl, tag v2.28.9-1 unless said):
- NCCL_SET_THREAD_NAME: src/debug.cc:417 NCCL_PARAM(SetThreadName, "SET_THREAD_NAME", 0), read
  on the first ncclSetThreadName call and cached; without it NCCL's threads keep the name of the
  thread that created them, so they cannot be told from any other thread.
- NCCL_PROXY_CPUSET (2.28+; absent, the lines commented out, in 2.27.7): src/proxy.cc:908
  proxyCpusetOnceFunc parses it once per process with ncclStrListToCpuset
  (src/include/cpuset.h:70: a comma list of CPU ids, strtoull per token: "0-3" would be CPU 0),
  and the proxy service thread (ncclProxyService, src/proxy.cc:1603) and the UDS service thread
  (ncclProxyServiceUDS, src/proxy.cc:1797) set their own affinity to it first thing. The progress
  thread is created by the service thread (ncclProxyProgressCreate, src/proxy.cc:1014, called at
  the first proxy connection, src/proxy.cc:1393) and so inherits that mask. RAS, bootstrap and
  IB-async threads are created elsewhere and are not covered.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from placement import _procfs
from placement.roles import is_nccl_thread

SET_THREAD_NAME = "NCCL_SET_THREAD_NAME"
PROXY_CPUSET = "NCCL_PROXY_CPUSET"


def proxy_cpuset_value(cpus) -> str:
    """NCCL_PROXY_CPUSET as NCCL parses it: CPU ids separated by commas, no ranges."""
    return ",".join(str(c) for c in sorted(cpus))


def nccl_threads_present(pid: Optional[int] = None) -> bool:
    """Whether a thread of this process carries an NCCL name (seen only with NCCL_SET_THREAD_NAME=1)."""
    pid = os.getpid() if pid is None else pid
    try:
        tids = _procfs.task_ids(pid)
    except (_procfs.ThreadGone, OSError):
        return False
    for tid in tids:
        try:
            if is_nccl_thread(_procfs.comm(pid, tid)):
                return True
        except (_procfs.ThreadGone, OSError):
            continue
    return False


def nccl_communicator_started() -> bool:
    """Whether NCCL has created a communicator in this process: an NCCL-named thread, or the
    default process group's NCCL backend reports one (ProcessGroupNCCL._is_initialized(); PyTorch
    creates the communicator at the first collective, or in init_process_group when device_id is
    given). False when torch.distributed is not imported or holds no NCCL group."""
    if nccl_threads_present():
        return True
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return False
        if "nccl" not in str(dist.get_backend()).lower():
            return False
        import torch

        pg = dist.distributed_c10d._get_default_group()
        backend = pg._get_backend(torch.device("cuda"))
        return bool(backend._is_initialized())
    except Exception:  # no CUDA build, an older torch: the threads were the only evidence
        return False
