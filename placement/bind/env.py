"""Stage-1 environment of a rank, set before torch (and so OpenMP, NCCL, CUDA) reads it."""
from __future__ import annotations

import sys
from typing import Iterable, MutableMapping, Optional

from placement.bind.nccl import PROXY_CPUSET, SET_THREAD_NAME, proxy_cpuset_value
from placement.plan.model import RankPlan
from placement.roles import ThreadRole


def apply_env(rank_plan: RankPlan, environ: MutableMapping[str, str], *, keep: Iterable[str] = (),
              binding: bool = True) -> dict[str, str]:
    """Set the plan's env (e.g. OMP_NUM_THREADS sized to `other`), NCCL_SET_THREAD_NAME=1 (NCCL
    threads must carry names to be recognised) and, when binding, CUDA_DEVICE_ORDER=PCI_BUS_ID
    (the plan matched GPUs by PCI bus id) and, for a GPU rank, NCCL_PROXY_CPUSET = the nccl set
    (NCCL 2.28+ puts its proxy service threads there itself, see placement.bind.nccl). Names in `keep` were set by the user and are left
    alone, as is anything already set except the plan's own keys. Returns what was set."""
    keep = set(keep)
    wanted = dict(rank_plan.env)
    defaults = {SET_THREAD_NAME: "1"}
    if binding:
        defaults["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        nccl = rank_plan.cpus(ThreadRole.NCCL)
        if rank_plan.gpu is not None and nccl:
            defaults[PROXY_CPUSET] = proxy_cpuset_value(nccl)
    applied: dict[str, str] = {}
    for k, v in wanted.items():
        if k not in keep:
            environ[k] = applied[k] = v
    for k, v in defaults.items():
        if k not in environ and k not in keep:
            environ[k] = applied[k] = v
    return applied


def apply_torch_threads(env_set: dict[str, str]) -> Optional[int]:
    """The plan's OMP_NUM_THREADS also through torch.set_num_threads when torch is already imported
    (attach() from inside a program): torch sized its intra-op pool from the env it saw then, so the
    env alone changes nothing. Returns the count set through torch, None when torch was not touched
    (not imported yet: it reads the env itself; or the plan sets no count)."""
    torch = sys.modules.get("torch")
    count = env_set.get("OMP_NUM_THREADS")
    if torch is None or count is None or not hasattr(torch, "set_num_threads"):
        return None
    torch.set_num_threads(int(count))
    return int(count)
