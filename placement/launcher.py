"""`placerun`: torchrun with every thread of every rank placed.

    placerun [torchrun flags] [placement.KEY=VALUE ...] [--placement-config FILE] [--dry-run] SCRIPT [ARGS]

Every torchrun flag is parsed by torch's own parser and handled by torch's own `run`, so
rendezvous, elastic restarts, exit codes and signals are torchrun's. Placement adds:
the node's plan, computed once before the elastic agent starts (restarts reuse it), written
to files handed to the workers by env, and the worker entrypoint `python -u -m
placement.bootstrap <the original command>`, which binds before the user's code runs.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

from placement.errors import ConfigError, PlacementError

# A Hydra-style placement override before the script: placement.policy=exclusive, +placement.x=y.
_OVERRIDE = re.compile(r"^\+?placement\.[A-Za-z_][\w.]*=")
# An override without its =VALUE: placement.policy (a script is never named so; checked on disk too).
_OVERRIDE_WITHOUT_VALUE = re.compile(r"^\+?placement\.[A-Za-z_][\w.]*$")
# Looks like KEY=VALUE but lacks the placement. prefix (a likely typo for an override).
_BARE_KEY_VALUE = re.compile(r"^[A-Za-z_][\w.]*=")
_BOOTSTRAP_MODULE = "placement.bootstrap"


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
    if _OVERRIDE_WITHOUT_VALUE.match(ns.training_script) and not os.path.exists(ns.training_script):
        from placement.config import valid_values

        raise ConfigError(f"placement override {ns.training_script!r} has no value; write "
                          f"{ns.training_script.lstrip('+')}=VALUE ({valid_values(ns.training_script)})")
    if _BARE_KEY_VALUE.match(ns.training_script) and not os.path.exists(ns.training_script):
        raise ConfigError(f"{ns.training_script!r} is neither a training script nor a placement override; "
                          f"overrides start with placement., e.g. placement.{ns.training_script}")
    config_file, dry_run = ns.placement_config, ns.placement_dry_run
    del ns.placement_config, ns.placement_dry_run
    return PlacerunArgs(torch_args=ns, overrides=overrides, config_file=config_file, dry_run=dry_run)


def worker_command(torch_args: argparse.Namespace) -> argparse.Namespace:
    """torchrun args whose worker command is `python -u -m placement.bootstrap <original command>`."""
    a = copy.copy(torch_args)
    script, rest = a.training_script, list(a.training_script_args)
    if a.no_python and a.module:
        raise ConfigError("Don't use both the '--no-python' flag and the '--module' flag at the same time.")
    if a.run_path:  # torch runs run_path in a spawned child; bootstrap then runs the script the same way
        import placement.bootstrap

        a.training_script = os.path.abspath(placement.bootstrap.__file__)
        a.training_script_args = ["--run-path", script, *rest]
        return a
    prefix = ["--no-python"] if a.no_python else ["-m"] if a.module else []
    a.no_python, a.module = False, True
    a.training_script = _BOOTSTRAP_MODULE
    a.training_script_args = [*prefix, script, *rest]
    return a


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        pa = parse_placerun_args(argv)
        launch_args = worker_command(pa.torch_args)
        topo, plan, cfg = _plan(pa)
    except PlacementError as e:
        print(f"placerun: {e}", file=sys.stderr)
        return e.exit_code
    if pa.dry_run:
        from placement.plan import format_plan_table

        print(format_plan_table(plan))
        print("worker command: " + " ".join(_command_line(launch_args)))
        return 0
    print(concise_plan(plan), file=sys.stderr, flush=True)
    handoff = tempfile.mkdtemp(prefix="placerun-")
    try:
        _hand_over(handoff, topo, plan, cfg)
        _run(launch_args)
    finally:
        shutil.rmtree(handoff, ignore_errors=True)
    return 0


def _plan(pa: PlacerunArgs):
    """Config, this node's topology and plan: what `placement plan` prints with the same arguments."""
    from placement.config import load_config
    from placement.events import check_log_dir
    from placement.plan import plan_for_node

    cfg = load_config(pa.overrides, pa.config_file)
    check_log_dir(cfg.monitor.log_dir)  # every rank writes its event log there: fail here, not in a worker
    numa_binding = getattr(pa.torch_args, "numa_binding", None)
    if numa_binding and cfg.policy != "none":
        raise ConfigError(f"--numa-binding={numa_binding} and placement.policy={cfg.policy} would both bind the "
                          f"workers; choose one: placement.policy={numa_binding} (the same CPU sets, by "
                          "placement) or placement.policy=none (torch binds, placement monitors)")
    nproc = _local_world_size(pa.torch_args.nproc_per_node)
    topo, plan = plan_for_node(cfg, nproc)
    return topo, plan, cfg


