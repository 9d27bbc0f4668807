"""Which ranks hold the others back in one exchange window, and why: classify() over the window's
per-rank figures (figures.py), with what each costs (cost.py); which of them are named is
naming.py's. The method (arrival from durations each rank measures on its own clock, why a late
rank is data-, cpu- or compute-slow, and comm-slow job-wide against the baseline) is figures.py's
docstring; the comm baseline's history is kept here (next_transfer_history)."""
from __future__ import annotations

import statistics
from typing import Optional

from placement.monitor.stragglers.cost import costs_ms, lateness_per_step, material_ranks, rank_steps, split_cost
from placement.monitor.stragglers.figures import JobWide, RankFigures, Straggler, StragglerReport, Thresholds
from placement.records.words import StragglerKind
from placement.records.parts import StepPart

BASELINE_HISTORY = 50  # straggler-free windows the comm baseline is the median of


def next_transfer_history(history: list[float], candidates: StragglerReport) -> list[float]:
    """The comm baseline's history after a judged window: its collective time added when the
    window had no straggler candidate (classify's report, before naming), the last
    BASELINE_HISTORY kept."""
    if candidates.stragglers or candidates.transfer_ms is None:
        return history
    return (history + [candidates.transfer_ms])[-BASELINE_HISTORY:]


def comm_baseline(history: list[float], th: Thresholds = Thresholds()) -> Optional[float]:
    """The usual collective time: the median of the straggler-free windows so far (a median,
    not the minimum, so one lucky window does not make every later one look slow)."""
    if len(history) < th.baseline_windows:
        return None
    return statistics.median(history)


