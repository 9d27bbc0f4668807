"""Stage 1 in placerun's workers, before the user's program runs.

How a worker gets here (placement.launcher chooses by the way torchrun starts the program):
    python [-u] SCRIPT | -m MODULE (torchrun's default)   the startup hook placement/_worker_hook/
        sitecustomize.py calls start_worker(); the user's command line is torchrun's, untouched
    --no-python PROG: `python -u -m placement.bootstrap --no-python PROG [ARGS]`: stage 1, then exec
        (the process mask and memory policy survive exec; the program's threads inherit them)
    --run-path SCRIPT: torch runs this file with runpy in its spawned child, argv --run-path SCRIPT
        [ARGS]; torch sets the worker env only inside that child, after any startup hook could run

placerun hands the node's plan over in files named by PLACEMENT_PLAN_FILE (plan JSON),
PLACEMENT_CONFIG_FILE (config JSON) and PLACEMENT_TOPOLOGY_FILE (topology JSON); the rank's part
is picked by its local rank (LOCAL_RANK; under --virtual-local-rank, where torch gives every
worker LOCAL_RANK=0, from the CUDA_VISIBLE_DEVICES entry torch gave it). Stage 1 runs before any
user code and so before torch starts threads: process mask = the rank's whole share, memory
policy, env, event log, Session (placement.bind.stage1). Stage 2 (Python programs) binds threads
by role and keeps doing so. Nothing here stops a job torchrun would run: a stage 1 that cannot
run says so in one line and the program runs unbound.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
from typing import MutableMapping, Optional

from placement.errors import PlacementError

PLAN_FILE_ENV = "PLACEMENT_PLAN_FILE"
CONFIG_FILE_ENV = "PLACEMENT_CONFIG_FILE"
TOPOLOGY_FILE_ENV = "PLACEMENT_TOPOLOGY_FILE"
KEEP_ENV_ENV = "PLACEMENT_KEEP_ENV"  # comma list: env names the user set before placerun
HANDOFF_MAX = 256 * 1024 * 1024  # the topology of an 8192-CPU node is a few MB
# Set under --virtual-local-rank: JSON of the CUDA_VISIBLE_DEVICES list placerun itself saw (null: unset).
VIRTUAL_LOCAL_RANK_ENV = "PLACEMENT_VIRTUAL_LOCAL_RANK"


class HandoffError(PlacementError):
    """The plan/config files placerun hands to its workers are missing or unreadable."""


def load_handoff(environ: MutableMapping[str, str] = os.environ):
    """(PlacementConfig, Plan, Topology | None) from the files placerun wrote."""
    from placement.config import PlacementConfig
    from placement.topology.model import Topology

    plan = load_plan(environ)
    config_file = environ.get(CONFIG_FILE_ENV)
    cfg = _read_json(config_file, PlacementConfig.from_dict, "config") if config_file else PlacementConfig()
    topo_file = environ.get(TOPOLOGY_FILE_ENV)
    topo = _read_json(topo_file, Topology.from_dict, "topology") if topo_file else None
    return cfg, plan, topo


def load_plan(environ: MutableMapping[str, str] = os.environ):
    """The node's Plan from the file PLACEMENT_PLAN_FILE names (also read by `placement doctor`
    from a running rank's environment)."""
    from placement.plan.model import Plan

    plan_file = environ.get(PLAN_FILE_ENV)
    if not plan_file:
        raise HandoffError(f"{PLAN_FILE_ENV} is not set: placement.bootstrap runs under placerun, "
                           "e.g. `placerun --nproc-per-node 2 train.py`")
    return _read_json(plan_file, Plan.from_dict, "plan")


def _read_json(path: str, build, what: str):
    from placement._procfs import read_bounded

    try:
        return build(json.loads(read_bounded(path, HANDOFF_MAX)))
    except OSError as e:
        raise HandoffError(f"cannot read the {what} file {path!r}: {e.strerror or e}") from None
    except (PlacementError, ValueError, KeyError, TypeError) as e:
        raise HandoffError(f"the {what} file {path!r} is not a placement {what}: {e}") from None


