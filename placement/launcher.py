"""`placerun`: torchrun with every thread of every rank placed.

    placerun [torchrun flags] [placement.KEY=VALUE ...] [--placement-config FILE] [--dry-run] SCRIPT [ARGS]

Every torchrun flag is parsed by torch's own parser and handled by torch's own `run`, so
rendezvous, elastic restarts, exit codes, signals and torch's own errors (ValueError from
`main()`, exit 1 from the console script) are torchrun's. Placement adds the node's plan, computed
once before the elastic agent starts (restarts reuse it) and written to one hand-off file
(placement.handoff: config and plan, no topology) named to the workers by one env variable,
and stage 1 in each worker before its program runs.

How stage 1 reaches a worker, and why. A Python worker (torchrun's default and `-m`) runs exactly
torchrun's command line: placerun only puts placement/_worker_hook first on PYTHONPATH, whose
`sitecustomize` the interpreter imports before `__main__`; it restores PYTHONPATH, runs stage 1,
then chains to the `sitecustomize` it hides. So the program is the user's own in every way torch
and Python show it: `__name__`, `__file__`, `sys.argv`, `sys.path[0]`, tracebacks without
bootstrap or runpy frames, the program named in torch's failure summary, and PYTHON_EXEC naming
another interpreter (where placement cannot be imported, one line says the rank runs unbound).
The alternatives were worse: a bootstrap entrypoint changes all of the above, and a mask set by
the agent after spawn races the threads the worker starts first and cannot set a memory policy.
`--no-python` programs are not Python: `python -u -m placement.bootstrap --no-python PROG` binds
and execs (mask and memory policy survive exec), and torch's failure summary is given the
program's name back. `--run-path` workers are multiprocessing children whose torch env is set only
inside the child, so torch's run_script_path runs placement/bootstrap.py, which binds, then runs
the script as torch would.
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass
from typing import Mapping, Optional

from placement import bootstrap
from placement.config import EnvSettings, PlacementConfig, is_setting, valid_values
from placement.cpuset import format_cpulist
from placement.errors import ConfigError, PlacementError
from placement.events import check_log_dir
from placement.handoff import PLAN_FILE_ENV, Handoff, VirtualLocalRank
from placement.plan.model import Plan
from placement.plan.node import plan_for_node
from placement.plan.table import format_plan_table, warnings_summary
from placement.roles import ThreadRole

# A Hydra-style placement override before the script: placement.policy=exclusive, +placement.x=y.
_OVERRIDE = re.compile(r"^\+?placement\.[A-Za-z_][\w.]*=")
# An override without its =VALUE: placement.policy (a script is never named so; checked on disk too).
_OVERRIDE_WITHOUT_VALUE = re.compile(r"^\+?placement\.[A-Za-z_][\w.]*$")
# Looks like KEY=VALUE but lacks the placement. prefix (a likely typo for an override).
_BARE_KEY_VALUE = re.compile(r"^[A-Za-z_][\w.]*=")
_BOOTSTRAP_MODULE = "placement.bootstrap"
_HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker_hook")
USER_PYTHONPATH_ENV = "PLACEMENT_USER_PYTHONPATH"  # the user's PYTHONPATH, restored by the hook
# Tests only (tests/hostbed.py, docs/development.md): the machine tree placerun plans for instead of
# "/", so each host of a test bed on one machine has its own topology. Unset in production.
TEST_MACHINE_ROOT_ENV = "PLACEMENT_TEST_MACHINE_ROOT"


@dataclass
class PlacerunArgs:
    torch_args: argparse.Namespace  # exactly what torchrun's own parser returns
    overrides: list[str]
    config_file: Optional[str]
    dry_run: bool


def _parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "placerun"
    parser.description = "torchrun with CPU/NUMA placement of every thread role of every rank"
    group = parser.add_argument_group("placement (before the training script)")
    group.add_argument("--placement-config", dest="placement_config", metavar="FILE", default=None,
                       help="YAML file of placement settings (top level or under `placement:`)")
    group.add_argument("--dry-run", dest="placement_dry_run", action="store_true",
                       help="print this node's plan and the worker command, then exit")
    return parser


def parse_placerun_args(argv: list[str]) -> PlacerunArgs:
    """Split placerun's own arguments from torchrun's. Overrides and placement flags go before the
    script; everything after the script is the script's. Argparse errors exit 2 as torchrun's do."""
    parser = _parser()
    ns = parser.parse_args(list(argv))
    overrides: list[str] = []
    while _OVERRIDE.match(ns.training_script):
        overrides.append(ns.training_script)
        rest = ns.training_script_args
        if not rest:
            parser.error(f"no training script after the placement override {ns.training_script!r}")
        # Flags may follow an override; re-parse the rest on top of what was parsed so far.
        ns = parser.parse_args(rest, namespace=ns)
    if _OVERRIDE_WITHOUT_VALUE.match(ns.training_script) and not os.path.exists(ns.training_script) and not (
            ns.module and not is_setting(ns.training_script)):  # -m placement.selftest.job is a module
        raise ConfigError(f"placement override {ns.training_script!r} has no value; write "
                          f"{ns.training_script.lstrip('+')}=VALUE ({valid_values(ns.training_script)})")
    if _BARE_KEY_VALUE.match(ns.training_script) and not os.path.exists(ns.training_script):
        raise ConfigError(f"{ns.training_script!r} is neither a training script nor a placement override; "
                          f"overrides start with placement., e.g. placement.{ns.training_script}")
    config_file, dry_run = ns.placement_config, ns.placement_dry_run
    del ns.placement_config, ns.placement_dry_run
    return PlacerunArgs(torch_args=ns, overrides=overrides, config_file=config_file, dry_run=dry_run)


@dataclass
class WorkerLaunch:
    """What torch's `run` is given for the workers: its args, the env placerun adds for the length
    of the run, and the program torch's failure summary must name."""
    torch_args: argparse.Namespace
    environ: dict[str, str]
    program: str  # what torchrun's summary names ("" when torch's own name is kept)


