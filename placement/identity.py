"""Who this rank is: its rank, local rank, world sizes, node and host, found in one place.

torchrun (and placerun, which runs torchrun's agent) gives every worker RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE and GROUP_RANK (torch/distributed/elastic/agent/server/
local_elastic_agent.py, LocalElasticAgent._start_workers, torch 2.13); a process group, once
there is one, is the authority on rank and world size. placerun's workers are identified by
bootstrap (with the local rank its hand-off resolves under --virtual-local-rank), attach()
without placerun by itself; both through RankIdentity.find.
"""
from __future__ import annotations

import hashlib
import os
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import Mapping, Optional

from placement.errors import ConfigError


@dataclass(frozen=True)
class RankIdentity:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: Optional[int]  # torch elastic's GROUP_RANK: two agents on one host are two nodes
    host: str

    @classmethod
    def find(cls, environ: Mapping[str, str] = os.environ, *, local_rank: Optional[int] = None,
             default_rank: Optional[int] = None,
             default_local_world_size: Optional[int] = None) -> "RankIdentity":
        """From the process group when there is one, else the launcher's env. `local_rank`: found
        by the caller (placerun's hand-off under --virtual-local-rank), else LOCAL_RANK. Unset
        variables take the defaults: RANK `default_rank` (None: the local rank), WORLD_SIZE 1,
        LOCAL_WORLD_SIZE `default_local_world_size` (None: unknown, taken as local rank + 1, so
        not checked here; placerun's plan, which has a part per local rank, checks it instead).
        ConfigError (one line) on a malformed value."""
        if local_rank is None:
            local_rank = _env_int(environ, "LOCAL_RANK", 0, 0)
        local_world = _env_int(environ, "LOCAL_WORLD_SIZE",
                               local_rank + 1 if default_local_world_size is None else default_local_world_size, 1)
        if local_rank >= local_world:
            raise ConfigError(f"LOCAL_RANK={local_rank} is not valid with LOCAL_WORLD_SIZE={local_world}; "
                              f"valid: 0..{local_world - 1}")
        dist = process_group()
        if dist is not None:
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank = _env_int(environ, "RANK", local_rank if default_rank is None else default_rank, 0)
            world = _env_int(environ, "WORLD_SIZE", 1, 1)
        return cls(rank, local_rank, world, local_world, _node_rank(environ), socket.gethostname())


def process_group():
    """torch.distributed when a default process group exists, else None. Looked up among the
    modules already imported, never imported here: no process group can exist before the program
    imports torch, and a placerun worker's stage 1 (before user code) must import neither torch nor
    numpy, as torchrun's worker does not (tests/placerun/test_torchrun_conformance.py)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _env_int(environ: Mapping[str, str], name: str, default: int, lo: int) -> int:
    """An integer the launcher puts in the environment; ConfigError (one line) when it is not one."""
    text = environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < lo:
        raise ConfigError(f"{name}={text!r} is not valid; valid: an integer >= {lo} (torchrun and placerun set it), "
                          f"or unset for {default}")
    return value


def _node_rank(environ: Mapping[str, str]) -> Optional[int]:
    try:
        return int(environ["GROUP_RANK"])
    except (KeyError, ValueError):
        return None


# ---- which run a record belongs to -------------------------------------------------------
# Every record a rank writes carries its run's id, the same on every rank of that run, so that
# `placement report` tells runs (a relaunch appending to the same logs) and jobs apart.
RUN_ID_WAIT_S = 60.0  # attach() without a launcher: how long a rank waits for rank 0's run id
_RUN_KEY = "placement/run_id"


def job_id(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The job as its launcher names it: torch elastic's run id (placerun/torchrun's --rdzv-id,
    a fresh uuid under --standalone), else Slurm's job id, else Ray's; None when none says."""
    run = environ.get("TORCHELASTIC_RUN_ID")
    if run and run != "none":
        return run
    return environ.get("SLURM_JOB_ID") or environ.get("RAY_JOB_ID") or None


def run_id_from_env(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The run's id where the launcher's environment alone fixes it, the same on every rank and
    host: torch elastic's run id, restart count and master address/port (a port the agents pick
    each attempt, so two jobs given the same --rdzv-id still differ). None without torch elastic."""
    run = environ.get("TORCHELASTIC_RUN_ID")
    if not run:
        return None
    key = "|".join((run, environ.get("TORCHELASTIC_RESTART_COUNT", "0"), environ.get("MASTER_ADDR", ""),
                    environ.get("MASTER_PORT", "")))
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def shared_run_id(store, rank: int, timeout_s: float = RUN_ID_WAIT_S) -> tuple[str, Optional[str]]:
    """(run id, why it is this rank's own): rank 0's new id through the job's c10d store (rank 0
    sets it and goes on; the others wait for it at most timeout_s). A rank that cannot have it
    uses an id of its own and says why: its records are then reported as a run of their own."""
    import datetime

    if rank == 0:
        run = new_run_id()
        try:
            store.set(_RUN_KEY, run)
            return run, None
        except Exception as e:
            return run, f"rank 0's run id could not be shared through the c10d store ({type(e).__name__}: {e})"
    try:
        store.wait([_RUN_KEY], datetime.timedelta(seconds=timeout_s))
        return bytes(store.get(_RUN_KEY)).decode(errors="replace")[:64], None
    except Exception as e:
        return new_run_id(), (f"rank 0's run id did not come through the c10d store within {timeout_s:.0f} s "
                              f"({type(e).__name__}); this rank's records carry an id of their own")
