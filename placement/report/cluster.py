"""The cluster view of `placement report`: which ranks held the job back (by kind, for how
many windows), hung ranks first, and per-node figures, from the columns of a RunLog.

Who held the job back is what rank 0 judged at run time (its `straggler` events, one per
window that named someone, and `stall` events); the report counts them, it does not judge
again. Per-node figures pool the step records of the node's ranks (or, for logs read by their
digests, the ranks' digests: records/digest.py).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from placement.cpuset import parse_cpulist
from placement.records.digest import StepDigest
from placement.records.words import cause_first
from placement.records.parts import StepPart
from placement.records.words import KINDS, StragglerKind
from placement.report.logs import RunLog, as_dict, as_list

NAMED_PER_KIND = 8  # ranks named per kind in the summary; the rest are counted


def _int_list(v: Any) -> list[int]:
    """A list of ranks as events carry them: a list of ints, one int, or a "0-3,9" string."""
    if isinstance(v, bool):
        return []
    if isinstance(v, int):
        return [v]
    if isinstance(v, str):
        try:
            return sorted(parse_cpulist(v))
        except ValueError:
            return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


def straggler_ranks(e: dict) -> dict[str, list[int]]:
    """kind -> ranks one straggler event names: those it lists in full (`stragglers`) and, at
    scale, those it only counts by kind with their ranks in list form (`more`)."""
    out: dict[str, list[int]] = {}
    for s in as_list(e.get("stragglers")):
        if isinstance(s, dict):
            out.setdefault(str(s.get("kind")), []).extend(_int_list(s.get("ranks")))
    for kind, more in as_dict(e.get("more")).items():
        if isinstance(more, dict):
            out.setdefault(str(kind), []).extend(_int_list(more.get("ranks")))
    return {k: sorted(set(v)) for k, v in out.items()}


def stalled_ranks(e: dict) -> list[int]:
    """The ranks a `stall` event names (its `ranks`, or `stalled`, else the rank that wrote it)."""
    for key in ("ranks", "stalled"):
        if key in e:
            return _int_list(e[key])
    return _int_list(e.get("rank"))


@dataclass
class Holder:
    rank: int
    kind: str
    windows: int
    worst_late_ms: Optional[float] = None
    cost_ms: float = 0.0  # what it cost the job over its windows: cost_ms_per_step x the window's steps


@dataclass
class Stall:
    rank: int
    last_step: Optional[int]
    where: str
    t: Optional[float]
    in_collective: Optional[bool] = None  # None: not said (NCCL, or an older log)


@dataclass
class NodeFigures:
    node: str
    ranks: list[int]
    steps: int
    p50_ms: float
    p99_ms: float
    stall_pct: Optional[float]
    comm_pct: Optional[float]
    data_pct: float
    slowest_rank: int
    slowest_p50_ms: float
    straggler_windows: int  # windows in which rank 0 named one of this node's ranks


@dataclass
class ClusterSummary:
    ranks: int
    records: int
    median_step_ms: Optional[float]
    holders: dict[str, list[Holder]] = field(default_factory=dict)  # kind -> most windows first
    comm_slow_windows: int = 0  # job-wide slowdowns reported (each once per episode)
    judged_windows: int = 0  # straggler events read
    lost_ms: dict[str, float] = field(default_factory=dict)  # StepPart -> job time lost to what was named, ms
    job_ms: Optional[float] = None  # the job's time over its step records (median over ranks of their sum)
    stalled: list[Stall] = field(default_factory=list)
    nodes: list[NodeFigures] = field(default_factory=list)
    slowest: list[tuple[int, float]] = field(default_factory=list)  # (rank, p50 ms), slowest first


def job_wide(e: dict) -> Optional[dict]:
    """The job-wide slowdown a straggler event reports, if any (older logs named every rank
    `comm-slow` instead: read as such)."""
    if isinstance(e.get("job_wide"), dict):
        return e["job_wide"]
    if any(isinstance(s, dict) and s.get("kind") == StragglerKind.COMM_SLOW for s in as_list(e.get("stragglers"))):
        return {"kind": StragglerKind.COMM_SLOW, "cause": StepPart.COMM, "cost_ms_per_step": None}
    return None


def named_costs(e: dict) -> dict[int, float]:
    """rank -> what it cost the job in one straggler event's window, % of step (ranks named in full)."""
    out = {}
    for s in as_list(e.get("stragglers")):
        if isinstance(s, dict) and isinstance(s.get("cost_pct"), (int, float)):
            for r in _int_list(s.get("ranks")):
                out[r] = float(s["cost_pct"])
    return out