def _median(values: list[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _fmt(v: Optional[float]) -> str:
    return "?" if v is None else f"{v:.1f}"


def _pct(ms: float, step_ms: float) -> Optional[float]:
    return 100.0 * ms / step_ms if step_ms > 0 else None


def classify(ranks: list[RankFigures], baseline_transfer_ms: Optional[float] = None,
             th: Thresholds = Thresholds()) -> StragglerReport:
    """The ranks that hold the others back, with what each costs the job. Pure: same figures,
    same answer. These are candidates: monitor/stragglers/naming.py decides which are named.

    `baseline_transfer_ms`: the usual time of the collectives themselves (see
    comm_baseline), without which comm-slow is never said."""
    ranks = [r for r in ranks if r.steps > 0]
    report = StragglerReport()
    if len(ranks) < 2:
        return report
    comm = [r.comm_ms for r in ranks if r.comm_ms is not None]
    per_step = lateness_per_step(ranks)
    if per_step is None:
        return report  # no collective seen on some rank: arrivals cannot be compared
    lateness = {rank: statistics.median(v) for rank, v in per_step.items()}
    report.lateness_steps = per_step
    median_step = statistics.median(r.step_ms for r in ranks)
    report.step_ms = median_step
    limit = max(th.late_ms, th.late_frac * median_step)
    late = [r for r in ranks if lateness[r.rank] > limit]
    punctual = [r for r in ranks if lateness[r.rank] <= limit]
    report.transfer_ms = min(comm, default=None)
    if late:
        return _late_ranks(report, late, punctual, per_step, lateness, median_step, limit, th)
    transfer = report.transfer_ms
    if (transfer is not None and baseline_transfer_ms is not None and comm
            and transfer > th.comm_slow_factor * baseline_transfer_ms and transfer - baseline_transfer_ms > th.late_ms):
        excess = transfer - baseline_transfer_ms
        starved = _cpu_starved(ranks, excess, th)
        if starved:
            # The collective is slow because one rank's threads cannot run (its comm threads
            # share a busy core): that rank is cpu-slow, the link is not to blame. Two starved
            # ranks share the excess: fixing one alone would not give it all back.
            share = excess / len(starved)
            steadiness = _steadiness(_slow_collective_steps(ranks, baseline_transfer_ms, excess))
            for r, peer_stall in starved:
                peer_own = _median([p.placement_cpu_ms for p in ranks if p.rank != r.rank])
                ours = _ours(r, peer_own, r.threads_stall_ms() - (peer_stall or 0.0), th)
                report.stragglers.append(Straggler(
                    StragglerKind.CPU_SLOW, [r.rank], None,
                    f"all ranks enter together but collectives take {transfer:.1f} ms/step vs "
                    f"{baseline_transfer_ms:.1f} ms before; its main/NCCL threads wait {r.threads_stall_ms():.1f} "
                    f"ms/step in the runqueue vs {_fmt(peer_stall)} on peers{ours or ''}",
                    share, _pct(share, median_step), {StepPart.CPU_STALL: round(share, 3), StepPart.DATA: 0.0, StepPart.COMPUTE: 0.0},
                    **steadiness, by_placement=ours is not None,
                    material=(_pct(excess, median_step) or 0.0) >= th.min_cost_pct))
            report.waiting = sorted(r.rank for r in ranks if r.rank not in {s.rank for s, _ in starved})
            report.cost_ms_per_step, report.cost_pct = excess, _pct(excess, median_step)
            return report
        report.job_wide = JobWide(
            StragglerKind.COMM_SLOW, StepPart.COMM, excess, _pct(excess, median_step) or 0.0,
            f"all ranks enter within {max(lateness.values()):.1f} ms but collectives take {transfer:.1f} ms/step "
            f"vs {baseline_transfer_ms:.1f} ms before and no rank waits for a CPU: the link or network is slow")
    return report


def _late_ranks(report: StragglerReport, late: list[RankFigures], punctual: list[RankFigures],
                per_step: dict[int, list[float]], lateness: dict[int, float], median_step: float, limit: float,
                th: Thresholds) -> StragglerReport:
    """The late ranks into the report, latest first, each with its kind, cost and why, and the
    punctual ones as waiting (only when some rank is late: most windows of a healthy job have none, and rank 0 judges every
    window)."""
    first = min(punctual, key=lambda r: lateness[r.rank]) if punctual else None
    ranked = rank_steps(per_step)
    own, together = costs_ms(per_step, [r.rank for r in late], ranked)
    material = material_ranks(per_step, [r.rank for r in late], lateness, median_step, th, ranked, together)
    # the punctual peers' medians, once (at scale a window has hundreds of candidates)
    peer_data = _median([p.data_ms for p in punctual])
    peer_stall = _median([p.cpu_stall_ms for p in punctual])
    peer_nccl = _median([p.nccl_runq_ms for p in punctual])
    peer_mhz = _median([p.main_mhz for p in punctual])
    peer_cpu = _median([p.main_cpu_ms for p in punctual])
    peer_own = _median([p.placement_cpu_ms for p in punctual])
    for r in sorted(late, key=lambda r: -lateness[r.rank]):
        lat = lateness[r.rank]
        data_x = r.data_ms - (peer_data or 0.0)
        stall_x = None if r.cpu_stall_ms is None else r.cpu_stall_ms - (peer_stall or 0.0)
        nccl_x = None if r.nccl_runq_ms is None else r.nccl_runq_ms - (peer_nccl or 0.0)
        slow_core = (r.main_mhz is not None and peer_mhz is not None and r.main_mhz < th.slow_core_ratio * peer_mhz)
        arrives = f"enters its collectives {lat:.1f} ms/step after rank {first.rank if first else '?'}"
        ours = None
        if data_x >= th.explain_frac * lat and data_x >= (stall_x or 0.0):
            kind = StragglerKind.DATA_SLOW
            why = f"{arrives}; waits {r.data_ms:.1f} ms/step for data vs {_fmt(peer_data)} on peers"
        elif stall_x is not None and stall_x >= th.explain_frac * lat:
            kind = StragglerKind.CPU_SLOW
            ours = _ours(r, peer_own, stall_x, th)
            why = (f"{arrives}; its main thread waits {r.cpu_stall_ms:.1f} ms/step in the runqueue (CPU stall) "
                   f"vs {_fmt(peer_stall)} on peers{ours or ''}")
        elif nccl_x is not None and nccl_x >= th.explain_frac * lat:
            kind = StragglerKind.CPU_SLOW
            ours = _ours(r, peer_own, nccl_x, th)
            why = (f"{arrives}; its NCCL threads wait {r.nccl_runq_ms:.1f} ms/step in the runqueue "
                   f"vs {_fmt(peer_nccl)} on peers{ours or ''}")
        elif slow_core:
            kind = StragglerKind.CPU_SLOW
            why = f"{arrives}; its main thread runs at {r.main_mhz:.0f} MHz vs {peer_mhz:.0f} on peers"
        else:
            kind = StragglerKind.COMPUTE_SLOW
            on_cpu = ("" if r.main_cpu_ms is None or peer_cpu is None else
                      f"; its main thread is on a CPU {r.main_cpu_ms:.1f} ms/step vs {peer_cpu:.1f} on peers")
            why = (f"{arrives}; neither data wait ({r.data_ms:.1f} ms) nor runqueue wait "
                   f"({_fmt(r.cpu_stall_ms)} ms) explains it{on_cpu}")
        cost = own[r.rank]
        late_at = [v > limit for v in per_step[r.rank]]  # the bar its median passed, step by step
        by_cause = split_cost(cost, data_x, stall_x, nccl_x if kind == StragglerKind.CPU_SLOW else None)
        if kind == StragglerKind.CPU_SLOW and slow_core and not by_cause[StepPart.CPU_STALL]:
            by_cause = {StepPart.CPU_STALL: round(cost, 3), StepPart.DATA: 0.0, StepPart.COMPUTE: 0.0}  # its slower core
        report.stragglers.append(Straggler(kind, [r.rank], round(lat, 3), why, cost, _pct(cost, median_step), by_cause,
                                           **_steadiness(late_at), by_placement=ours is not None,
                                           material=r.rank in material))
    report.waiting = sorted(p.rank for p in punctual)
    report.cost_ms_per_step, report.cost_pct = together, _pct(together, median_step)
    return report


def _ours(r: RankFigures, peer: Optional[float], stall_x: float, th: Thresholds) -> Optional[str]:
    """Never blame the rank for us: when placement's own threads took more CPU on this rank than
    on its peers (`peer`: their median) by at least explain_frac of the runqueue wait it is blamed
    for (`stall_x`, its excess over the peers), the words that say so; None otherwise (or where
    not measured)."""
    if r.placement_cpu_ms is None or stall_x <= 0:
        return None
    own_x = r.placement_cpu_ms - (peer or 0.0)
    if own_x < th.explain_frac * stall_x:
        return None
    return (f"; placement's own threads took {r.placement_cpu_ms:.1f} ms/step of CPU on it vs {_fmt(peer)} on peers, "
            f"{min(100.0, 100.0 * own_x / stall_x):.0f}% of that wait: placement's cost, not the job's "
            f"(placement.monitor.budget_pct)")


def _steadiness(late_at: list[bool]) -> dict[str, int]:
    """Straggler's steps_late, steps_judged and steps_before_late from whether it was late at
    each step measured on every rank."""
    return {"steps_late": sum(late_at), "steps_judged": len(late_at),
            "steps_before_late": next((i for i, late in enumerate(late_at) if late), len(late_at))}


def _slow_collective_steps(ranks: list[RankFigures], baseline_ms: float, excess_ms: float) -> list[bool]:
    """Per step measured on every rank, whether its collectives took at least half the window's
    excess over the baseline: a step's collective time is the least comm time of any rank (the
    one that waited for nobody), as the window's transfer_ms is of the means."""
    return [min(comm) - baseline_ms >= 0.5 * excess_ms
            for comm in zip(*(r.comm_steps for r in ranks)) if all(c is not None for c in comm)]


def _cpu_starved(ranks: list[RankFigures], excess_ms: float, th: Thresholds) -> list[tuple[RankFigures, Optional[float]]]:
    """Ranks whose runqueue wait above their peers' explains a share of the collectives' excess time
    (with the peers' median wait), fewest first: when every rank is starved, nobody stands out."""
    out = []
    for r in ranks:
        stall = r.threads_stall_ms()
        peer = _median([p.threads_stall_ms() for p in ranks if p.rank != r.rank])
        if stall is not None and stall - (peer or 0.0) >= th.explain_frac * excess_ms:
            out.append((r, peer))
    return out if len(out) < len(ranks) else []
