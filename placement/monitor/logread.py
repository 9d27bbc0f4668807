"""Reading monitor JSONL logs back: step records per rank and the events, in order.

Lines that are truncated (a killed process) or corrupt are skipped and counted, never
fatal. A file that holds several runs (step numbers start over) is reported by its
last run, and that is said.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

from placement.errors import PlacementError
from placement.monitor.record import StepRecord


class LogReadError(PlacementError):
    """A log path given to `placement report` cannot be read at all."""


@dataclass
class RunLog:
    steps: dict[int, list[StepRecord]] = field(default_factory=dict)  # rank -> records in step order
    events: list[dict[str, Any]] = field(default_factory=list)  # everything else, by time
    skipped: int = 0  # lines that were not a readable record
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
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise LogReadError(f"cannot read log {path!r}: {e.strerror or e}") from None
        _parse(raw, log)
    for rank, recs in log.steps.items():
        recs.sort(key=lambda r: r.step)
    log.events.sort(key=lambda e: e.get("t") if isinstance(e.get("t"), (int, float)) else 0.0)
    return log


def _parse(raw: bytes, log: RunLog) -> None:
    last_step: dict[int, int] = {}
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError:
            log.skipped += 1
            continue
        if not isinstance(d, dict) or not isinstance(d.get("type"), str):
            log.skipped += 1
            continue
        if d["type"] != "step":
            log.events.append(d)
            continue
        try:
            rec = StepRecord.from_dict(d)
            rank, step = int(rec.rank), int(rec.step)
            float(rec.step_ms)
        except (TypeError, ValueError, KeyError, AttributeError):
            log.skipped += 1
            continue
        if rank in last_step and step <= last_step[rank]:
            log.earlier_runs[rank] = log.earlier_runs.get(rank, 0) + 1
            log.steps[rank] = []
        last_step[rank] = step
        log.steps.setdefault(rank, []).append(rec)