def _window_steps(e: dict) -> int:
    span = as_list(e.get("steps"))
    ok = len(span) == 2 and all(isinstance(v, int) for v in span)
    return span[1] - span[0] + 1 if ok else 0


def _holders(events: list[dict]) -> tuple[dict[str, list[Holder]], int, int, dict[str, float]]:
    """(kind -> holders, job-wide windows, straggler events, StepPart -> ms of job time lost to what they named)."""
    windows: Counter = Counter()
    late: dict[tuple[int, str], float] = {}
    cost: Counter = Counter()
    lost: Counter = Counter()
    comm_slow = judged = 0
    for e in events:
        if e.get("type") != "straggler":
            continue
        judged += 1
        steps = _window_steps(e)
        job = job_wide(e)
        if job is not None:
            comm_slow += 1
            if isinstance(job.get("cost_ms_per_step"), (int, float)):
                lost[str(job.get("cause"))] += job["cost_ms_per_step"] * steps
        for kind, ranks in straggler_ranks(e).items():
            if kind == StragglerKind.COMM_SLOW:
                continue
            for r in ranks:
                windows[(r, kind)] += 1
        for s in as_list(e.get("stragglers")):
            if not isinstance(s, dict) or s.get("kind") == StragglerKind.COMM_SLOW:
                continue
            for r in _int_list(s.get("ranks")):
                key = (r, str(s.get("kind")))
                if isinstance(s.get("lateness_ms"), (int, float)):
                    late[key] = max(late.get(key, 0.0), float(s["lateness_ms"]))
                if isinstance(s.get("cost_ms_per_step"), (int, float)):
                    cost[key] += s["cost_ms_per_step"] * steps
            for c, ms in as_dict(s.get("cost_by_cause")).items():
                if isinstance(ms, (int, float)):
                    lost[str(c)] += ms * steps
    by_kind: dict[str, list[Holder]] = {}
    for (rank, kind), n in windows.items():
        by_kind.setdefault(kind, []).append(Holder(rank, kind, n, late.get((rank, kind)), cost.get((rank, kind), 0.0)))
    for hs in by_kind.values():
        hs.sort(key=lambda h: (-h.cost_ms, -h.windows, -(h.worst_late_ms or 0.0), h.rank))
    order = {k: i for i, k in enumerate(KINDS)}
    return (dict(sorted(by_kind.items(), key=lambda kv: order.get(kv[0], len(order)))), comm_slow, judged,
            dict(lost))


def stall_where(e: dict) -> str:
    """Where a `stall` event (monitor/health/hang.py) says the rank is: its main thread's state and
    wait channel, its innermost Python frame, or that its exchange rows stopped; and whether
    rank 0 named it (a peer's post, or its rows) rather than the rank itself."""
    parts = []
    if e.get("in_collective") is False:
        parts.append("outside any collective (the ranks waiting in one wait for it)")
    elif e.get("in_collective") is True:
        parts.append("waiting inside a collective")
    main = e.get("main") if isinstance(e.get("main"), dict) else None
    if main:
        parts.append(f"main thread {main.get('state') or '?'} in {main.get('wchan') or '?'}")
        python = e.get("python") or next((line for line in as_list(main.get("stack"))
                                          if isinstance(line, str) and line.startswith("File")), None)
        if python:
            parts.append(f"Python at {python}")
    if e.get("how") == "rows stopped":
        parts.append(f"its exchange rows stopped arriving ({e.get('stalled_s', '?')} s after rank 0's)")
    where = ", ".join(parts) or str(e.get("where") or e.get("waiting_in") or e.get("message") or "")
    if e.get("reported_by") is not None:
        where += f" (named by rank {e['reported_by']})"
    return where


