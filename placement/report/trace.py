"""`placement report --trace FILE`: the step records and events as a Chrome trace-event JSON
file (the format chrome://tracing and Perfetto open, and the PyTorch profiler writes), to
lay beside a profiler trace of the same run.

One process per node (pid), one track per rank (tid = the rank). Per step, on the rank's
track: a `step N` slice (its figures in args) holding a `data wait` slice at the step's
start (handle.watch() blocks there for the next batch), a `comm` slice from the rank's
first collective entry for the step's summed collective time (at the step's end when the
entry is not known) and a `compute` slice between them; CPU stall (main + NCCL runqueue
wait) cannot be placed in time, so it is a counter track per rank (`CPU stall ms`) and an
arg. Events (bind, tune, rollback, warning, straggler, stall) are instant events on the
track of the rank they concern. Times are wall-clock microseconds since the epoch, each
rank on its own host's clock (the profiler's traces use the same base).
Written as a stream: a million steps never sit in memory as objects.

A million steps make ~655 MB of trace, more than chrome://tracing opens: `--steps A:B` and
`--ranks LIST` (TraceFilter) keep the steps A..B of the ranks listed, and the events of those
ranks inside the time those steps span.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional, TextIO

from placement.cpuset import format_cpulist
from placement.records.parts import split_step
from placement.records.verdict import VERDICTS
from placement.report.cluster import job_wide, named_costs, stalled_ranks, straggler_ranks
from placement.report.logs import LogReadError, RunLog

TRACED_EVENTS = ("bind", "memory", "tune", "rollback", "warning", "straggler", "stall", "monitor")
_BULKY = ("plan", "figures", "env", "evidence")  # event fields left out of the trace's args


STEPS_FORM = "A:B, A: or :B with whole numbers A <= B (e.g. 1000:2000)"
RANKS_FORM = "a list of ranks and ranges (e.g. 0-7,64,100-103)"


@dataclass(frozen=True)
class TraceFilter:
    """What --trace keeps: steps first..last (None: open end), ranks as (lo, hi) ranges (None: all)."""

    first_step: Optional[int] = None
    last_step: Optional[int] = None
    ranks: Optional[tuple[tuple[int, int], ...]] = None

    def step_mask(self, steps):
        import numpy as np

        mask = np.ones(len(steps), dtype=bool)
        if self.first_step is not None:
            mask &= steps >= self.first_step
        if self.last_step is not None:
            mask &= steps <= self.last_step
        return mask

    def has_rank(self, rank: int) -> bool:
        return self.ranks is None or any(lo <= rank <= hi for lo, hi in self.ranks)

    def describe(self) -> str:
        parts = []
        if self.first_step is not None or self.last_step is not None:
            parts.append(f"steps {'' if self.first_step is None else self.first_step}:"
                         f"{'' if self.last_step is None else self.last_step}")
        if self.ranks is not None:
            parts.append("ranks " + ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.ranks))
        return " of ".join(parts) or "everything"


def parse_steps(text: str) -> tuple[Optional[int], Optional[int]]:
    """`A:B` (either side may be left open) -> (A, B). ValueError names the value and the form."""
    lo, sep, hi = text.strip().partition(":")
    try:
        if not sep or not (lo.strip() or hi.strip()):
            raise ValueError
        first = int(lo) if lo.strip() else None
        last = int(hi) if hi.strip() else None
    except ValueError:
        raise ValueError(f"{text!r} is not a step range: give {STEPS_FORM}") from None
    if (first is not None and first < 0) or (last is not None and last < 0) or \
            (first is not None and last is not None and first > last):
        raise ValueError(f"{text!r} is not a step range: give {STEPS_FORM}")
    return first, last


def parse_ranks(text: str) -> tuple[tuple[int, int], ...]:
    """"0-7,64" -> ((0, 7), (64, 64)). ValueError names the value and the form."""
    out = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            a = int(lo)
            b = int(hi) if sep else a
            if a < 0 or b < a:
                raise ValueError
            out.append((a, b))
    except ValueError:
        raise ValueError(f"{text!r} is not a rank list: give {RANKS_FORM}") from None
    return tuple(out)


def _pid_of(table: RunLog) -> dict[int, int]:
    node_pid = {node: i + 1 for i, node in enumerate(table.nodes())}
    return {r: node_pid.get(n, 0) for r, n in table.node.items()}


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3f}"


def _meta(out: TextIO, table: RunLog, pid_of: dict[int, int], ranks: list[int]) -> None:
    shown = set(ranks)
    for node, pid in sorted({n: pid_of[r] for r, n in table.node.items() if r in shown}.items(),
                            key=lambda kv: kv[1]):
        out.write(json.dumps({"name": "process_name", "ph": "M", "ts": 0, "pid": pid, "tid": 0,
                              "args": {"name": node}}) + ",\n")
        out.write(json.dumps({"name": "process_sort_index", "ph": "M", "ts": 0, "pid": pid, "tid": 0,
                              "args": {"sort_index": pid}}) + ",\n")
    for rank in ranks:
        pid = pid_of.get(rank, 0)
        out.write(json.dumps({"name": "thread_name", "ph": "M", "ts": 0, "pid": pid, "tid": rank,
                              "args": {"name": f"rank {rank}"}}) + ",\n")
        out.write(json.dumps({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": pid, "tid": rank,
                              "args": {"sort_index": rank}}) + ",\n")


def _n(v: float) -> str:
    return "null" if v != v else f"{v:.3f}"


def _selected(table: RunLog, keep: TraceFilter) -> dict:
    """rank -> the indices (a slice, or an index array) of its records the trace keeps."""
    import numpy as np

    out = {}
    for rank, sl in table.rank_slices().items():
        if not keep.has_rank(rank):
            continue
        if keep.first_step is None and keep.last_step is None:
            out[rank] = sl
            continue
        idx = sl.start + np.flatnonzero(keep.step_mask(table.step[sl]))
        if len(idx):
            out[rank] = idx
    return out


def _steps(out: TextIO, table: RunLog, pid_of: dict[int, int], selected: dict) -> int:
    written = 0
    for rank, sl in selected.items():
        pid = pid_of.get(rank, 0)
        head = f'"pid":{pid},"tid":{rank}'
        steps = table.step[sl].tolist()
        ends = table.t[sl].tolist()
        step_ms = table.step_ms[sl].tolist()
        data_ms = table.data_ms[sl].tolist()
        comm_ms = table.comm_ms[sl].tolist()
        stall_ms = table.stall_ms[sl].tolist()
        enter = table.enter_t[sl].tolist()
        verdict = table.verdict[sl].tolist()
        lines = []
        prev_end = float("-inf")
        for step, end, ms, data, comm, stall, ent, v in zip(steps, ends, step_ms, data_ms, comm_ms, stall_ms,
                                                            enter, verdict):
            # A step's wall end and its measured length come from two clocks, so end - length can
            # fall a few microseconds inside the previous step: slices of one track must not overlap
            # (viewers nest them), so the slice starts where the previous one ended.
            start = min(max(end - ms / 1e3, prev_end), end)
            prev_end = end
            span_ms = (end - start) * 1e3
            data = 0.0 if data != data else min(max(data, 0.0), span_ms)
            c = 0.0 if comm != comm else max(comm, 0.0)
            comm_start = ent if ent == ent and start <= ent <= end else end - c / 1e3
            comm_start = min(max(comm_start, start + data / 1e3), end)
            c = min(c, (end - comm_start) * 1e3)
            # The step's parts (records/parts.py), the same as the report's; the stall column is
            # already the CPU stall part, so it stays as read.
            parts = split_step(ms, data, comm, stall)
            lines.append(
                f'{{"name":"step {step}","cat":"step","ph":"X","ts":{_us(start)},"dur":{span_ms * 1e3:.3f},{head},'
                f'"args":{{"step":{step},"step_ms":{ms:.3f},"data_ms":{_n(parts.data_ms)},"comm_ms":{_n(parts.comm_ms)},'
                f'"cpu_stall_ms":{_n(stall)},"compute_ms":{_n(parts.compute_ms)},'
                f'"verdict":"{VERDICTS[v] if 0 <= v < len(VERDICTS) else "?"}"}}}},\n')
            if data > 0:
                lines.append(f'{{"name":"data wait","cat":"data","ph":"X","ts":{_us(start)},"dur":{data * 1e3:.3f},{head}}},\n')
            gap = (comm_start - start) * 1e3 - data
            if gap > 0:
                # Main ran (or waited in the runqueue to run) between its batch and its first
                # collective: compute and CPU stall, whose split the step's args give.
                lines.append(f'{{"name":"compute + CPU stall","cat":"compute","ph":"X","ts":{_us(start + data / 1e3)},'
                             f'"dur":{gap * 1e3:.3f},{head}}},\n')
            if c > 0:
                lines.append(f'{{"name":"comm","cat":"comm","ph":"X","ts":{_us(comm_start)},"dur":{c * 1e3:.3f},{head}}},\n')
            if stall == stall:
                lines.append(f'{{"name":"CPU stall ms (rank {rank})","cat":"cpu","ph":"C","ts":{_us(start)},{head},'
                             f'"args":{{"ms":{stall:.3f}}}}},\n')
            written += 1
        out.write("".join(lines))
    return written


def _event_ranks(e: dict) -> list[int]:
    kind = e.get("type")
    if kind == "straggler":
        return sorted({r for k, rs in straggler_ranks(e).items() if k != "comm-slow" for r in rs}) or \
            ([e["rank"]] if isinstance(e.get("rank"), int) else [])
    if kind == "stall":
        return stalled_ranks(e)
    return [e["rank"]] if isinstance(e.get("rank"), int) else []


def _events(out: TextIO, table: RunLog, pid_of: dict[int, int], ranks: set[int],
            span: Optional[tuple[float, float]]) -> int:
    written = 0
    for e in table.events:
        kind = e.get("type")
        t = e.get("t")
        if kind not in TRACED_EVENTS or not isinstance(t, (int, float)) or not math.isfinite(t):
            continue
        if span is not None and not span[0] <= t <= span[1]:
            continue
        args = {k: v for k, v in e.items() if k not in _BULKY and k not in ("t", "type")}
        name = kind if kind != "straggler" else "straggler: " + ", ".join(
            f"{k} {rs[:8]}" + ("..." if len(rs) > 8 else "") for k, rs in straggler_ranks(e).items()
            if k != "comm-slow")
        if kind == "straggler":
            costs = named_costs(e)
            if costs:
                name += " (cost " + ", ".join(f"{r}: {c:.1f}%" for r, c in list(costs.items())[:8]) + " of step)"
            job = job_wide(e)
            if job is not None:
                name += ("; " if name != "straggler: " else "") + f"job-wide {job.get('kind')}"
        for rank in _event_ranks(e):
            if rank not in ranks:
                continue
            out.write(json.dumps({"name": name, "cat": "placement", "ph": "i", "s": "t", "ts": round(t * 1e6, 3),
                                  "pid": pid_of.get(rank, 0), "tid": rank, "args": args}, default=str) + ",\n")
            written += 1
    return written


def select(table: RunLog, keep: TraceFilter) -> dict:
    """rank -> the indices of its records the trace keeps; LogReadError when none (checked
    before the report prints anything, so a bad selection is one line and exit 2)."""
    if not len(table):
        raise LogReadError("no step records to trace")
    selected = _selected(table, keep)
    if not selected:
        raise LogReadError(f"no step records in {keep.describe()} (the logs hold steps "
                           f"{int(table.step.min())}-{int(table.step.max())} of ranks "
                           f"{format_cpulist(table.ranks())}): nothing to trace")
    return selected


def write_trace(table: RunLog, out_path: str, keep: TraceFilter, selected: dict) -> tuple[int, int]:
    """Write the trace of `selected` (select(table, keep)); returns (steps, events) written."""
    import numpy as np

    span = None
    if keep.first_step is not None or keep.last_step is not None:
        idx = np.concatenate([np.arange(s.start, s.stop) if isinstance(s, slice) else s for s in selected.values()])
        span = (float((table.t[idx] - table.step_ms[idx] / 1e3).min()), float(table.t[idx].max()))
    pid_of = _pid_of(table)
    try:
        with open(out_path, "w", buffering=1 << 20) as out:
            out.write('{"displayTimeUnit":"ms","otherData":{"source":"placement report"},"traceEvents":[\n')
            _meta(out, table, pid_of, list(selected))
            steps = _steps(out, table, pid_of, selected)
            events = _events(out, table, pid_of, set(selected), span)
            # The list ends with a metadata record, so every record before it can end with a comma.
            out.write(json.dumps({"name": "trace_source", "ph": "M", "ts": 0, "pid": 0, "tid": 0,
                                  "args": {"name": "placement"}}) + "\n]}\n")
    except OSError as e:
        raise LogReadError(f"cannot write the trace {out_path!r}: {e.strerror or e}") from None
    return steps, events
