"""`placement report --json`: what the text report says, as one JSON document (schema
placement.report/1), for scripts and dashboards, as `topo`, `plan` and `doctor` give theirs."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

from placement.records.digest import StepDigest
from placement.records.parts import StepPart
from placement.report.cluster import ClusterSummary
from placement.report.logs import RANK_TABLE_MAX, RunInfo, RunLog
from placement.report.text import summaries


def job_parts_pct(log: RunLog) -> dict[str, Optional[float]]:
    """The parts of the job's steps (the reader's columns hold them: records/parts.py), summed over
    every rank's steps, as % of their summed step time; comm and CPU stall None when never read."""
    import numpy as np

    if log.from_digests:
        everyone = StepDigest.pooled(log.digests.values())
        s = everyone.summary()
        return {str(StepPart.DATA): s.data_pct, str(StepPart.COMM): s.comm_pct, str(StepPart.CPU_STALL): s.stall_pct,
                str(StepPart.COMPUTE): s.compute_pct} if everyone.steps else {str(p): None for p in StepPart}
    step = np.clip(np.nan_to_num(log.step_ms), 0.0, None)
    total = float(step.sum())
    if not len(step) or total <= 0:
        return {str(p): None for p in StepPart}
    data, comm, stall = (float(np.nansum(c)) for c in (log.data_ms, log.comm_ms, log.stall_ms))
    return {str(StepPart.DATA): 100.0 * data / total,
            str(StepPart.COMM): 100.0 * comm / total if np.isfinite(log.comm_ms).any() else None,
            str(StepPart.CPU_STALL): 100.0 * stall / total if np.isfinite(log.stall_ms).any() else None,
            str(StepPart.COMPUTE): 100.0 * (total - data - comm - stall) / total}


def _run(r: Optional[RunInfo]) -> Optional[dict[str, Any]]:
    if r is None:
        return None
    return {"number": r.number, "id": r.id or None, "job": r.job, "first_t": r.first_t if r.records else None,
            "last_t": r.last_t if r.records else None, "ranks": sorted(r.ranks), "records": r.records}


def report_document(log: RunLog, summary: ClusterSummary) -> dict[str, Any]:
    """The report of one run (log.run) as a JSON-able dict."""
    from collections import Counter

    ranks = [asdict(s) for s in summaries(log)] if len(log.ranks()) <= RANK_TABLE_MAX else []
    lost_total = sum(summary.lost_ms.values())
    return {
        "schema": "placement.report/1",
        "files": len(log.files), "skipped_lines": log.skipped, "lost_records": {str(r): n for r, n in log.lost.items()},
        "run": _run(log.run), "runs": [_run(r) for r in log.runs],
        "job": {"ranks": len(log.ranks()), "step_records": log.step_count(), "read_by_digests": log.from_digests,
                "median_step_ms": summary.median_step_ms,
                "parts_pct": job_parts_pct(log),
                # step lines whose comm part is time in flight (written before comm wait)
                "comm_in_flight_lines": log.comm_in_flight},
        "ranks": ranks,
        "held_back": {
            "judged_windows": summary.judged_windows, "job_wide_slowdowns": summary.comm_slow_windows,
            "lost_pct": 100.0 * lost_total / summary.job_ms if summary.job_ms and lost_total else 0.0,
            "lost_pct_by_cause": {c: 100.0 * ms / summary.job_ms for c, ms in summary.lost_ms.items()}
            if summary.job_ms else {},
            "holders": {kind: [asdict(h) for h in hs] for kind, hs in summary.holders.items()}},
        "stalled": [asdict(s) for s in summary.stalled],
        "nodes": [asdict(n) for n in summary.nodes],
        "events": dict(Counter(str(e.get("type")) for e in log.events)),
    }
