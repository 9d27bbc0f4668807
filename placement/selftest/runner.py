"""Run the self-test: skip without a GPU, else launch job.py under placerun, judge, report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Optional

from placement.config import BUDGET_PCT
from placement.errors import PlacementError
from placement.selftest.checks import Check, gpus_match, rank_checks

SCHEMA = "placement.selftest/1"
JOB_TIMEOUT_S = 900.0


@dataclass
class SelftestResult:
    skipped: bool
    reason: str = ""
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.skipped and bool(self.checks) and all(c.passed is True for c in self.checks)

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "skipped": self.skipped, "passed": self.passed, "reason": self.reason,
                "checks": [c.to_dict() for c in self.checks]}


def gpu_absent_reason() -> Optional[str]:
    """Why this node cannot run the self-test, None when it can."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        return f"torch cannot be imported ({e})"
    if not torch.cuda.is_available():
        return f"no NVIDIA GPU visible to torch {torch.__version__} (torch.cuda.is_available() is False)"
    if not dist.is_nccl_available():
        return "this torch build has no NCCL"
    return None


def job_command(nproc: int, out: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "placement.launcher", "--standalone", "--nproc-per-node", str(nproc),
            f"placement.monitor.log_dir={os.path.join(out, 'placerun_logs')}",
            "-m", "placement.selftest.job", "--out", out, "--steps", str(steps)]


def evaluate(evidence: list[dict], nproc: int, budget_pct: float) -> list[Check]:
    """All checks over the ranks' evidence (rank 0 carries the node-wide GPU lists)."""
    by_rank = {e.get("local_rank"): e for e in evidence}
    checks = []
    rank0 = next((e for e in evidence if e.get("rank") == 0), None)
    if rank0 is not None:
        checks.append(gpus_match(rank0.get("nvml_gpus"), rank0.get("torch_gpus") or []))
    for local_rank in range(nproc):
        ev = by_rank.get(local_rank)
        if ev is None:
            checks.append(Check("rank_ran", False, {}, f"local rank {local_rank} wrote no evidence", rank=local_rank))
            continue
        if not ev.get("plan"):
            checks.append(Check("plan", False, {}, "the rank had no placement session (not started by placerun?)",
                                rank=ev.get("rank")))
            continue
        checks.extend(rank_checks(ev, ev["plan"], budget_pct))
    return checks


def run_selftest(nproc: Optional[int], steps: int = 100, budget_pct: float = BUDGET_PCT) -> SelftestResult:
    reason = gpu_absent_reason()
    if reason is not None:
        return SelftestResult(True, reason)
    import torch

    n = nproc or torch.cuda.device_count()
    if n > torch.cuda.device_count():
        raise PlacementError(f"--nproc-per-node={n} is more than the {torch.cuda.device_count()} GPU(s) torch sees; "
                             f"give 1 to {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="placement-selftest-") as out:
        env = dict(os.environ, TORCH_NCCL_ENABLE_TIMING="1")  # durations in the flight recorder
        try:
            proc = subprocess.run(job_command(n, out, steps), env=env, capture_output=True, text=True,
                                  timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return SelftestResult(False, "job", [Check("job", False, {}, f"the job did not end in {JOB_TIMEOUT_S:.0f} s")])
        evidence = []
        for name in sorted(os.listdir(out)):
            if name.startswith("rank") and name.endswith(".json"):
                with open(os.path.join(out, name)) as f:
                    evidence.append(json.load(f))
    checks = [Check("job", proc.returncode == 0, {"exit_code": proc.returncode, "stderr_tail": proc.stderr[-1500:]},
                    "the job under placerun exited 0" if proc.returncode == 0 else "the job failed")]
    checks.extend(evaluate(evidence, n, budget_pct))
    return SelftestResult(False, "", checks)


def table(result: SelftestResult) -> str:
    rows = [("check", "rank", "result", "evidence")]
    for c in result.checks:
        verdict = "pass" if c.passed is True else "FAIL" if c.passed is False else "unknown"
        rows.append((c.name, "-" if c.rank is None else str(c.rank), verdict, c.why))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 8)
    return "\n".join(lines)
