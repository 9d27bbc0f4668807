"""`placement selftest [--nproc-per-node N] [--json]`: a short real job under placerun on this GPU
node, each check pass/fail with its evidence; exit 0 only when all pass. Without a GPU: one
line (JSON, "skipped": true), exit 0."""
from __future__ import annotations

import argparse
import json

from placement.errors import PlacementError
from placement.selftest.runner import run_selftest, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="ranks to start (default: one per visible GPU)")
    p.add_argument("--json", action="store_true", help="print only the JSON line (schema placement.selftest/1)")


def run(args: argparse.Namespace) -> int:
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise PlacementError(f"--nproc-per-node={args.nproc_per_node} is not valid; give a positive number of ranks")
    result = run_selftest(args.nproc_per_node)
    if result.skipped:
        print(json.dumps(result.to_dict()))
        return 0
    if not args.json:
        print(table(result))
    print(json.dumps(result.to_dict()))
    return 0 if result.passed else 1
