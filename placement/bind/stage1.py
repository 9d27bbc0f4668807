"""Stage 1, the one function both entries call: placerun's worker bootstrap (before the user's
code) and `placement.attach()` without placerun (from inside it).

Process CPU mask = the rank's whole share, memory policy, env (placement.bind.env: the plan's
OMP_NUM_THREADS, NCCL_SET_THREAD_NAME=1, CUDA_DEVICE_ORDER, NCCL_PROXY_CPUSET), the `start`
event, and the Session that stage 2 and the monitor use. Whether NCCL could still see the env is
said here too: NCCL reads NCCL_SET_THREAD_NAME and NCCL_PROXY_CPUSET once, so a stage 1 that runs
after NCCL's communicator exists (attach() after DDP(...)) cannot name or place its threads.
"""
from __future__ import annotations

import os
import sys
from typing import Iterable, MutableMapping, Optional

from placement import imports
from placement.bind import session as session_mod
from placement.bind.affinity import apply_process_mask
from placement.bind.binder import RoleBinder
from placement.bind.dataloader import MODULE as DATALOADER_MODULE, count_workers_against
from placement.bind.env import apply_env, apply_torch_threads
from placement.bind.fork import guard_forks, rehome_forked_children
from placement.bind.memory import apply_memory_policy
from placement.bind.nccl import SET_THREAD_NAME, nccl_communicator_started
from placement.config import PlacementConfig
from placement.errors import say
from placement.events import EventKind
from placement.identity import RankIdentity
from placement.bind.nccl_env import NcclTimingMode, decide_nccl_env
from placement.bind.openmp import hold_main_until_torch
from placement.plan.model import Plan

WATCH_INTERVAL_S = 1.0  # the stage-2 watcher's rescan period; a rescan of an unchanged rank is a few listdirs
LATE_NCCL_FIX = ("call placement.attach() before init_process_group, or launch with placerun "
                 "(its workers get the env before any user code)")


def run_stage1(cfg: PlacementConfig, plan: Plan, events, identity: RankIdentity, *, entry: str,
               environ: MutableMapping[str, str] = os.environ, keep: Iterable[str] = (),
               restart: int = 0, detail: Optional[dict] = None) -> session_mod.Session:
    """Bind this process for `identity.local_rank` of `plan` and make it the current Session.

    entry: "placerun" (bootstrap, before user code), "attach" (inside the user's program) or "ray"
    (a Ray worker at its `import torch`: placement/integrations/ray.py); detail: more fields of
    the `start` event.
    KeyError when the plan has no such local rank (the caller says it in its own words)."""
    rank, local_rank = identity.rank, identity.local_rank
    rank_plan = plan.for_local_rank(local_rank)
    launched = frozenset(os.sched_getaffinity(0))
    binding = plan.policy != "none" and bool(rank_plan.roles)
    late = entry == "attach" and rank_plan.gpu is not None and nccl_communicator_started()
    env_set = apply_env(rank_plan, environ, keep=keep, binding=binding)
    nccl_note = None
    if rank_plan.gpu is not None and cfg.monitor.enabled:
        nccl_note = apply_nccl_timing_env(cfg, environ, env_set, keep, entry)
    torch_threads = apply_torch_threads(env_set) if environ is os.environ else None
    events.event(EventKind.START, pid=os.getpid(), local_rank=local_rank, world_size=identity.world_size, restart=restart,
                 policy=plan.policy, plan=rank_plan.to_dict(), env=env_set, torch_threads=torch_threads, entry=entry,
                 **(detail or {}))
    if late:
        warn_rank(events, rank, "attach() ran after NCCL created its communicator: NCCL read its env "
                            f"({SET_THREAD_NAME}, NCCL_PROXY_CPUSET) before placement set it, so its threads "
                            f"are unnamed and bound as `other`, and main was narrowed by NCCL's init; "
                            f"{LATE_NCCL_FIX}")
    elif environ.get(SET_THREAD_NAME) != "1":
        events.event(EventKind.WARNING, message=f"{SET_THREAD_NAME}={environ.get(SET_THREAD_NAME)!r}: "
                                        "NCCL threads are not named, so they are bound as `other`")
    if nccl_note is not None:
        warn_rank(events, rank, nccl_note)
    binder = RoleBinder(rank_plan, events, background_nice=cfg.tune.background_nice)
    memory = None
    if binding:
        mask = apply_process_mask(rank_plan.share())
        events.event(EventKind.BIND, **mask.to_dict(),
                     reason=f"stage 1 ({entry}): the rank's whole share, inherited by every thread")
        if not mask.ok:
            warn_rank(events, rank, mask.error or "")
        memory = apply_memory_policy(rank_plan.memory, events)
        if memory.fallback:
            warn_rank(events, rank, f"memory policy {memory.planned.mode} {memory.planned.nodes}: {memory.fallback}",
                  event=False)
    s = session_mod.Session(config=cfg, plan=plan, rank_plan=rank_plan, events=events, binder=binder,
                            identity=identity, memory=memory, launched_cpus=launched)
    session_mod.set_current(s)
    return s


def start_stage2(s) -> None:
    """Bind threads by role now and from then on (new threads, DataLoader workers, NCCL)."""
    guard_forks()  # bound or not: backend threads enter Python as the rank forks (bind/fork.py)
    if s.plan.policy == "none" or not s.rank_plan.roles:
        return
    rehome_forked_children(s.binder, forget_rank=_forget_session)
    hold_main_until_torch(s.binder)  # before main is first narrowed: bind/openmp.py
    s.binder.rescan()
    s.binder.start_watcher(WATCH_INTERVAL_S)
    # torch's DataLoader counts the calling thread's CPUs (main's core, once narrowed): bind/dataloader.py
    imports.when_imported(DATALOADER_MODULE,
                          lambda m: count_workers_against(m, lambda: () if s.closed else s.launched_cpus))


def _forget_session() -> None:
    """In a child forked from the rank: placement code there must not act for the rank."""
    session_mod.set_current(None)


def apply_nccl_timing_env(cfg: PlacementConfig, environ: MutableMapping[str, str], env_set: dict,
                          keep: Iterable[str], entry: str) -> Optional[str]:
    """NCCL collective timing and the flight recorder's ring (placement.monitor.nccl_timing,
    decided in bind/nccl_env.py): set into `environ` (and noted in `env_set`) unless the user
    set them; returns the one line to say when timing stays off."""
    dist = sys.modules.get("torch.distributed")
    pg_exists = entry == "attach" and dist is not None and dist.is_available() and dist.is_initialized()
    decision = decide_nccl_env(NcclTimingMode(cfg.monitor.nccl_timing), environ, process_group_exists=pg_exists)
    keep = set(keep)
    for k, v in decision.env.items():
        if k not in keep:
            environ[k] = env_set[k] = v
    return decision.note


def warn_rank(events, rank: int, message: str, *, event: bool = True) -> None:
    """One line on stderr naming the rank, and (unless event=False) a `warning` event."""
    if event:
        events.event(EventKind.WARNING, message=message)
    say(f"placement: rank {rank}: {message}")
