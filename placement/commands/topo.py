"""`placement topo`: the machine's CPU/NUMA/GPU/NIC topology, as a per-node view with a GPU x NIC
matrix, or as `placement.topology/1` JSON. Facts that could not be read are null, each with
one warning on stderr naming the file."""
from __future__ import annotations

import argparse
import json
import sys

from placement.topology import discover, gpus
from placement.topology.nccl_xml import topo_file_for
from placement.topology.render import format_topology


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", default="/", help="root dir holding sys/ and proc/ (default: /, the live system)")
    parser.add_argument("--nccl-topo-file", default=None,
                        help="NCCL topology XML whose GPU/NIC facts win over sysfs "
                             "(default: $NCCL_TOPO_FILE on the live system)")
    parser.add_argument("--json", action="store_true", help="print placement.topology/1 JSON")


def nvml_note(topo) -> str | None:
    """One line when the live system's GPUs came from PCI sysfs because NVML is unavailable."""
    if topo.root != "/" or gpus.nvml_unavailable is None:
        return None
    return f"GPUs from PCI sysfs ({len(topo.gpus)} found): NVML is unavailable: {gpus.nvml_unavailable}"


def run(args: argparse.Namespace) -> int:
    topo = discover(root=args.root, nccl_topo_file=topo_file_for(args.root, args.nccl_topo_file))
    for warning in topo.warnings:
        print(f"placement topo: warning: {warning}", file=sys.stderr)
    note = nvml_note(topo)
    if note:
        print(f"placement topo: info: {note}", file=sys.stderr)
    if args.json:
        json.dump(topo.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_topology(topo))
    return 0