def worker_launch(torch_args: argparse.Namespace, environ=os.environ) -> WorkerLaunch:
    """torchrun's args, changed only where a non-hook way into the worker is needed (see the
    module docstring); `environ` is the launcher's env the workers inherit."""
    a = copy.copy(torch_args)
    env: dict[str, str] = {}
    if a.no_python and a.module:  # torch's own ValueError, raised by torch's config_from_args
        return WorkerLaunch(a, env, "")
    if a.run_path:
        a.training_script_args = ["--run-path", a.training_script, *a.training_script_args]
        a.training_script = os.path.abspath(bootstrap.__file__)
        return WorkerLaunch(a, env, "")
    if a.no_python:  # placerun's own interpreter, whatever PYTHON_EXEC says: it only execs
        a.training_script_args = ["-u", "-m", _BOOTSTRAP_MODULE, "--no-python", a.training_script,
                                  *a.training_script_args]
        program, a.training_script = a.training_script, sys.executable
        return WorkerLaunch(a, env, program)
    user = environ.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([_HOOK_DIR] + ([user] if user else []))
    if user is not None:
        env[USER_PYTHONPATH_ENV] = user
    return WorkerLaunch(a, env, "")


def main(argv: Optional[list[str]] = None) -> int:
    """torch.distributed.run.main with placement: the same exceptions (torch's ValueError,
    ChildFailedError, SignalException), wrapped the same way (torch's @record); placement's own
    bad input is one line and 2. os.environ is as it was when this returns or raises."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_main)(sys.argv[1:] if argv is None else list(argv))


@dataclass
class NumaBindingChoice:
    """What placerun does with torchrun's --numa-binding MODE, and the one line that says so."""
    mode: str
    torch_binds: bool  # True: torch's own binding runs (placement.policy=none); else placement binds
    within: Optional[str]  # the mode the per-role plan is made inside (policy auto), else None
    line: str


