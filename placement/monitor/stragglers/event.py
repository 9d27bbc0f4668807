"""One window's judgement as rank 0 writes it: the ranks' rows judged (classify.py, at any
number of ranks) and the `straggler` event and log lines that say it.

What
    `judge_rows` turns the rows rank 0 took for one exchange into RankFigures and a
    StragglerReport. Up to TRIAGE_ABOVE ranks every row is classified; beyond, a vectorised
    pass over the per-step comm times (the same lateness as cost.py's arrival_lateness_ms) finds
    the candidates, and classify judges them against an even sample of PEER_SAMPLE punctual
    ranks. `compact` keeps the NAMED costliest stragglers in full and counts the rest by kind,
    so an event's size does not grow with the job; `straggler_event` and `straggler_lines` are
    its fields and its log lines.

Why here
    Pure functions of the rows: no store, no thread, no clock. crossrank/exchange.py takes the
    rows from the store and hands them in; the monitor writes what comes out.

Cost
    Linear in the ranks that sent (numpy), plus classify over at most 4 x TRIAGE_ABOVE
    candidates and PEER_SAMPLE peers (benchmarks/exchange_scale.py times it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from placement.cpuset import format_cpulist
from placement.monitor.stragglers.classify import classify
from placement.monitor.stragglers.cost import MIN_COMMON_STEPS
from placement.monitor.stragglers.figures import FIELDS, RankFigures, StragglerReport, Thresholds
from placement.records.words import cost_words

TRIAGE_ABOVE = 512  # ranks beyond which classify sees candidates and a sample of peers
PEER_SAMPLE = 256  # punctual ranks classify compares candidates with, at scale
NAMED = 8  # stragglers an event names in full; the rest are counted by kind
LISTED = 64  # ranks beyond which an event's rank lists are written in range form


@dataclass(frozen=True)
class WindowJudgement:
    """Rank 0's judgement of one window: what the exchange's collect (and submit, close) return."""

    report: StragglerReport
    figures: list  # RankFigures of every rank judged
    nodes: dict  # rank -> node rank (None where a row did not say)
    ranks_judged: int
    missing: list  # ranks that sent nothing in time
    hosts: dict = field(default_factory=dict)  # rank -> hostname, of the ranks in `nodes`




_FIELD_AT = {name: i for i, name in enumerate(FIELDS)}  # a row's column of each of FIELDS


def _lateness(rows, slots: int):
    """Per-rank lateness (ms), vectorised as stragglers/cost.py arrival_lateness_ms: per step, the most
    comm time of any rank minus its own (durations on each rank's own clock: no skew), median
    over the steps every rank measured. None when not comparable."""
    import numpy as np

    f = _FIELD_AT
    if len(np.unique(rows[:, f["first_step"]])) != 1 or len(np.unique(rows[:, f["last_step"]])) != 1:
        return None
    comm = rows[:, len(FIELDS):len(FIELDS) + slots]
    full = np.isfinite(comm).all(axis=0)
    if int(full.sum()) < MIN_COMMON_STEPS:
        return None
    cols = comm[:, full]
    return np.median(cols.max(axis=0) - cols, axis=1)


def judge_rows(rows, node_of: dict[int, Optional[int]], slots: int, baseline_ms: Optional[float], th: Thresholds,
               name: Callable[[StragglerReport], StragglerReport] = lambda report: report):
    """(figures judged, report, {rank: node_rank} of the ranks named) from one window's rows (an
    array, a rank's RankFigures.to_row(slots) per row) and where each rank runs (`node_of`);
    `name` picks which candidates are named (the exchange's Naming), before the report is compacted."""
    f = _FIELD_AT
    # the ranks with steps are picked out only at scale: below it, classify leaves out the others itself
    active = rows if len(rows) <= TRIAGE_ABOVE else rows[rows[:, f["steps"]] > 0]
    if len(active) <= TRIAGE_ABOVE:
        figures = [RankFigures.from_row(r) for r in rows.tolist()]
        report = compact(name(classify(figures, baseline_ms, th)))
        return figures, report, _named_nodes(report, node_of)
    import numpy as np

    lat = _lateness(active, slots)
    if lat is None:
        pick = np.arange(min(len(active), PEER_SAMPLE))
    else:
        limit = max(th.late_ms, th.late_frac * float(np.median(active[:, f["step_ms"]])))
        late = np.flatnonzero(lat > 0.5 * limit)
        late = late[np.argsort(-lat[late])][:4 * TRIAGE_ABOVE]
        punctual = np.flatnonzero(lat <= 0.5 * limit)
        sample = punctual[np.linspace(0, len(punctual) - 1, min(PEER_SAMPLE, len(punctual))).astype(int)] \
            if len(punctual) else punctual
        entries = active[:, len(FIELDS):len(FIELDS) + slots]
        earliest = np.argmax(np.where(np.isfinite(entries), entries, -np.inf), axis=0)  # waited longest
        comm = active[:, f["comm_ms"]]
        fastest = [int(np.nanargmin(comm))] if np.isfinite(comm).any() else []
        pick = np.unique(np.concatenate([late, sample, earliest, fastest]).astype(int))
    figures = [RankFigures.from_row(active[i].tolist()) for i in pick]
    report = name(classify(figures, baseline_ms, th))
    all_ranks = [int(r) for r in active[:, f["rank"]]]
    if report.stragglers:
        named = set(report.names())
        report.waiting = [r for r in all_ranks if r not in named]
    report = compact(report)
    return figures, report, _named_nodes(report, node_of)


def _named_nodes(report: StragglerReport, node_of: dict[int, Optional[int]]) -> dict[int, Optional[int]]:
    return {r: node_of.get(r) for s in report.stragglers for r in (s.ranks if isinstance(s.ranks, list) else [])}


def compact(report: StragglerReport) -> StragglerReport:
    """The report as an event carries it at any W: the NAMED worst stragglers in full (costliest
    first), the rest counted by kind (`more`), long rank lists in range form."""
    if not report.stragglers and len(report.waiting) <= LISTED:
        return report  # nothing to compact: most windows of a healthy job (rank 0 judges every one)
    singles = sorted(report.stragglers, key=lambda s: (-(s.cost_ms_per_step or 0.0), -(s.lateness_ms or 0.0)))
    more: dict[str, dict] = {}
    for s in singles[NAMED:]:
        m = more.setdefault(str(s.kind), {"count": 0, "ranks": []})
        m["count"] += len(s.ranks)
        m["ranks"].extend(s.ranks)
    for m in more.values():
        m["ranks"] = format_cpulist(m["ranks"])
    waiting = format_cpulist(report.waiting) if len(report.waiting) > LISTED else report.waiting
    return dataclasses.replace(report, stragglers=singles[:NAMED], more=more, waiting=waiting)


def named_ranks(v: WindowJudgement) -> list[tuple[int, str, Optional[float], Optional[str]]]:
    """(rank, kind, cost % of the job's step, host) of each rank a window names a straggler."""
    return [(r, str(s.kind), s.cost_pct, v.hosts.get(r)) for s in v.report.stragglers
            if isinstance(s.ranks, list) for r in s.ranks]


def straggler_event(v: WindowJudgement) -> dict[str, Any]:
    """The fields of rank 0's `straggler` event for one window (figures of the ranks named)."""
    report, figures = v.report, v.figures
    steps = [f for f in figures if f.steps]
    first = min((f.first_step for f in steps), default=0)
    last = max((f.last_step for f in steps), default=0)
    named = set(report.names()) if all(isinstance(s.ranks, list) for s in report.stragglers) else \
        {r for s in report.stragglers if isinstance(s.ranks, list) for r in s.ranks}
    fields = {"steps": [first, last], **report.to_dict()}
    fields["figures"] = {str(f.rank): {"step_ms": round(f.step_ms, 3), "data_ms": round(f.data_ms, 3),
                                       "comm_ms": None if f.comm_ms is None else round(f.comm_ms, 3),
                                       "stall_ms": None if f.cpu_stall_ms is None else round(f.cpu_stall_ms, 3)}
                         for f in steps if f.rank in named or len(steps) <= NAMED}
    nodes = {str(r): n for r, n in (v.nodes or {}).items() if n is not None}
    if nodes:
        fields["nodes"] = nodes
    if v.hosts:
        fields["hosts"] = {str(r): h for r, h in v.hosts.items()}
    fields["ranks_judged"] = v.ranks_judged
    if v.missing:
        fields["missing"] = format_cpulist(v.missing)
    return fields


def straggler_lines(report: StragglerReport, steps: list[int], hosts: dict[int, str]) -> list[str]:
    """The log lines of one judged window: a line per straggler named (its cost first), one per
    kind counted at scale, one for a job-wide slowdown."""
    first, last = steps
    out = []
    for s in report.stragglers:
        on = sorted({hosts[r] for r in s.ranks if r in hosts}) if isinstance(s.ranks, list) else []
        cost = cost_words(s.cost_ms_per_step, s.cost_pct, s.cost_by_cause)
        out.append(f"placement: straggler {s.kind} rank(s) {s.ranks}{' on ' + ', '.join(on) if on else ''} "
                   f"steps {first}-{last}: {cost + '; ' if cost else ''}{s.why}")
    for kind, more in report.more.items():
        out.append(f"placement: straggler {kind}: {more['count']} more rank(s) steps {first}-{last}: {more['ranks']}")
    job = report.job_wide
    if job is not None:
        out.append(f"placement: job-wide {job.kind} steps {first}-{last}: "
                   f"{cost_words(job.cost_ms_per_step, job.cost_pct, {job.cause: job.cost_ms_per_step})}; {job.why}")
    return out
