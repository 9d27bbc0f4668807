"""The checks of `placement selftest`: pure functions from what each rank of the self-test job
recorded (placement/selftest/job.py writes one evidence dict per rank) and its plan to a
pass/fail with the evidence that decided it. None = could not be judged (counts as a failure).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from placement.residence import Residence
from placement.cpuset import format_cpulist
from placement.roles import ThreadRole, role_of
from placement.topology.pci import normalize_bdf

COMM_TOLERANCE = 0.20  # comm time within 20% of the CUDA-event reference
COMM_WARMUP_STEPS = 5  # first steps left out of the comm comparison (communicator set-up)
MIN_TIMED_SHARE = 0.8  # comm time must be non-null on at least this share of the compared steps
SHORT_NULL_SHARE = 0.01  # on short steps at most this share may be null (issue: null_pct <= 1)


@dataclass
class Check:
    name: str
    passed: Optional[bool]
    evidence: dict[str, Any] = field(default_factory=dict)
    why: str = ""
    rank: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.rank, "passed": self.passed, "why": self.why,
                "evidence": self.evidence}


def _pcis(items) -> list[str]:
    return sorted(normalize_bdf(p) for p in items)


def gpus_match(nvml_pcis: Optional[list[str]], torch_pcis: list[str]) -> Check:
    """NVML's GPUs are the ones torch.cuda sees (both by PCI bus id)."""
    ev = {"nvml": None if nvml_pcis is None else _pcis(nvml_pcis), "torch": _pcis(torch_pcis)}
    if nvml_pcis is None:
        return Check("gpus_match", None, ev, "NVML could not be read (pynvml missing or no driver)")
    visible = set(ev["torch"])
    ok = bool(visible) and visible <= set(ev["nvml"])
    return Check("gpus_match", ok, ev, "every GPU torch.cuda uses is one NVML reports" if ok else
                 "torch.cuda sees GPUs NVML does not report, or none")


def rank_placement(ev: dict, plan: dict) -> Check:
    """The rank's GPU, the GPU's NUMA node and main's CPUs are the plan's."""
    gpu = (plan.get("gpu") or {}).get("pci")
    got = ev.get("gpu_pci")
    main_planned = set((plan.get("roles") or {}).get("main", {}).get("cpus", []))
    main_now = set(ev.get("main_cpus_after_steps") or [])
    evidence = {"gpu_planned": gpu, "gpu_used": got, "gpu_numa": ev.get("gpu_numa"), "numa_planned": plan.get("numa"),
                "main_planned": sorted(main_planned), "main_allowed": sorted(main_now)}
    problems = []
    if gpu is None or got is None or normalize_bdf(gpu) != normalize_bdf(got):
        problems.append("the GPU used is not the planned one")
    if ev.get("gpu_numa") is not None and ev.get("gpu_numa") >= 0 and ev["gpu_numa"] not in (plan.get("numa") or []):
        problems.append("the GPU's NUMA node is not the rank's planned node")
    if not main_planned or main_now != main_planned:
        problems.append("main's Cpus_allowed_list is not the planned set")
    return Check("rank_placement", not problems, evidence, "; ".join(problems) or "GPU, NUMA node and main's CPUs as planned")


def _threads_of(threads: list[dict], role: ThreadRole) -> list[dict]:
    """Threads the binder's own rule (roles.role_of, by name) puts in `role`."""
    return [t for t in threads if role_of(str(t.get("name", ""))) is role]


def threads_on_plan(ev: dict, plan: dict, *, when: str, kind: ThreadRole, name: str) -> Check:
    """Threads of kind `kind` (recognised by name) exist in the snapshot `when` and each one's
    Cpus_allowed_list (read back from /proc by the job) lies inside the set the plan gives
    that kind (for autograd threads: `backward`, or `other` in plans without that role)."""
    threads = _threads_of(ev.get(f"threads_{when}") or [], kind)
    role = planned_role(kind, plan)
    planned = set((plan.get("roles") or {}).get(role, {}).get("cpus", []))
    off = [t for t in threads if not t.get("cpus") or not set(t["cpus"]) <= planned]
    evidence = {"role": role, "planned": sorted(planned),
                "threads": [{"tid": t.get("tid"), "name": t.get("name"), "cpus": t.get("cpus")} for t in threads]}
    if not threads:
        return Check(name, False, evidence, f"no {kind} thread found {when.replace('_', ' ')}")
    if not planned:
        return Check(name, False, evidence, f"the plan has no CPUs for role {role}")
    return Check(name, not off, evidence, f"{len(threads)} thread(s), all on the planned CPUs" if not off else
                 f"{len(off)} of {len(threads)} thread(s) off the planned CPUs")