def numa_binding_choice(mode: Optional[str], policy: str) -> Optional[NumaBindingChoice]:
    """torchrun's --numa-binding is run, never refused (placerun is a drop-in). policy auto: the
    mode's CPU sets, computed as torch computes them, bound by placement with each rank's roles
    placed inside; an explicit process-level placement.policy wins over the flag; policy none:
    torch binds and placement monitors. Where placement binds, torch's own binding (a numactl
    wrapper around the worker) is left out: the same sets are applied by stage 1."""
    if not mode:
        return None
    if policy == "none":
        return NumaBindingChoice(mode, True, None, f"placerun: --numa-binding={mode} with placement.policy=none: "
                                 "torch binds the workers, placement only monitors")
    if policy == "auto":
        return NumaBindingChoice(mode, False, mode, (
            f"placerun: --numa-binding={mode}: placement binds each rank inside the CPU set torch's {mode} "
            "binding gives it (the same sets), with its thread roles placed within; "
            "placement.policy=none lets torch bind instead"))
    verb = "agrees with" if policy == mode else "wins over"
    return NumaBindingChoice(mode, False, None, (
        f"placerun: placement.policy={policy} {verb} --numa-binding={mode}: placement binds each rank to "
        f"policy {policy}'s CPU set (as torchrun --numa-binding={policy} would), one set for all its threads"))


def _main(argv: list[str]) -> int:
    try:
        pa = parse_placerun_args(argv)
        launch = worker_launch(pa.torch_args)
        plan, cfg, numa = _plan(pa)
    except PlacementError as e:
        print(f"placerun: {e}", file=sys.stderr)
        return e.exit_code
    if numa is not None:
        print(numa.line, file=sys.stderr, flush=True)
        if not numa.torch_binds:
            launch.torch_args.numa_binding = None
    if pa.dry_run:
        print(format_plan_table(plan))
        print(f"host: {socket.gethostname()}")  # one table per node of a multi-node job: whose it is
        print("worker command: " + " ".join(_command_line(launch)))
        return 0
    print(concise_plan(plan), file=sys.stderr, flush=True)
    saved = dict(os.environ)
    directory = tempfile.mkdtemp(prefix="placerun-")
    exporter = None
    try:
        _hand_over(directory, make_handoff(cfg, plan, launch.torch_args))
        exporter = _start_node_exporter(cfg, directory)
        os.environ.update(launch.environ)
        _run(launch)
    finally:
        if exporter is not None:
            exporter.close()
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(directory, ignore_errors=True)
    return 0


def _start_node_exporter(cfg: PlacementConfig, directory: str):
    """The node's Prometheus endpoint and/or textfile (placement.metrics), over the snapshots its
    ranks write into `<directory>/metrics` (named to them by PLACEMENT_METRICS_DIR); None when
    off, or when prometheus-client is missing (one line: the job runs on)."""
    m = cfg.metrics
    if not m.port and not m.textfile_dir:
        return None
    from placement.metrics.exporter import EXTRA_LINE, Exporter, SnapshotCollector, available
    from placement.metrics.state import METRICS_DIR_ENV

    if not available():
        print(f"placerun: {EXTRA_LINE}", file=sys.stderr, flush=True)
        return None
    snapshots = os.path.join(directory, "metrics")
    os.makedirs(snapshots, exist_ok=True)
    os.environ[METRICS_DIR_ENV] = snapshots
    say = lambda line: print(f"placerun: {line}", file=sys.stderr, flush=True)  # noqa: E731
    textfile = os.path.join(m.textfile_dir, "placement.prom") if m.textfile_dir else None
    return Exporter(SnapshotCollector(snapshots, m.per_rank, say), m.port, textfile, m.publish_every_s, say).start()


def _plan(pa: PlacerunArgs) -> tuple[Plan, PlacementConfig, Optional[NumaBindingChoice]]:
    """Config and this node's plan: what `placement plan` prints with the same arguments."""
    cfg = EnvSettings.read(os.environ).load(pa.overrides, pa.config_file)  # under PLACEMENT_CONFIG/_OVERRIDES
    check_log_dir(cfg.monitor.log_dir)  # every rank writes its event log there: fail here, not in a worker
    numa = numa_binding_choice(getattr(pa.torch_args, "numa_binding", None), cfg.policy)
    nproc = _local_world_size(pa.torch_args.nproc_per_node)
    root = os.environ.get(TEST_MACHINE_ROOT_ENV) or "/"
    _, plan = plan_for_node(cfg, nproc, root=root, within=None if numa is None else numa.within)
    return plan, cfg, numa