def _stalls(events: list[dict]) -> list[Stall]:
    """Ranks hung and not resumed, from `stall` events in time order (a rank's own and
    rank 0's about it: whichever says `resumed` last clears it)."""
    last: dict[int, Stall] = {}
    for e in events:
        if e.get("type") != "stall":
            continue
        where = stall_where(e)
        step = e.get("last_step")
        if e.get("phase") == "resumed":  # monitor/health/hang.py: the rank stepped again
            for r in stalled_ranks(e):
                last.pop(r, None)
            continue
        for r in stalled_ranks(e):
            inside = e.get("in_collective")
            last[r] = Stall(r, step if isinstance(step, int) else None, str(where),
                            e.get("t") if isinstance(e.get("t"), (int, float)) else None,
                            inside if isinstance(inside, bool) else None)
    # The likely cause first: outside any collective, then the lowest last step.
    return sorted(last.values(), key=lambda s: cause_first(s.in_collective, s.last_step, s.rank))


def _named_in(holders: dict[str, list[Holder]]) -> Counter:
    """rank -> windows it was named in (any kind)."""
    out: Counter = Counter()
    for hs in holders.values():
        for h in hs:
            out[h.rank] += h.windows
    return out


# How a node's ranks' steps are pooled: ranks -> NodeFigures' steps, p50_ms, p99_ms, stall_pct,
# comm_pct, data_pct.
PoolNode = Callable[[list[int]], dict[str, Any]]


def _column_figures(table: RunLog, out: ClusterSummary) -> tuple[dict[int, float], PoolNode]:
    """The job's figures from the step columns: rank -> its median step, and a node's pooling."""
    import numpy as np

    slices = table.rank_slices()
    out.median_step_ms = float(np.median(table.step_ms)) if len(table) else None
    sums = [float(table.step_ms[s].sum()) for s in slices.values()]
    out.job_ms = float(np.median(sums)) if sums else None

    def pool(ranks: list[int]) -> dict[str, Any]:
        idx = np.concatenate([np.arange(slices[r].start, slices[r].stop) for r in ranks])
        step = table.step_ms[idx]
        total = float(step.sum()) or 1e-9
        stall = table.stall_ms[idx]
        comm = table.comm_ms[idx]
        return dict(steps=int(len(idx)), p50_ms=float(np.percentile(step, 50)), p99_ms=float(np.percentile(step, 99)),
                    stall_pct=100.0 * float(np.nansum(stall)) / total if np.isfinite(stall).any() else None,
                    comm_pct=100.0 * float(np.nansum(comm)) / total if np.isfinite(comm).any() else None,
                    data_pct=100.0 * float(np.nansum(table.data_ms[idx])) / total)

    return {r: float(np.median(table.step_ms[s])) for r, s in slices.items()}, pool


def _digest_figures(table: RunLog, out: ClusterSummary) -> tuple[dict[int, float], PoolNode]:
    """The same from the ranks' digests (records/digest.py): percentiles within a bin."""
    import statistics

    digests = table.digests
    out.median_step_ms = StepDigest.pooled(digests.values()).percentile(50)
    out.job_ms = statistics.median(d.step_ms for d in digests.values()) if digests else None

    def pool(ranks: list[int]) -> dict[str, Any]:
        pooled = StepDigest.pooled(digests[r] for r in ranks)
        s = pooled.summary()
        return dict(steps=pooled.steps, p50_ms=s.p50_ms, p99_ms=s.p99_ms, stall_pct=s.stall_pct, comm_pct=s.comm_pct,
                    data_pct=s.data_pct)

    return {r: d.percentile(50) for r, d in digests.items()}, pool


def summarize_cluster(table: RunLog) -> ClusterSummary:
    out = ClusterSummary(ranks=len(table.ranks()), records=table.step_count(), median_step_ms=None)
    out.holders, out.comm_slow_windows, out.judged_windows, out.lost_ms = _holders(table.events)
    out.stalled = _stalls(table.events)
    p50, pool = (_digest_figures if table.from_digests else _column_figures)(table, out)
    out.slowest = sorted(p50.items(), key=lambda kv: -kv[1])[:NAMED_PER_KIND]
    named_in = _named_in(out.holders)
    node_ranks: dict[str, list[int]] = {}
    for r in p50:
        node_ranks.setdefault(table.node.get(r, "?"), []).append(r)
    for node in table.nodes():
        ranks = node_ranks.get(node)
        if not ranks:
            continue
        slowest = max(ranks, key=lambda r: p50[r])
        out.nodes.append(NodeFigures(node=node, ranks=ranks, **pool(ranks), slowest_rank=slowest,
                                     slowest_p50_ms=p50[slowest], straggler_windows=sum(named_in[r] for r in ranks)))
    return out