def planned_role(kind: ThreadRole, plan: dict) -> str:
    """The plan's role for threads of `kind`: itself, or `other` where the plan lacks it."""
    return str(kind) if str(kind) in (plan.get("roles") or {}) else str(ThreadRole.OTHER)


def main_mask_after_nccl_init(ev: dict, plan: dict) -> Check:
    """Main's mask right after NCCL's communicator init is one placement set: the rank's whole
    share (stage 1), or main's planned CPUs once the binder narrowed main on seeing NCCL's
    threads (bind/binder.py). NCCL saves the caller's mask before narrowing it to the GPU's CPUs
    and restores it at the end of init (src/init.cc, ~1001 and ~1395 in v2.28.9), so any other
    set is NCCL's (or someone's) change left in place. Comparing with the mask before init, as
    this check did, blamed NCCL for placement's own narrowing and passed whatever NCCL did
    when the binder had narrowed main first."""
    roles = plan.get("roles") or {}
    share = sorted({c for r in roles.values() for c in r.get("cpus", [])})
    main_planned = sorted((roles.get("main") or {}).get("cpus", []))
    before, after = ev.get("main_cpus_before_nccl"), ev.get("main_cpus_after_nccl")
    evidence = {"before": before, "after": after, "share": share, "main_planned": main_planned}
    if after is None:
        return Check("main_mask_after_nccl_init", None, evidence, "main's mask was not read")
    if not share:
        return Check("main_mask_after_nccl_init", None, evidence, "the plan binds nothing (policy none)")
    after = sorted(after)
    if after == share:
        return Check("main_mask_after_nccl_init", True, evidence, "the rank's share, as stage 1 set it")
    if after == main_planned:
        return Check("main_mask_after_nccl_init", True, evidence, "main's planned CPUs (placement narrowed main)")
    return Check("main_mask_after_nccl_init", False, evidence,
                 "neither the rank's share nor main's planned CPUs: changed by NCCL init and not restored")


def comm_time(ev: dict) -> Check:
    """The monitor's comm time per step against the same collectives timed by the job with CUDA
    events (start/end on the issuing stream around each blocking collective), on the job's long
    steps (64 MB all-reduces: event and launch overheads are noise)."""
    monitor = ev.get("comm_ms_monitor") or []
    reference = ev.get("comm_ms_reference") or []
    pairs = [(m, r) for m, r in list(zip(monitor, reference))[COMM_WARMUP_STEPS:] if r]
    timed = [(m, r) for m, r in pairs if m is not None]
    evidence = {"steps": len(pairs), "timed_steps": len(timed), "comm_timing": ev.get("comm_timing")}
    if not pairs:
        return Check("comm_time", None, evidence, "no reference timing was recorded")
    if len(timed) < MIN_TIMED_SHARE * len(pairs):
        return Check("comm_time", False, evidence, f"comm time null on {len(pairs) - len(timed)} of {len(pairs)} steps")
    ratios = [m / r for m, r in timed]
    median = statistics.median(ratios)
    evidence.update(median_ratio=round(median, 3), monitor_ms_median=round(statistics.median(m for m, _ in timed), 3),
                    reference_ms_median=round(statistics.median(r for _, r in timed), 3))
    if ev.get("world_size") == 1:
        # One rank: NCCL runs nothing for an in-place SUM all-reduce ("for 1 rank, out-of-place is
        # memcpy to self, and in-place is nop", ncclLaunchOneRank, NVIDIA/nccl src/enqueue.cc), so its
        # recorded durations are microseconds while the stream's span is the streams' own sync; seen on
        # an H200 (docs/benchmarks.md). Only "timed, and never longer than the stream saw" is judged.
        over = [m for m, r in timed if m > r * (1 + COMM_TOLERANCE)]
        evidence.update(world_size=1, over_steps=len(over))
        return Check("comm_time", not over, evidence,
                     f"one rank (NCCL moves no data): comm time on {len(timed)} of {len(pairs)} steps, "
                     f"{len(over)} above the stream's span" + ("" if not over else f" by over {COMM_TOLERANCE:.0%}"))
    ok = abs(median - 1.0) <= COMM_TOLERANCE
    return Check("comm_time", ok, evidence, f"median monitor/reference {median:.2f} "
                 f"({'within' if ok else 'outside'} {COMM_TOLERANCE:.0%})")