def make_handoff(cfg: PlacementConfig, plan: Plan, torch_args: argparse.Namespace,
                 environ: Mapping[str, str] = os.environ) -> Handoff:
    """What every worker of this node is handed: the config, the plan (each rank's roles and the
    cores of its share: no topology), the env names the user set that the plan's env must leave
    alone, and under --virtual-local-rank the CUDA_VISIBLE_DEVICES list torch divides."""
    planned_env = {k for r in plan.ranks for k in r.env}
    virtual = None
    if torch_args.virtual_local_rank:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        virtual = VirtualLocalRank(None if visible is None else tuple(visible.split(",")))
    return Handoff(cfg, plan, tuple(sorted(k for k in planned_env if k in environ)), virtual)


def concise_plan(plan) -> str:
    """The launch banner: one line per local rank (role -> CPUs), then one warning line saying what
    the plan gave up. `placerun --dry-run` and `placement plan` print the full table with reasons
    and every warning."""
    lines = [f"placerun: {socket.gethostname()}: policy {plan.policy}, {len(plan.ranks)} local rank(s) "
             "(--dry-run shows the reasons)"]
    for r in plan.ranks:
        gpu = "cpu-only" if r.gpu is None else f"gpu {r.gpu.index}"
        memory = " ".join([r.memory.mode, ",".join(map(str, r.memory.nodes))]).strip()
        roles = "  ".join(f"{role.value} {format_cpulist(r.roles[role].cpus)}"
                          for role in ThreadRole if role in r.roles) or "not bound (monitor only)"
        lines.append(f"  rank {r.local_rank}  {gpu}  memory {memory}  {roles}")
    summary = warnings_summary(plan, "--dry-run")  # one line per node
    if summary:
        lines.append(f"  warning: {summary}")
    return "\n".join(lines)


def _local_world_size(nproc_per_node: str) -> int:
    """torch's own count; an unknown value is torch's own ValueError, as under torchrun."""
    from torch.distributed.run import determine_local_world_size

    return determine_local_world_size(nproc_per_node)


def _hand_over(directory: str, handoff: Handoff) -> None:
    """Write the hand-off file for the workers and name it in the env they inherit."""
    os.environ[PLAN_FILE_ENV] = handoff.write(directory)
    plan = handoff.plan
    # torchrun sets OMP_NUM_THREADS=1 with a warning when it is unset; the plan sizes it per rank
    # (bootstrap sets each rank's own), so hand torchrun the first rank's value instead.
    if "OMP_NUM_THREADS" not in os.environ and plan.ranks and "OMP_NUM_THREADS" in plan.ranks[0].env:
        os.environ["OMP_NUM_THREADS"] = plan.ranks[0].env["OMP_NUM_THREADS"]


def _run(launch: WorkerLaunch) -> None:
    """torchrun's own `run`; a failure summary names the user's program, as torchrun's does."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run(launch.torch_args)
    except ChildFailedError as e:
        if not launch.program:
            raise
        raise ChildFailedError(name=launch.program, failures=e.failures) from None


def _command_line(launch: WorkerLaunch) -> list[str]:
    a = launch.torch_args
    env = [f"{k}={v}" for k, v in sorted(launch.environ.items())]
    if a.run_path:
        return [*env, "<torch run_script_path>", a.training_script, *a.training_script_args]
    if a.no_python:
        return [*env, a.training_script, *a.training_script_args]
    python = os.getenv("PYTHON_EXEC", sys.executable)
    return [*env, python, "-u", *(["-m"] if a.module else []), a.training_script, *a.training_script_args]


def __getattr__(name: str):
    """The rest of torch.distributed.run (parse_min_max_nnodes, get_args_parser, ...), so this module
    stands in for torch's wherever a program imports it as `launch`."""
    import torch.distributed.run as torch_run

    try:
        return getattr(torch_run, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


if __name__ == "__main__":
    sys.exit(main())
