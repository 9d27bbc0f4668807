"""Many nodes' monitor logs read into columns: one array per figure, one entry per step record.

`placement report` on a cluster reads a million step records (1,024 ranks x 1,000 steps);
as StepRecord objects with their role dicts that is gigabytes, as columns it is ~60 MB.
Only what the cluster views use is kept: rank, step, end time, step/data/comm ms, CPU stall
(main + NCCL runqueue wait, as summary.stall_ms), first-collective entry time, verdict.
Lines are judged as logread judges them (a truncated or corrupt line is skipped and counted;
a file whose step numbers start over is reported by its last run).

Which node a rank ran on: the `host` and `node_rank` of its monitor's `start` event
(node_rank = torch elastic's GROUP_RANK, which tells apart two agents on one host), else
the directory its log file sits in (logs gathered per node into a tree).
"""
from __future__ import annotations

import os
from array import array
from dataclasses import dataclass, field
from typing import Any, Optional

from placement._procfs import read_bounded
from placement.monitor.logread import LOG_MAX, LogReadError, expand, is_integer, is_number, judge_line
from placement.monitor.record import VERDICTS

_NAN = float("nan")
_VERDICT_CODE = {v: i for i, v in enumerate(VERDICTS)}
# Columns of figures (float64); rank and step are integer columns of their own.
FIGURES = ("t", "step_ms", "data_ms", "comm_ms", "stall_ms", "enter_t")


@dataclass
class StepTable:
    """Step records as columns (numpy arrays of equal length, sorted by rank then step).
    NaN = unknown. `node` maps every rank to its node's label."""

    rank: Any
    step: Any
    t: Any  # wall clock at the end of the step (the rank's own host clock)
    step_ms: Any
    data_ms: Any
    comm_ms: Any
    stall_ms: Any
    enter_t: Any  # when the rank entered its first collective of the step
    verdict: Any  # index into record.VERDICTS
    node: dict[int, str] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)  # by time
    files: list[str] = field(default_factory=list)
    skipped: int = 0
    earlier_runs: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rank)

    def ranks(self) -> list[int]:
        import numpy as np

        return [int(r) for r in np.unique(self.rank)]

    def nodes(self) -> list[str]:
        """Node labels in the order of their lowest rank."""
        seen: dict[str, int] = {}
        for rank, node in sorted(self.node.items()):
            seen.setdefault(node, rank)
        return list(seen)

    def rank_slices(self) -> dict[int, slice]:
        """rank -> the slice of the columns holding its records."""
        import numpy as np

        if not len(self.rank):
            return {}
        cut = np.flatnonzero(np.diff(self.rank)) + 1
        starts = np.concatenate(([0], cut))
        ends = np.concatenate((cut, [len(self.rank)]))
        return {int(self.rank[s]): slice(int(s), int(e)) for s, e in zip(starts, ends)}

    def t0(self) -> float:
        import numpy as np

        times = [e["t"] for e in self.events if isinstance(e.get("t"), (int, float))]
        if len(self.t):
            times.append(float(np.nanmin(self.t - self.step_ms / 1e3)))
        return min(times) if times else 0.0


class _Columns:
    """Growing columns of one reading (array.array: 8 bytes a value, not a Python float)."""

    def __init__(self):
        self.rank = array("q")
        self.step = array("q")
        self.verdict = array("b")
        self.figures = {name: array("d") for name in FIGURES}

    def extend(self, rows: list[tuple]) -> None:
        for name, i in zip(FIGURES, range(2, 8)):
            self.figures[name].extend(r[i] for r in rows)
        self.rank.extend(r[0] for r in rows)
        self.step.extend(r[1] for r in rows)
        self.verdict.extend(r[8] for r in rows)


def _num(v: Any) -> float:
    if v is None:
        return _NAN
    if not is_number(v):
        raise TypeError("not a number")
    return float(v)


