"""Per-worker entry of placerun: stage-1 binding, then the user's program exactly as torchrun runs it.

    python -u -m placement.bootstrap SCRIPT [ARGS...]             torchrun's default
    python -u -m placement.bootstrap -m MODULE [ARGS...]          torchrun -m
    python -u -m placement.bootstrap --no-python PROG [ARGS...]   torchrun --no-python (exec)
    runpy.run_path(<this file>) with argv --run-path SCRIPT ...   torchrun --run-path

placerun hands the node's plan over in files named by PLACEMENT_PLAN_FILE (plan JSON),
PLACEMENT_CONFIG_FILE (config JSON) and PLACEMENT_TOPOLOGY_FILE (topology JSON); the
rank's part is picked by LOCAL_RANK. Stage 1 runs before any user code and so before
torch starts threads: process mask = the rank's whole share, memory policy, env, event
log, Session. Stage 2 (Python programs only) binds threads by role and keeps doing so.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import runpy
import sys
from typing import MutableMapping, Optional

from placement.errors import PlacementError

PLAN_FILE_ENV = "PLACEMENT_PLAN_FILE"
CONFIG_FILE_ENV = "PLACEMENT_CONFIG_FILE"
TOPOLOGY_FILE_ENV = "PLACEMENT_TOPOLOGY_FILE"
KEEP_ENV_ENV = "PLACEMENT_KEEP_ENV"
HANDOFF_MAX = 256 * 1024 * 1024  # the topology of an 8192-CPU node is a few MB  # comma list: env names the user set before placerun

log = logging.getLogger("placement")


class HandoffError(PlacementError):
    """The plan/config files placerun hands to its workers are missing or unreadable."""


def load_handoff(environ: MutableMapping[str, str] = os.environ):
    """(PlacementConfig, Plan, Topology | None) from the files placerun wrote."""
    from placement.config import PlacementConfig
    from placement.plan.model import Plan
    from placement.topology.model import Topology

    plan_file = environ.get(PLAN_FILE_ENV)
    if not plan_file:
        raise HandoffError(f"{PLAN_FILE_ENV} is not set: placement.bootstrap runs under placerun, "
                           "e.g. `placerun --nproc-per-node 2 train.py`")
    plan = _read_json(plan_file, Plan.from_dict, "plan")
    config_file = environ.get(CONFIG_FILE_ENV)
    cfg = _read_json(config_file, PlacementConfig.from_dict, "config") if config_file else PlacementConfig()
    topo_file = environ.get(TOPOLOGY_FILE_ENV)
    topo = _read_json(topo_file, Topology.from_dict, "topology") if topo_file else None
    return cfg, plan, topo


def _read_json(path: str, build, what: str):
    from placement._procfs import read_bounded

    try:
        return build(json.loads(read_bounded(path, HANDOFF_MAX)))
    except OSError as e:
        raise HandoffError(f"cannot read the {what} file {path!r}: {e.strerror or e}") from None
    except (PlacementError, ValueError, KeyError, TypeError) as e:
        raise HandoffError(f"the {what} file {path!r} is not a placement {what}: {e}") from None


def stage1(environ: MutableMapping[str, str] = os.environ):
    """Stage 1 from placerun's hand-off files (placement.bind.stage1.run_stage1); the Session."""
    from placement.bind.stage1 import run_stage1
    from placement.events import open_rank_log

    cfg, plan, topo = load_handoff(environ)
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    rank = int(environ.get("RANK", str(local_rank)))
    # placerun checked the directory before starting any worker; should it have become
    # unwritable since, this is the same one-line error (exit 2), never a silent null log.
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


def _split(argv: list[str]) -> tuple[str, str, list[str]]:
    """(how, target, args): how is 'script', 'module', 'run-path' or 'exec'."""
    flags = {"-m": "module", "--no-python": "exec", "--run-path": "run-path"}
    if argv and argv[0] in flags:
        if len(argv) < 2:
            raise HandoffError(f"{argv[0]} needs a target; usage: python -m placement.bootstrap "
                               "[-m MODULE | --no-python PROG | --run-path SCRIPT | SCRIPT] [ARGS...]")
        return flags[argv[0]], argv[1], argv[2:]
    if not argv:
        raise HandoffError("no program given; usage: python -m placement.bootstrap "
                           "[-m MODULE | --no-python PROG | --run-path SCRIPT | SCRIPT] [ARGS...]")
    return "script", argv[0], argv[1:]


def main(argv: Optional[list[str]] = None) -> None:
    try:
        how, target, args = _split(list(sys.argv[1:] if argv is None else argv))
        s = stage1()
    except PlacementError as e:
        print(f"placement bootstrap: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Exception as e:  # a bug in placement must not stop training: run unbound
        print(f"placement: stage 1 failed ({type(e).__name__}: {e}); running unbound", file=sys.stderr)
        s = None
    if how == "exec":  # affinity and memory policy survive exec; threads of the new program inherit them
        if s is not None:
            s.close()
        try:
            os.execvp(target, [target, *args])
        except OSError as e:
            print(f"placement bootstrap: cannot execute {target!r}: {e.strerror or e}", file=sys.stderr)
            sys.exit(127)
    if s is not None:
        try:
            from placement.bind.stage1 import start_stage2

            start_stage2(s)
        except Exception as e:  # binding never stops training
            from placement.bind.stage1 import warn_rank

            warn_rank(s.events, s.rank, f"stage 2 could not start ({type(e).__name__}: {e}); "
                                    "threads stay on the stage-1 mask")
    if how == "module":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    if not os.path.exists(target):  # what `python SCRIPT` says, with its exit code
        print(f"{sys.executable}: can't open file {os.path.abspath(target)!r}: [Errno 2] No such file or directory",
              file=sys.stderr)
        sys.exit(2)
    sys.argv = [target, *args]
    if how == "script":  # `python SCRIPT` puts the script's directory first on sys.path
        sys.path[0] = os.path.dirname(os.path.realpath(target))
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
