"""Reading monitor JSONL logs back: step records per rank and the events, in order.

Lines that are truncated (a killed process) or corrupt (not JSON, or a field of the wrong
type) are skipped and counted, never fatal. `lost` events (records the writer could not
write, e.g. a full disk) are totalled per rank. A file that holds several runs (step numbers start over) is reported by its
last run, and that is said.
"""
from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from placement._procfs import read_bounded
from placement.errors import PlacementError
from placement.monitor.record import StepRecord


LOG_MAX = 1 << 30  # one rank's log; a week of steps at 20 ms is ~15 MB


class LogReadError(PlacementError):
    """A log path given to `placement report` cannot be read at all."""


@dataclass
class RunLog:
    steps: dict[int, list[StepRecord]] = field(default_factory=dict)  # rank -> records in step order
    events: list[dict[str, Any]] = field(default_factory=list)  # everything else, by time
    skipped: int = 0  # lines that were not a readable record
    lost: dict[int, int] = field(default_factory=dict)  # rank -> records its writer could not write
    earlier_runs: dict[int, int] = field(default_factory=dict)  # rank -> runs dropped before the last
    files: list[str] = field(default_factory=list)

    def t0(self) -> float:
        times = [e["t"] for e in self.events if isinstance(e.get("t"), (int, float))]
        times += [r[0].t - r[0].step_ms / 1e3 for r in self.steps.values() if r]
        return min(times) if times else 0.0


def expand(paths: list[str]) -> list[str]:
    """Files named, the *.jsonl files anywhere under directories named (one per node, gathered
    into a tree), and what glob patterns match (quoted, so the shell left them to us)."""
    out = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "**", "*.jsonl"), recursive=True))
            if not found:
                raise LogReadError(f"{p!r} holds no *.jsonl file; give monitor logs, e.g. placement_logs/rank0.jsonl")
            out.extend(found)
        elif not os.path.exists(p) and glob.has_magic(p):
            found = sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
            if not found:
                raise LogReadError(f"{p!r} matches no file; give monitor logs, e.g. 'logs/*/rank*.jsonl'")
            out.extend(found)
        else:
            out.append(p)
    return list(dict.fromkeys(out))


def read_logs(paths: list[str]) -> RunLog:
    log = RunLog(files=expand(paths))
    for path in log.files:
        try:
            raw = read_bounded(path, LOG_MAX)  # a FIFO or a device is refused, not waited on
        except OSError as e:
            raise LogReadError(f"cannot read log {path!r}: {e.strerror or e}") from None
        _parse(raw, log)
    for rank, recs in log.steps.items():
        recs.sort(key=lambda r: r.step)
    log.events.sort(key=lambda e: e.get("t") if isinstance(e.get("t"), (int, float)) else 0.0)
    return log


def is_number(v: Any, optional: bool = False) -> bool:
    if v is None:
        return optional
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < 1 << 63


_ROLE_NUMBERS = ("cpu_ms", "runq_ms", "nivcsw", "migrations", "minflt", "mhz")


def _step_record(d: dict) -> Optional[StepRecord]:
    """A StepRecord when every field has the type the writer gives it; None otherwise."""
    if not (is_integer(d.get("rank")) and is_integer(d.get("step")) and is_number(d.get("t")) and is_number(d.get("step_ms"))
            and all(is_number(d.get(k), optional=k not in d or k == "comm_ms") for k in ("data_ms", "comm_ms"))
            and is_number(d.get("comm_enter_t"), optional=True)
            and all(is_integer(d[k]) for k in ("comm_count", "local_rank", "probe_steps") if k in d)
            and isinstance(d.get("verdict", ""), str) and isinstance(d.get("roles", {}), dict)):
        return None
    for sample in d.get("roles", {}).values():
        if not (isinstance(sample, dict) and all(is_number(sample.get(k), optional=True) for k in _ROLE_NUMBERS)
                and is_integer(sample.get("threads", 0)) and is_integer(sample.get("span_steps", 1))
                and isinstance(sample.get("cpus", []), list) and all(is_integer(c) for c in sample.get("cpus", []))):
            return None
    try:
        return StepRecord.from_dict(d)
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


def valid_event(d: dict) -> bool:
    """Events carry a numeric time and an int (or absent) rank; a straggler event a list of dicts."""
    if not is_number(d.get("t")) or not (d.get("rank") is None or is_integer(d.get("rank"))):
        return False
    if d["type"] == "straggler":
        return isinstance(d.get("stragglers", []), list) and all(isinstance(x, dict) for x in d.get("stragglers", []))
    if d["type"] == "lost":
        return is_integer(d.get("records")) and is_integer(d.get("rank"))
    return True


def judge_line(line: bytes) -> Optional[dict]:
    """One JSONL line as a record dict (a str `type`; events checked by valid_event), or None
    when the line is corrupt and must be skipped and counted. Step fields are the caller's."""
    try:
        d = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested deeper than the parser goes
        return None
    if not isinstance(d, dict) or not isinstance(d.get("type"), str):
        return None
    if d["type"] != "step" and not valid_event(d):
        return None
    return d


def _parse(raw: bytes, log: RunLog) -> None:
    last_step: dict[int, int] = {}
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        d = judge_line(line)
        if d is None:
            log.skipped += 1
            continue
        if d["type"] != "step":
            if d["type"] == "lost":  # cumulative count: the last one written is the total
                log.lost[d["rank"]] = max(log.lost.get(d["rank"], 0), d["records"])
            log.events.append(d)
            continue
        rec = _step_record(d)
        if rec is None:
            log.skipped += 1
            continue
        rank, step = rec.rank, rec.step
        if rank in last_step and step <= last_step[rank]:
            log.earlier_runs[rank] = log.earlier_runs.get(rank, 0) + 1
            log.steps[rank] = []
        last_step[rank] = step
        log.steps.setdefault(rank, []).append(rec)
