"""plan_for_node: discover this node (or a tree under a root dir), resolve the job's GPUs from
the environment, and plan. The one function `placement plan` and `placerun` both call, so the
plan printed is the plan applied."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

from placement.config import PlacementConfig, validate
from placement.cpuset import MAX_CPUS
from placement.errors import PlanError
from placement.plan.gpus import describe_gpus
from placement.plan.make import make_plan
from placement.plan.model import JobSpec, Plan, Shortfall
from placement.topology import discover, gpu_for_local_rank
from placement.topology.gpus import is_mig_entry, lookup_mig
from placement.topology.model import Topology
from placement.topology.nccl_xml import topo_file_for

NPROC_WORDS = ("auto", "gpu", "cpu")
# Ranks per node: every rank needs at least one CPU, and the kernel has at most MAX_CPUS.
MAX_LOCAL_RANKS = MAX_CPUS
# CUDA_VISIBLE_DEVICES values that deliberately hide every GPU or end the list.
_NO_DEVICE = ("-1", "NoDevFiles")


def plan_for_node(cfg: PlacementConfig, nproc_per_node: Union[int, str], *, root: str = "/",
                  nccl_topo_file: Optional[str] = None, within: Optional[str] = None,
                  environ: Mapping[str, str] = os.environ) -> tuple[Topology, Plan]:
    """Topology of `root` and the plan for `nproc_per_node` local ranks on it.

    nproc_per_node takes torchrun's values too: an integer, "gpu" (every visible GPU), "cpu"
    (every online CPU) or "auto" (GPUs when there are any, else CPUs).
    The NCCL topology file is the argument, else placement.nccl_topo_file, else (on the live
    system only) $NCCL_TOPO_FILE.
    """
    validate(cfg)
    topo = discover(root=root, nccl_topo_file=topo_file_for(root, nccl_topo_file, cfg.nccl_topo_file, environ=environ))
    seen = visible_gpu_indices(topo, environ, strict=cfg.strict)
    visible = seen.indices
    n = resolve_nproc(nproc_per_node, topo, visible)
    job = JobSpec(
        nproc_per_node=n,
        gpus=None if visible is None else visible[:n],
        dataloader_workers=cfg.dataloader_workers,
        visible_gpus=visible,
        within=within,
    )
    plan = make_plan(topo, job, cfg)
    plan.warnings[:0] = seen.warnings
    if seen.shortfall is not None:  # found before the planner's own: the first the plan ran through
        plan.shortfall = seen.shortfall
    return topo, plan


def resolve_nproc(value: Union[int, str], topo: Topology, visible: Optional[list[int]]) -> int:
    gpus = len(topo.gpus) if visible is None else len(visible)
    text = str(value).strip()
    if text.isdigit() and int(text) >= 1:
        if int(text) > MAX_LOCAL_RANKS:
            raise PlanError(f"nproc_per_node={text} is too many ranks for one node; valid: an integer "
                            f"1..{MAX_LOCAL_RANKS} (the kernel's CPU limit), {', '.join(NPROC_WORDS)}")
        return int(text)
    cpus = sum(1 for c in topo.cpus if c.online)
    if text == "cpu" or (text == "auto" and gpus == 0):
        return cpus
    if text in ("gpu", "auto") and gpus > 0:
        return gpus
    if text == "gpu":
        raise PlanError(f"nproc_per_node='gpu' but this machine shows no visible GPU ({describe_gpus(topo)}); "
                        "valid: an integer >= 1, auto, cpu")
    raise PlanError(f"nproc_per_node={value!r} is not valid; valid: an integer >= 1, {', '.join(NPROC_WORDS)}")


@dataclass
class VisibleGpus:
    indices: Optional[list[int]]  # None: CUDA_VISIBLE_DEVICES unset (or no GPU), every GPU by index
    warnings: list[str] = field(default_factory=list)  # the shortfall's warning included
    shortfall: Optional[Shortfall] = None


def visible_gpu_indices(topo: Topology, environ: Mapping[str, str], *, strict: bool) -> VisibleGpus:
    """The topology GPU indices the job sees, in CUDA order, from CUDA_VISIBLE_DEVICES (indices,
    UUIDs, or MIG devices standing for their parent GPU, matched by PCI bus id). None: unset,
    every GPU by index. With strict off, an entry that matches no GPU ends the list there, as CUDA
    itself does, and a warning says so. A list mixing MIG devices and GPUs is refused: a MIG
    device's rank would get the parent's CPUs while the same GPU may serve another rank whole."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if not topo.gpus:
        warn = [f"CUDA_VISIBLE_DEVICES={cvd!r} is set but no GPU was found; planning CPU-only ranks"] if cvd else []
        return VisibleGpus(None, warn)
    if cvd is None:
        return VisibleGpus(None)
    entries = [e.strip() for e in cvd.split(",")]
    migs = [e for e in entries if is_mig_entry(e)]
    mig = lookup_mig(migs) if migs else None
    visible: list[int] = []
    for position, entry in enumerate(entries):
        if entry in _NO_DEVICE or (entry == "" and position == 0 and len(entries) == 1):
            break
        if migs and not is_mig_entry(entry):
            fault = f"is a GPU among MIG devices ({', '.join(migs)}); give either MIG devices or GPUs"
            gpu = None
        else:
            gpu = gpu_for_local_rank(topo, 0, entry, mig)  # this entry alone, to tell its own fault
            fault = ("matches no MIG device" if is_mig_entry(entry) else "matches no GPU") if gpu is None else \
                f"repeats GPU {gpu.index}"
        if gpu is None or (gpu.index in visible and not is_mig_entry(entry)):
            found = f"GPUs: {_describe_with_uuid(topo)}" + (f"; {mig.describe()}" if mig is not None else "")
            problem = f"CUDA_VISIBLE_DEVICES entry {entry!r} (position {position} of {cvd!r}) {fault}; {found}"
            if strict:
                raise PlanError(problem + "; set placement.strict=false to run a degraded plan")
            short = Shortfall(problem, f"like CUDA, only the {len(visible)} GPU(s) before it are used")
            return VisibleGpus(visible, [short.warning()], short)
        visible.append(gpu.index)
    return VisibleGpus(visible)


def _describe_with_uuid(topo: Topology) -> str:
    return ", ".join(f"{g.index} ({g.pci}{', ' + g.uuid if g.uuid else ''})"
                     for g in sorted(topo.gpus, key=lambda g: g.index))
