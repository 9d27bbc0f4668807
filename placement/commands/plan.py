"""`placement plan`: the per-rank, per-role CPU plan for a topology tree (default: this machine),
as a table with reasons or as `placement.plan/1` JSON. On the live machine it is exactly the plan
placerun applies with the same arguments (both call placement.plan.plan_for_node)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from placement.config import EnvSettings
from placement.plan.node import plan_for_node
from placement.plan.table import format_plan_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", default="/", help="root dir holding sys/ and proc/ (default: /, the live system)")
    parser.add_argument("--nccl-topo-file", default=None, help="NCCL topology XML (default: $NCCL_TOPO_FILE on the live system)")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                        help="local ranks: an integer, or gpu, cpu, auto as for torchrun (default: 1)")
    parser.add_argument("--policy", default=None, help="shorthand for placement.policy=P "
                        "(auto, node, socket, exclusive, core-complex, none)")
    parser.add_argument("--placement-config", default=None, metavar="FILE", help="YAML placement config file")
    parser.add_argument("--json", action="store_true", help="print placement.plan/1 JSON instead of the table")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. placement.policy=exclusive placement.smt=use")


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.policy is not None:
        overrides.append(f"placement.policy={args.policy}")
    cfg = EnvSettings.read(os.environ).load(overrides, args.placement_config)  # as placerun reads them
    _, plan = plan_for_node(cfg, args.nproc_per_node, root=args.root, nccl_topo_file=args.nccl_topo_file)
    if args.json:
        json.dump(plan.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_plan_table(plan))
    return 0
