"""`placement doctor [--root DIR] [--json]`: host checks with severity, evidence and the fix.

Exit status: 0 when no check found a problem, 1 when one did (status `warn`), 2 on bad input.
Never needs root: what it cannot read is reported as `unknown`.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from typing import Optional

from placement.bind.memory import _load_libnuma
from placement.commands.topo import nvml_note
from placement.config import load_config
from placement.doctor import facts as doctor_facts
from placement.doctor.checks import STATUSES, Check, Facts, run_checks
from placement.errors import ConfigError, PlanError
from placement.plan.make import make_plan
from placement.plan.model import JobSpec
from placement.plan.node import MAX_LOCAL_RANKS
from placement.topology import discover
from placement.topology.nccl_xml import topo_file_for

SCHEMA = "placement.doctor/1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", default="/", help="read sys/ and proc/ under DIR instead of the live host")
    parser.add_argument("--json", action="store_true", help=f"print schema {SCHEMA} as JSON")
    parser.add_argument("--nccl-topo-file", default=None, help="NCCL topology XML (clouds that hide PCI; default: $NCCL_TOPO_FILE on the live system)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="ranks to plan for the hot-core and cpuset checks (default: one per GPU, else 1)")
    parser.add_argument("overrides", nargs="*", metavar="placement.KEY=VALUE",
                        help="config overrides for the plan the checks compare with, as for placerun")


def gather(root: str = "/", *, nccl_topo_file: Optional[str] = None, nproc_per_node: Optional[int] = None,
           overrides: tuple[str, ...] | list[str] = ()) -> Facts:
    """Read every fact the checks need, once. Raises TopologyError for an unreadable root and
    ConfigError for a bad override; a plan that cannot be met is recorded, not raised."""
    if nproc_per_node is not None and not 1 <= nproc_per_node <= MAX_LOCAL_RANKS:
        raise ConfigError(f"--nproc-per-node={nproc_per_node} is not valid; valid: an integer 1..{MAX_LOCAL_RANKS}")
    cfg = load_config(overrides)
    # The same XML `placement topo` and `placement plan` read, so doctor judges the plan's machine.
    topo = discover(root, nccl_topo_file=topo_file_for(root, nccl_topo_file, cfg.nccl_topo_file))
    live = root == "/"
    gpu_ids = [g.index for g in sorted(topo.gpus, key=lambda g: g.index)]
    n = nproc_per_node or max(1, len(gpu_ids))
    # The job as doctor imagines it: every GPU of the node, one rank each, whatever this shell's
    # CUDA_VISIBLE_DEVICES says (a --root tree is not this host).
    job = JobSpec(nproc_per_node=n, gpus=(gpu_ids + [None] * n)[:n], dataloader_workers=cfg.dataloader_workers,
                  visible_gpus=gpu_ids)
    plan, plan_error = None, None
    try:  # strict: doctor names a shortfall that placerun, by default, runs through degraded
        plan = make_plan(topo, job, replace(cfg, strict=True))
    except PlanError as e:
        plan_error = str(e)
    return Facts(
        topology=topo, live=live,
        governors=doctor_facts.governors(root), turbo=doctor_facts.turbo_state(root),
        smt=doctor_facts.smt_state(root), irqs=doctor_facts.irq_affinities(root),
        interrupts=doctor_facts.interrupts(root), irqbalance=doctor_facts.irqbalance_pids(root),
        nvlink=doctor_facts.nvlink_pairs([g.pci for g in topo.gpus]) if live and len(topo.gpus) > 1 else None,
        plan=plan, plan_error=plan_error, libnuma_error=_libnuma_error() if live else None,
    )


def _libnuma_error() -> Optional[str]:
    return _load_libnuma()[1]


def report_dict(root: str, facts: Facts, checks: list[Check]) -> dict:
    counts = {s: sum(1 for c in checks if c.status == s) for s in STATUSES}
    return {"schema": SCHEMA, "root": root, "live": facts.live, "counts": counts,
            "checks": [asdict(c) for c in checks], "topology_warnings": list(facts.topology.warnings)}


def format_report(root: str, checks: list[Check]) -> str:
    counts = ", ".join(f"{sum(1 for c in checks if c.status == s)} {s}" for s in STATUSES
                       if any(c.status == s for c in checks))
    lines = [f"placement doctor: root {root}: {len(checks)} checks ({counts})",
             f"{'STATUS':8} {'SEVERITY':8} {'CHECK':17} SUMMARY"]
    for c in checks:
        lines.append(f"{c.status:8} {c.severity:8} {c.name:17} {c.summary}")
        if c.status in ("warn", "unknown", "info"):
            lines += [f"{'':35}evidence: {e}" for e in c.evidence]
        if c.fix and c.status in ("warn", "info"):
            lines.append(f"{'':35}fix: {c.fix}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    facts = gather(args.root, nccl_topo_file=args.nccl_topo_file, nproc_per_node=args.nproc_per_node,
                   overrides=args.overrides)
    note = nvml_note(facts.topology)
    if note:
        print(f"placement doctor: info: {note}", file=sys.stderr)
    checks = run_checks(facts)
    if args.json:
        json.dump(report_dict(args.root, facts, checks), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_report(args.root, checks))
    return 1 if any(c.status == "warn" for c in checks) else 0
