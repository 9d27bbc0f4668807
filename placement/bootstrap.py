"""Stage 1 in placerun's workers, before the user's program runs.

How a worker gets here (placement.launcher chooses by the way torchrun starts the program):
    python [-u] SCRIPT | -m MODULE (torchrun's default)   the startup hook placement/_worker_hook/
        sitecustomize.py calls start_worker(); the user's command line is torchrun's, untouched
    --no-python PROG: `python -u -m placement.bootstrap --no-python PROG [ARGS]`: stage 1, then exec
        (the process mask and memory policy survive exec; the program's threads inherit them)
    --run-path SCRIPT: torch runs this file with runpy in its spawned child, argv --run-path SCRIPT
        [ARGS]; torch sets the worker env only inside that child, after any startup hook could run

placerun hands the node's plan over in one file named by PLACEMENT_PLAN_FILE (placement.handoff:
the config, the plan with each rank's roles and the cores of its share, the env names the user
set, the device list under --virtual-local-rank); the rank's part is picked by its local rank
(LOCAL_RANK; under --virtual-local-rank, where torch gives every worker LOCAL_RANK=0, from the
CUDA_VISIBLE_DEVICES entry torch gave it). No worker reads the node's topology. Stage 1 runs
before any user code and so before torch starts threads: process mask = the rank's whole share,
memory policy, env, event log, Session (placement.bind.stage1). Stage 2 (Python programs) binds
threads by role and keeps doing so. Nothing here stops a job torchrun would run: a stage 1 that
cannot run says so in one line and the program runs unbound.
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys
from typing import MutableMapping, Optional

from placement.bind.stage1 import run_stage1, start_stage2, warn_rank
from placement.errors import PlacementError, say
from placement.events import open_rank_log
from placement.handoff import Handoff, HandoffError
from placement.identity import RankIdentity, run_id_from_env


def stage1(environ: MutableMapping[str, str] = os.environ):
    """Stage 1 from placerun's hand-off (placement.bind.stage1.run_stage1); the Session."""
    handoff = Handoff.load(environ)
    identity = RankIdentity.find(environ, local_rank=handoff.local_rank(environ))
    cfg = handoff.config
    # placerun checked the directory before starting any worker; should it have become
    # unwritable since, this is the same one-line error (LogDirError), never a silent null log;
    # start_worker says it and the program runs unbound, as it would under torchrun.
    events = open_rank_log(cfg.monitor.log_dir, identity.rank, run_id_from_env(environ), cfg.monitor.log_rotate_mb)
    try:
        s = run_stage1(cfg, handoff.plan, events, identity, entry="placerun", environ=environ,
                       keep=handoff.keep_env, restart=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except KeyError as e:  # the plan has no such local rank
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
        start_session(s)
    return s


def start_session(s, *, find_main: bool = False) -> None:
    """Stage 2 and the automatic monitor for the Session stage 1 made: placerun's worker, or a Ray
    worker (placement/integrations/ray.py; `find_main`: its loop may run on a thread of its own).
    Never raises: what could not start is one line, and the program runs on."""
    try:
        start_stage2(s)
    except Exception as e:  # binding never stops training
        warn_rank(s.events, s.rank, f"stage 2 could not start ({type(e).__name__}: {e}); "
                                    "threads stay on the stage-1 mask")
    try:
        from placement.auto import install_auto_monitor

        install_auto_monitor(s, find_main)  # placement.monitor.auto: steps without a line of the program's code
    except Exception as e:  # the monitor never stops training
        warn_rank(s.events, s.rank, f"the automatic monitor could not be installed ({type(e).__name__}: {e}); "
                                    "this rank runs without step records unless it calls placement.attach()")


def _say_unbound(environ, why: str) -> None:
    rank = environ.get("RANK", environ.get("LOCAL_RANK", "?"))
    say(f"placement: rank {rank}: {why}; this rank runs unbound")


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