def _stall(roles: Any) -> float:
    if not isinstance(roles, dict):
        return _NAN
    total, known = 0.0, False
    for name in ("main", "nccl"):
        s = roles.get(name)
        if isinstance(s, dict) and s.get("runq_ms") is not None:
            total += _num(s["runq_ms"])
            known = True
    return total if known else _NAN


def _row(d: dict) -> tuple:
    """(rank, step, t, step_ms, data_ms, comm_ms, stall_ms, enter_t, verdict); raises on a bad record."""
    rank, step = d["rank"], d["step"]
    if not (is_integer(rank) and is_integer(step) and is_number(d["t"]) and is_number(d["step_ms"])):
        raise TypeError("rank/step/t/step_ms")
    return (rank, step, float(d["t"]), float(d["step_ms"]), _num(d.get("data_ms")), _num(d.get("comm_ms")),
            _stall(d.get("roles")), _num(d.get("comm_enter_t")), _VERDICT_CODE.get(d.get("verdict"), -1))


def _read_file(path: str, cols: _Columns, table: StepTable, node_of_file: dict[int, tuple]) -> None:
    try:
        raw = read_bounded(path, LOG_MAX)  # a FIFO or a device is refused, not waited on
    except OSError as e:
        raise LogReadError(f"cannot read log {path!r}: {e.strerror or e}") from None
    runs: dict[int, list[tuple]] = {}  # rank -> rows of its current run in this file
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        d = judge_line(line)
        if d is None:
            table.skipped += 1
            continue
        if d["type"] != "step":
            table.events.append(d)
            if d["type"] == "start" and isinstance(d.get("rank"), int) and (d.get("host") or d.get("node_rank") is not None):
                node_of_file[d["rank"]] = (d.get("host"), d.get("node_rank"))
            continue
        try:
            row = _row(d)
        except (TypeError, ValueError, KeyError):
            table.skipped += 1
            continue
        rows = runs.get(row[0])
        if rows is None:
            rows = runs[row[0]] = []
        elif row[1] <= rows[-1][1]:  # step numbers start over: a new run in the same file
            table.earlier_runs[row[0]] = table.earlier_runs.get(row[0], 0) + 1
            rows.clear()
        rows.append(row)
    for rank, rows in runs.items():
        cols.extend(rows)
        node_of_file.setdefault(rank, (None, None))


def _node_label(host: Optional[str], node_rank: Optional[int], directory: str) -> str:
    if node_rank is not None:
        return f"node {node_rank}" + (f" ({host})" if host else "")
    if host:
        return host
    return directory or "."


def read_table(paths: list[str]) -> StepTable:
    """Read every log named (files, directories searched recursively, globs)."""
    import numpy as np

    files = expand(paths)
    table = StepTable(*([None] * 9), files=files)
    cols = _Columns()
    where: dict[int, tuple] = {}  # rank -> (host, node_rank, directory)
    common = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files]) if files else ""
    for path in files:
        found: dict[int, tuple] = {}
        _read_file(path, cols, table, found)
        directory = os.path.relpath(os.path.dirname(os.path.abspath(path)), common) if common else ""
        for rank, (host, node_rank) in found.items():
            if rank not in where or where[rank][:2] == (None, None):
                where[rank] = (host, node_rank, directory if directory != "." else os.path.basename(common))
    table.node = {rank: _node_label(*w) for rank, w in where.items()}
    rank = np.frombuffer(cols.rank, dtype=np.int64) if len(cols.rank) else np.zeros(0, np.int64)
    step = np.frombuffer(cols.step, dtype=np.int64) if len(cols.step) else np.zeros(0, np.int64)
    order = np.lexsort((step, rank))
    table.rank, table.step = rank[order], step[order]
    for name in FIGURES:
        col = cols.figures[name]
        setattr(table, name, (np.frombuffer(col, dtype=np.float64) if len(col) else np.zeros(0))[order])
    table.verdict = (np.frombuffer(cols.verdict, dtype=np.int8) if len(cols.verdict) else np.zeros(0, np.int8))[order]
    table.events.sort(key=lambda e: e.get("t") if isinstance(e.get("t"), (int, float)) else 0.0)
    return table