def comm_time_short_steps(ev: dict) -> Check:
    """On steps of a few ms (small all-reduces, far shorter than the watchdog's 100 ms retire
    period) the monitor's comm time is there on every step and never below what the job's own
    CUDA events saw minus their launch overhead: read before the watchdog wrote the durations,
    it used to be null or short on most of them. The reference includes the launch gap on the
    issuing stream, so only null and far-short figures are judged here, not the ratio."""
    monitor = ev.get("comm_ms_monitor_short") or []
    reference = ev.get("comm_ms_reference_short") or []
    pairs = [(m, r) for m, r in list(zip(monitor, reference))[COMM_WARMUP_STEPS:] if r]
    nulls = sum(1 for m, _ in pairs if m is None)
    evidence = {"steps": len(pairs), "null_steps": nulls,
                "step_ms_median": ev.get("step_ms_median_short")}
    if not pairs:
        return Check("comm_time_short_steps", None, evidence, "no short-step reference was recorded")
    if nulls > SHORT_NULL_SHARE * len(pairs):
        return Check("comm_time_short_steps", False, evidence, f"comm time null on {nulls} of {len(pairs)} short steps")
    return Check("comm_time_short_steps", True, evidence, f"comm time on {len(pairs) - nulls} of {len(pairs)} short steps")


def monitor_cost(ev: dict, budget_pct: float) -> Check:
    """The step hook's cost per step on the training thread against monitor.budget_pct."""
    us, step_ms = ev.get("monitor_us_per_step"), ev.get("step_ms_median")
    evidence = {"monitor_us_per_step": us, "step_ms_median": step_ms, "budget_pct": budget_pct}
    if us is None or not step_ms:
        return Check("monitor_cost", None, evidence, "the monitor's end event or the step times are missing")
    pct = us / 1e3 / step_ms * 100
    evidence["pct_of_step"] = round(pct, 4)
    ok = pct <= budget_pct
    return Check("monitor_cost", ok, evidence, f"{us:.1f} us per step, {pct:.3f}% of a {step_ms:.2f} ms step")


DEFAULT_RESIDENCE_MIN_PCT = 90.0  # monitor.residence_min_pct's default, for evidence that lacks the rank's value


def memory_residence(ev: dict) -> Check:
    """The share of the process's sampled pages, and of the pinned batch buffers' pages, on the
    planned node(s) is at least the rank's monitor.residence_min_pct; the failure names where the
    rest is. None (with the reason) when nothing could be measured: no node planned (memory
    policy none or local), or the looks could not be made."""
    got = ev.get("residence")
    min_pct = ev.get("residence_min_pct")
    min_pct = DEFAULT_RESIDENCE_MIN_PCT if min_pct is None else min_pct
    if not got:
        return Check("memory_residence", None, {"min_pct": min_pct}, "residence was not recorded")
    looks = [Residence.from_dict(d) for d in got.get("looks", [])]
    evidence = {"min_pct": min_pct, "planned": got.get("planned"), "looks": [r.describe() for r in looks],
                "null": got.get("null", [])}
    judged = [r for r in looks if r.share_pct is not None]
    if not judged:
        why = ("no node planned (memory policy none or local): nothing to judge" if not got.get("planned")
               else "; ".join(got.get("null") or ["no resident page was seen"]))
        return Check("memory_residence", None, evidence, why)
    low = [r for r in judged if r.share_pct < min_pct]

    def said(r: Residence) -> str:
        rest = ", ".join(f"{pct:.1f}% on node {node}" for node, pct in r.elsewhere().items())
        return f"{r.what} {r.share_pct:.1f}% on node {format_cpulist(r.planned)}" + (f" ({rest})" if rest else "")

    if low:
        return Check("memory_residence", False, evidence,
                     f"below {min_pct:g}%: " + "; ".join(said(r) for r in low))
    unjudged = [n.split(":", 1)[0] for n in got.get("null", [])]
    return Check("memory_residence", True, evidence, "; ".join(said(r) for r in judged) + f" (>= {min_pct:g}%)"
                 + (f"; not read: {', '.join(unjudged)}" if unjudged else ""))


def rank_checks(ev: dict, plan: dict, budget_pct: float) -> list[Check]:
    checks = [rank_placement(ev, plan),
              threads_on_plan(ev, plan, when="after_init", kind=ThreadRole.NCCL, name="nccl_threads_after_init"),
              threads_on_plan(ev, plan, when="after_steps", kind=ThreadRole.NCCL, name="nccl_threads_after_steps"),
              main_mask_after_nccl_init(ev, plan),
              comm_time(ev),
              comm_time_short_steps(ev),
              # While the loader runs: a non-persistent DataLoader's iterator joins its pt_data_pin
              # thread when it is exhausted (torch/utils/data/dataloader.py, _shutdown_workers,
              # ~1489-1491 and ~1627-1636), so a look after the loop never finds it.
              threads_on_plan(ev, plan, when="during_steps", kind=ThreadRole.PIN_MEMORY, name="pin_memory_threads"),
              threads_on_plan(ev, plan, when="after_steps", kind=ThreadRole.BACKWARD, name="backward_threads"),
              memory_residence(ev),
              monitor_cost(ev, budget_pct)]
    for c in checks:
        c.rank = ev.get("rank")
    return checks
