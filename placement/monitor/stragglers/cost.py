"""Lateness step by step, and what a late rank costs the job: pure functions over the per-rank
figures of one exchange window (monitor/stragglers/figures.py's RankFigures).

What
    What a straggler costs (`costs_ms`): per step, the job moves at the pace of its latest rank,
    so had rank r been at the median lateness of its peers, that step would have been shorter by
    r's lateness minus that of the next-latest rank (which then sets the pace), or minus the
    median, whichever is larger; 0 when r was not the latest. Its cost is the mean of that over
    the window's steps (a mean, not a median: a rank latest in half the steps costs half), so
    fixing one of two equally slow ranks is worth nothing, and the report also gives the cost of
    all late ranks together (their lateness removed at once). The cost is split by cause from the
    rank's excess over its punctual peers: CPU stall (runqueue wait), data wait, and the rest
    compute.

Who uses it
    The classifier (classify.py) and the naming (naming.py); records/words.py's `cost_words` says
    a cost in the log and the report. Which candidates are named, and when, is
    monitor/stragglers/naming.py's (precision), not this pure function's.
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Optional

from placement.records.parts import StepPart

if TYPE_CHECKING:
    from placement.monitor.stragglers.figures import RankFigures, Thresholds


# Steps measured on every rank that a lateness needs (the first exchange of a run may
# cover only the first step or two, warm-up).
MIN_COMMON_STEPS = 3


def lateness_per_step(ranks: list[RankFigures]) -> Optional[dict[int, list[float]]]:
    """How late each rank enters its collectives, after the earliest rank, at each step every
    rank measured, from each rank's own comm durations (see the module docstring): per absolute
    step, the most comm time of any rank minus its own. None when fewer than MIN_COMMON_STEPS
    steps were measured on every rank, or the ranks sent different steps."""
    if len({(r.first_step, r.last_step) for r in ranks}) != 1:
        return None  # not the same steps: nothing to compare step by step
    # the steps every rank sent (zip stops at the shortest) and measured: rank 0 runs this for
    # every window it judges, so a rank's column at a time
    steps = [comm for comm in zip(*(r.comm_steps for r in ranks)) if None not in comm]
    if len(steps) < MIN_COMMON_STEPS:
        return None  # too few steps to tell lateness from one step's noise
    longest = [max(comm) for comm in steps]
    return {r.rank: [top - comm[i] for top, comm in zip(longest, steps)] for i, r in enumerate(ranks)}


def arrival_lateness_ms(ranks: list[RankFigures]) -> Optional[dict[int, float]]:
    """Each rank's lateness_per_step, its median over the steps (robust to one slow step)."""
    per_step = lateness_per_step(ranks)
    return None if per_step is None else {rank: statistics.median(v) for rank, v in per_step.items()}


def rank_steps(per_step: dict[int, list[float]]) -> list[tuple[list[tuple[float, int]], float]]:
    """Per step: (every rank's (lateness, rank), latest first; the median lateness of the
    ranks but the latest), costs_ms's input, built once per window."""
    ranks = list(per_step)
    out = []
    # lat[1:] is sorted already: its median is its middle (rank 0 ranks every step of every
    # window in which a rank is late; statistics.median sorted each again)
    k = len(ranks) - 1
    mid, even = k // 2, k % 2 == 0
    for col in zip(*per_step.values()):  # a step's lateness of every rank, in `ranks`' order
        lat = sorted(zip(col, ranks), reverse=True)
        if not k:
            base = lat[0][0]
        elif even:
            base = (lat[mid][0] + lat[mid + 1][0]) / 2
        else:
            base = lat[mid + 1][0]
        out.append((lat, base))
    return out


def costs_ms(per_step: dict[int, list[float]], named: list[int],
             ranked: Optional[list] = None) -> tuple[dict[int, float], float]:
    """(rank -> what the job's step would have been shorter by had that rank alone been at its
    peers' median lateness, the cost of all `named` together), ms per step: the means over the
    steps of the module docstring's per-step savings. `ranked`: rank_steps(per_step), if built."""
    ranked = rank_steps(per_step) if ranked is None else ranked
    if not ranked or not named:
        return {r: 0.0 for r in named}, 0.0
    named_set = set(named)
    own = dict.fromkeys(named, 0.0)
    together = 0.0
    for lat, base in ranked:
        top, top_rank = lat[0]
        if top_rank in named_set:
            nxt = lat[1][0] if len(lat) > 1 else base
            saved = top - (nxt if nxt > base else base)
            if saved > 0.0:
                own[top_rank] += saved
            # every named rank at its peers' median: the latest of the others sets the pace
            for v, r in lat:
                if r not in named_set:
                    if top > v:
                        together += top - v
                    break
    n = len(ranked)
    return {r: c / n for r, c in own.items()}, together / n


MATERIAL_GROUPS = 32  # tie groups whose share is computed one by one; the rest are judged as one


def material_ranks(per_step: dict[int, list[float]], late: list[int], lateness: dict[int, float],
                   step_ms: float, th: Thresholds, ranked: Optional[list] = None,
                   all_late_ms: Optional[float] = None) -> set[int]:
    """The late ranks that cost the job at least th.min_cost_pct of its step. A rank's share is
    what fixing it adds to fixing every rank later than it (costs_ms of both sets), so a rank
    a little late behind a much later one costs nothing; ranks within th.late_ms of each other
    are one group, judged together, so two equally slow ranks are both named when together they
    cost (alone, each would cost nothing: the other would set the pace). `all_late_ms`:
    costs_ms(per_step, late)[1], if known (one group of all of them, most windows with a late
    rank, then costs no second pass over the steps)."""
    ranked = rank_steps(per_step) if ranked is None else ranked
    order = sorted(late, key=lambda r: -lateness[r])
    out: set[int] = set()
    fixed: list[int] = []
    before = 0.0
    groups = 0
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and lateness[order[i]] - lateness[order[j]] <= th.late_ms:
            j += 1
        groups += 1
        if groups > MATERIAL_GROUPS:
            j = len(order)  # the rest judged as one group (at scale: bounded work)
        group = order[i:j]
        after = all_late_ms if all_late_ms is not None and len(group) == len(order) else \
            costs_ms(per_step, fixed + group, ranked)[1]
        if step_ms > 0 and 100.0 * (after - before) / step_ms >= th.min_cost_pct:
            out.update(group)
        fixed += group
        before = after
        i = j
    return out


def split_cost(cost: float, data_x: float, stall_x: Optional[float], nccl_x: Optional[float] = None) -> dict[StepPart, float]:
    """A cost split by cause from the rank's excess over its punctual peers: data wait and CPU
    stall as measured, its NCCL threads' runqueue wait (inside its comm wait) as comm, all scaled
    down together when they exceed the cost; compute the rest."""
    data, stall, comm = max(0.0, data_x), max(0.0, stall_x or 0.0), max(0.0, nccl_x or 0.0)
    known = data + stall + comm
    if known > cost:
        scale = cost / known if known else 0.0
        data, stall, comm = data * scale, stall * scale, comm * scale
    out = {StepPart.CPU_STALL: round(stall, 3), StepPart.DATA: round(data, 3),
           StepPart.COMPUTE: round(max(0.0, cost - data - stall - comm), 3)}
    if comm:
        out[StepPart.COMM] = round(comm, 3)
    return out