def local_rank_of(environ: MutableMapping[str, str] = os.environ) -> int:
    """This worker's local rank. Under --virtual-local-rank torch sets LOCAL_RANK=0 for every worker
    and CUDA_VISIBLE_DEVICES to the local rank's entry of the agent's own CUDA_VISIBLE_DEVICES list,
    or to str(local_rank) when the agent has none (torch/distributed/elastic/agent/server/
    local_elastic_agent.py, LocalElasticAgent._set_local_rank_env, torch 2.13), so the rank is
    found back from that entry."""
    virtual = environ.get(VIRTUAL_LOCAL_RANK_ENV)
    if virtual is None:
        return int(environ.get("LOCAL_RANK", "0"))
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    parent = json.loads(virtual)
    try:
        return int(visible) if parent is None else [d.strip() for d in parent].index(visible)
    except ValueError:
        raise HandoffError(f"--virtual-local-rank: CUDA_VISIBLE_DEVICES={visible!r} is not an entry of the "
                           f"launcher's list {parent!r}, so this worker's local rank is unknown") from None


def stage1(environ: MutableMapping[str, str] = os.environ):
    """Stage 1 from placerun's hand-off files (placement.bind.stage1.run_stage1); the Session."""
    from placement.bind.stage1 import run_stage1
    from placement.events import open_rank_log

    cfg, plan, topo = load_handoff(environ)
    local_rank = local_rank_of(environ)
    rank = int(environ.get("RANK", str(local_rank)))
    # placerun checked the directory before starting any worker; should it have become
    # unwritable since, this is the same one-line error (LogDirError), never a silent null log;
    # start_worker says it and the program runs unbound, as it would under torchrun.
    events = open_rank_log(cfg.monitor.log_dir, rank)
    try:
        s = run_stage1(cfg, plan, topo, events, rank=rank, local_rank=local_rank,
                       world_size=int(environ.get("WORLD_SIZE", "1")), entry="placerun", environ=environ,
                       keep=environ.get(KEEP_ENV_ENV, "").split(","),
                       restart=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except KeyError as e:
        raise HandoffError(str(e.args[0])) from None
    atexit.register(s.close)  # registered first, so it runs after the monitor's own exit hooks
    return s


def start_worker(environ: MutableMapping[str, str] = os.environ, *, stage2: bool = True):
    """Stage 1 (and stage 2) for this worker process; the Session, or None when stage 1 could not
    run (said in one line: the program then runs unbound, as under torchrun). Never raises."""
    try:
        s = stage1(environ)
    except PlacementError as e:
        _say_unbound(environ, str(e))
        return None
    except Exception as e:  # a bug in placement must not stop training
        _say_unbound(environ, f"stage 1 failed ({type(e).__name__}: {e})")
        return None
    if stage2:
        try:
            from placement.bind.stage1 import start_stage2

            start_stage2(s)
        except Exception as e:  # binding never stops training
            from placement.bind.stage1 import warn_rank

            warn_rank(s.events, s.rank, f"stage 2 could not start ({type(e).__name__}: {e}); "
                                        "threads stay on the stage-1 mask")
    return s


def _say_unbound(environ, why: str) -> None:
    rank = environ.get("RANK", environ.get("LOCAL_RANK", "?"))
    print(f"placement: rank {rank}: {why}; this rank runs unbound", file=sys.stderr, flush=True)


USAGE = "usage: python -m placement.bootstrap --no-python PROG [ARGS...] | --run-path SCRIPT [ARGS...]"


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] not in ("--no-python", "--run-path"):
        print(f"placement bootstrap: {USAGE} (Python programs get stage 1 from placerun's startup hook)",
              file=sys.stderr)
        sys.exit(2)
    how, target, args = argv[0], argv[1], argv[2:]
    if how == "--no-python":
        s = start_worker(stage2=False)  # exec follows: threads of the new program inherit the mask
        if s is not None:
            s.close()
        try:
            os.execvp(target, [target, *args])
        except OSError as e:
            print(f"placement bootstrap: cannot execute {target!r}: {e.strerror or e}", file=sys.stderr)
            sys.exit(127)
    start_worker()
    # torch's run_script_path, one level down: the script as __main__ with its own argv
    sys.argv = [target, *args]
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