def concise_plan(plan) -> str:
    """The launch banner: one line per local rank (role -> CPUs), then the plan's warnings.
    `placerun --dry-run` and `placement plan` print the full table with reasons."""
    from placement.cpuset import format_cpulist
    from placement.roles import ThreadRole

    lines = [f"placerun: {socket.gethostname()}: policy {plan.policy}, {len(plan.ranks)} local rank(s) "
             "(--dry-run shows the reasons)"]
    for r in plan.ranks:
        gpu = "cpu-only" if r.gpu is None else f"gpu {r.gpu.index}"
        memory = " ".join([r.memory.mode, ",".join(map(str, r.memory.nodes))]).strip()
        roles = "  ".join(f"{role.value} {format_cpulist(r.roles[role].cpus)}"
                          for role in ThreadRole if role in r.roles) or "not bound (monitor only)"
        lines.append(f"  rank {r.local_rank}  {gpu}  memory {memory}  {roles}")
    lines.extend(f"  warning: {w}" for w in plan.warnings)
    return "\n".join(lines)


def _local_world_size(nproc_per_node: str) -> int:
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(nproc_per_node)
    except ValueError as e:
        raise ConfigError(f"--nproc-per-node={nproc_per_node!r}: {e}; valid: an integer, auto, cpu, gpu, xpu") from None


def _hand_over(directory: str, topo, plan, cfg) -> None:
    """Write the plan, config and topology for the workers and point the env at them."""
    from placement import bootstrap

    files = {bootstrap.PLAN_FILE_ENV: ("plan.json", plan.to_dict()),
             bootstrap.CONFIG_FILE_ENV: ("config.json", cfg.to_dict()),
             bootstrap.TOPOLOGY_FILE_ENV: ("topology.json", topo.to_dict())}
    for env_name, (name, data) in files.items():
        path = os.path.join(directory, name)
        with open(path, "w") as f:
            json.dump(data, f)
        os.environ[env_name] = path
    planned_env = {k for r in plan.ranks for k in r.env}
    os.environ[bootstrap.KEEP_ENV_ENV] = ",".join(sorted(k for k in planned_env if k in os.environ))
    # torchrun sets OMP_NUM_THREADS=1 with a warning when it is unset; the plan sizes it per rank
    # (bootstrap sets each rank's own), so hand torchrun the first rank's value instead.
    if "OMP_NUM_THREADS" not in os.environ and plan.ranks and "OMP_NUM_THREADS" in plan.ranks[0].env:
        os.environ["OMP_NUM_THREADS"] = plan.ranks[0].env["OMP_NUM_THREADS"]


def _run(launch_args: argparse.Namespace) -> None:
    """torchrun's own main body, under torch's @record (error files, ChildFailedError summary)."""
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import run

    record(run)(launch_args)


def _command_line(a: argparse.Namespace) -> list[str]:
    if a.run_path:
        return ["<torch run_path>", a.training_script, *a.training_script_args]
    return [os.getenv("PYTHON_EXEC", sys.executable), "-u", "-m", a.training_script, *a.training_script_args]


if __name__ == "__main__":
    sys.exit(main())
