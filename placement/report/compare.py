"""`placement report --compare BASE NEW`: did it help? Two runs side by side (e.g. one under
`placement.policy=none`, one under `auto`): the job's step time p50/p99, its throughput, the parts
of its step, and whether the difference is beyond the noise of the runs.

The job's step: per step number, the median over its ranks of their step time (ranks of a
synchronous job wait for one another, so they agree to within the slack of the collective). The
noise test: successive steps are not independent (a slow phase lasts many steps), so the runs are
compared on the medians of blocks of BLOCK steps, by a two-sided Mann-Whitney U test (normal
approximation with tie correction; no distribution assumed); the difference is beyond the noise
when p < ALPHA. Fewer than MIN_BLOCKS blocks on either side: too few steps to tell, said so.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from placement.report.logs import LogReadError, RunLog, read_logs
from placement.report.document import job_parts_pct

BLOCK = 20  # steps per block (an exchange window by default)
MIN_BLOCKS = 5
ALPHA = 0.05


@dataclass
class Side:
    """One run's figures."""

    label: str
    run: Optional[str]
    ranks: int
    steps: int
    p50_ms: Optional[float]
    p99_ms: Optional[float]
    steps_per_s: Optional[float]
    parts_pct: dict[str, Optional[float]]


@dataclass
class Comparison:
    base: Side
    new: Side
    p50_change_pct: Optional[float]
    p99_change_pct: Optional[float]
    throughput_change_pct: Optional[float]
    blocks: tuple[int, int]
    p_value: Optional[float]  # None: too few steps to tell
    beyond_noise: Optional[bool]

    def to_dict(self) -> dict:
        return {"schema": "placement.compare/1", **asdict(self)}


def job_step_ms(log: RunLog):
    """The job's step time per step number (median over ranks), in step order, as numpy."""
    import numpy as np

    if not len(log):
        return np.zeros(0)
    order = np.lexsort((log.rank, log.step))
    steps, ms = log.step[order], log.step_ms[order]
    cut = np.flatnonzero(np.diff(steps)) + 1
    return np.array([float(np.median(g)) for g in np.split(ms, cut)])


def _percentile(values, q: float) -> Optional[float]:
    import numpy as np

    return float(np.percentile(values, q)) if len(values) else None


def side(label: str, log: RunLog) -> tuple[Side, object]:
    series = job_step_ms(log)
    mean = float(series.mean()) if len(series) else None
    return Side(label=label, run=None if log.run is None else log.run.id, ranks=len(log.ranks()), steps=len(series),
                p50_ms=_percentile(series, 50), p99_ms=_percentile(series, 99),
                steps_per_s=None if not mean else 1000.0 / mean, parts_pct=job_parts_pct(log)), series


def block_medians(series) -> list[float]:
    import numpy as np

    n = len(series) // BLOCK
    return [float(np.median(series[i * BLOCK:(i + 1) * BLOCK])) for i in range(n)]


def mann_whitney_p(a: list[float], b: list[float]) -> float:
    """Two-sided p of the Mann-Whitney U test, normal approximation with tie correction."""
    values = sorted([(v, 0) for v in a] + [(v, 1) for v in b])
    ranks = [0.0] * len(values)
    ties = 0.0
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1][0] == values[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2.0 + 1.0
        t = j - i + 1
        ties += t ** 3 - t
        i = j + 1
    n1, n2 = len(a), len(b)
    r1 = sum(r for r, (_, side_) in zip(ranks, values) if side_ == 0)
    u = r1 - n1 * (n1 + 1) / 2.0
    mean = n1 * n2 / 2.0
    n = n1 + n2
    var = n1 * n2 / 12.0 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (abs(u - mean) - 0.5) / math.sqrt(var)
    return max(0.0, min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2.0))))


def _change(base: Optional[float], new: Optional[float]) -> Optional[float]:
    return None if base is None or new is None or base == 0 else 100.0 * (new - base) / base


def compare(base_arg: str, new_arg: str) -> Comparison:
    """The two runs named (PATH or PATH@RUN: a log file, directory or glob, and which of its
    runs, read_logs' `run`), side by side; LogReadError (one line) when one cannot be read."""
    sides = []
    for arg in (base_arg, new_arg):
        path, _, run = arg.rpartition("@") if "@" in arg else (arg, "", None)
        log = read_logs([path], run=run)
        if not len(log):
            raise LogReadError(f"--compare {arg!r}: no step records to compare")
        sides.append(side(arg, log))
    (base, base_series), (new, new_series) = sides
    a, b = block_medians(base_series), block_medians(new_series)
    p = mann_whitney_p(a, b) if min(len(a), len(b)) >= MIN_BLOCKS else None
    return Comparison(base, new, _change(base.p50_ms, new.p50_ms), _change(base.p99_ms, new.p99_ms),
                      _change(base.steps_per_s, new.steps_per_s), (len(a), len(b)), p,
                      None if p is None else p < ALPHA)


def _f(v: Optional[float], digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _pct(v: Optional[float]) -> str:
    return "" if v is None else f"{v:+.1f}%"


def compare_text(c: Comparison) -> str:
    b, n = c.base, c.new
    rows = [("run", b.run or "?", n.run or "?", ""), ("ranks", str(b.ranks), str(n.ranks), ""),
            ("steps", str(b.steps), str(n.steps), ""),
            ("step p50 ms", _f(b.p50_ms), _f(n.p50_ms), _pct(c.p50_change_pct)),
            ("step p99 ms", _f(b.p99_ms), _f(n.p99_ms), _pct(c.p99_change_pct)),
            ("steps/s", _f(b.steps_per_s), _f(n.steps_per_s), _pct(c.throughput_change_pct))]
    for part in b.parts_pct:
        rows.append((f"{part} % of step", _f(b.parts_pct.get(part), 1), _f(n.parts_pct.get(part), 1), ""))
    widths = [max(len(r[i]) for r in rows + [("", "BASE", "NEW", "change")]) for i in range(4)]
    lines = [f"placement report --compare: BASE {b.label} vs NEW {n.label}",
             "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(("", "BASE", "NEW", "change"), widths)))]
    lines += ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths))).rstrip()
              for r in rows]
    if c.p_value is None:
        verdict = (f"too few steps to tell the difference from noise ({c.blocks[0]} and {c.blocks[1]} blocks of "
                   f"{BLOCK} steps; {MIN_BLOCKS} each needed)")
    else:
        verdict = (f"median step {_pct(c.p50_change_pct) or 'unchanged'}: "
                   + ("beyond" if c.beyond_noise else "within")
                   + f" the runs' noise (Mann-Whitney on medians of {BLOCK}-step blocks, {c.blocks[0]} vs "
                     f"{c.blocks[1]}: p = {c.p_value:.3g})")
    lines.append(verdict)
    return "\n".join(lines)