def _share(ms: float, job_ms: Optional[float]) -> str:
    return f"{100.0 * ms / job_ms:.1f}% of the job's time" if job_ms else f"{ms:.0f} ms"


def lost_line(s: ClusterSummary) -> str:
    """'named causes cost the job 6.2% of its time (cpu_stall 5.9%, compute 0.3%)', '' when none."""
    total = sum(s.lost_ms.values())
    if not total or not s.job_ms:
        return ""
    parts = ", ".join(f"{c} {100.0 * ms / s.job_ms:.1f}%" for c, ms in sorted(s.lost_ms.items(), key=lambda kv: -kv[1])
                      if ms > 0)
    return f"named causes cost the job {100.0 * total / s.job_ms:.1f}% of its time ({parts})"


def _f(v: Optional[float], digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _table(header: tuple, rows: list[tuple], left: int) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def cluster_text(s: ClusterSummary, table: RunLog, with_nodes: bool = True) -> str:
    node = table.node
    lines = []
    if s.stalled:
        lines.append(f"hung ({len(s.stalled)}):")
        for st in s.stalled:
            step = "?" if st.last_step is None else st.last_step
            lines.append(f"  rank {st.rank} ({node.get(st.rank, '?')}) last step {step}" + (f": {st.where}" if st.where else ""))
    held = sum(len(hs) for hs in s.holders.values())
    if held or s.comm_slow_windows:
        lines.append(f"held the job back ({s.judged_windows} window(s) named someone; rank 0's straggler events):")
        lost = lost_line(s)
        if lost:
            lines.append(f"  {lost}")
        for kind, hs in s.holders.items():
            shown = ", ".join(f"{h.rank} in {h.windows}" + (f" (late {h.worst_late_ms:.1f} ms)" if h.worst_late_ms else "")
                              + (f" cost {_share(h.cost_ms, s.job_ms)}" if h.cost_ms and s.job_ms else "")
                              + f" [{node.get(h.rank, '?')}]" for h in hs[:NAMED_PER_KIND])
            more = f", and {len(hs) - NAMED_PER_KIND} more rank(s)" if len(hs) > NAMED_PER_KIND else ""
            lines.append(f"  {kind:<13}{len(hs):>5} rank(s), windows each: {shown}{more}")
        if s.comm_slow_windows:
            lines.append(f"  {'job-wide':<13} {s.comm_slow_windows} slowdown(s) every rank shared (said once each): "
                         "every rank on time, the collectives slow")
    elif not s.stalled:
        lines.append("held the job back: nobody (no straggler or stall event in the logs)")
    if s.median_step_ms is not None and s.slowest:
        lines.append(f"slowest ranks by median step (job median {s.median_step_ms:.2f} ms): " + ", ".join(
            f"{r} {ms:.2f} ms [{node.get(r, '?')}]" for r, ms in s.slowest[:5]))
    if with_nodes and s.nodes:
        header = ("node", "ranks", "steps", "p50 ms", "p99 ms", "CPU stall %", "comm %", "data %",
                  "slowest rank (p50 ms)", "straggler windows")
        rows = [(n.node, str(len(n.ranks)), str(n.steps), _f(n.p50_ms, 2), _f(n.p99_ms, 2), _f(n.stall_pct),
                 _f(n.comm_pct), _f(n.data_pct), f"{n.slowest_rank} ({n.slowest_p50_ms:.2f})", str(n.straggler_windows))
                for n in s.nodes]
        lines.append("")
        lines.append(f"per node ({len(s.nodes)}):")
        lines.extend(_table(header, rows, left=1))
    return "\n".join(lines)


def event_counts(table: RunLog) -> str:
    counts = Counter(str(e.get("type")) for e in table.events)
    return "events: " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])) or "none")
