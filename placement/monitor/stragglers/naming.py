"""Which of a window's straggler candidates rank 0 names: only what costs the job, and only once
it is more than one window's noise.

What
    classify (classify.py) finds every rank that entered its collectives late, with what each
    costs. Of those:
    - a candidate is material when its share of the window's cost is at least
      Thresholds.min_cost_pct of the job's step (cost.material_ranks; the job-wide slowdown
      likewise, on its own cost);
    - a rank is named once it has been a material candidate in confirm_windows consecutive
      windows and late at steady_pct of their steps (from its first late step: a slowdown may
      start inside a window), or, late at fewer, in persist_windows consecutive windows; then in
      every window after that for as long as it stays material: a rank that is named keeps being
      named only while it costs, and one window's noise names nobody;
    - a rank whose row did not reach the window (it sent nothing in time) was not judged: its
      streak and whether it is named stand as they were, neither counted on nor cleared (the
      rank that is slow is the likeliest to be late with its row);
    - a slowdown every rank shares is reported once per episode (its first confirmed window), as
      the job's with its cause, not as every rank named.
    The cost of what is named is recomputed for the ranks named (a candidate held back is not in
    it). The windows that confirmed a rank are not lost: the event that names it says from which
    step it has been a material candidate (`since_step`).

Why
    On a busy machine some rank is always a little late, and a balanced job without these rules
    gets a rank named in some of its windows (docs/monitor.md, Stragglers: what they cost).
    Steadiness is what tells a slow rank from ranks taking turns: a slow rank is late at nearly
    every step of its windows, ranks taking turns at fewer, in short runs of windows that
    persist_windows outlasts (measured: docs/monitor.md, Stragglers: what they cost).
"""
from __future__ import annotations

import dataclasses
from typing import Collection, Optional

from placement.monitor.stragglers.cost import costs_ms
from placement.monitor.stragglers.figures import StragglerReport, Thresholds


class Naming:
    """Rank 0's precision filter over consecutive judged windows (one per exchange)."""

    def __init__(self, th: Thresholds):
        self._th = th
        self._streak: dict[int, int] = {}  # rank -> consecutive material windows as a candidate
        self._since: dict[int, int] = {}  # rank -> first step of its current streak
        # rank -> (steps late, steps judged) of its last confirm_windows windows, None unknown
        self._steadiness: dict[int, list[Optional[tuple[int, int]]]] = {}
        self._named: set[int] = set()  # ranks named in the last window: named while they cost
        self._job_streak = 0  # consecutive material job-wide windows
        self.held_back = 0  # candidate windows not named (noise, or not yet confirmed): counted, not lost

    def decide(self, report: StragglerReport, first_step: int, absent: Collection[int] = ()) -> StragglerReport:
        """The report as named for the window starting at `first_step`: candidates confirmed
        and material, the job-wide slowdown on its first confirmed window, costs of those named.
        `absent`: the ranks the window was judged without (no row in time)."""
        th = self._th
        if not report.stragglers and report.job_wide is None and not self._streak and not self._named:
            # A quiet window with nobody in a streak or named (most windows of a healthy job):
            # nothing to confirm, clear or cost; the report as classify gave it
            self._job_streak = 0
            return report
        candidates = {r: s for s in report.stragglers if s.material
                      for r in (s.ranks if isinstance(s.ranks, list) else [])}
        unjudged = (self._streak.keys() | self._named) & set(absent) - candidates.keys()
        for r in list(self._streak):
            if r not in candidates and r not in unjudged:
                del self._streak[r], self._since[r], self._steadiness[r]
        for r, s in candidates.items():
            self._streak[r] = self._streak.get(r, 0) + 1
            self._since.setdefault(r, first_step)
            counts = None
            if s.steps_late is not None and s.steps_judged:
                # the streak's first window counts from its first late step: a slowdown may start inside it
                before = (s.steps_before_late or 0) if self._streak[r] == 1 else 0
                counts = (s.steps_late, s.steps_judged - before)
            self._steadiness[r] = (self._steadiness.get(r, []) + [counts])[-th.confirm_windows:]
        named = {r for r in candidates if r in self._named or self._confirmed(r)}
        self._named = named | (self._named & unjudged)
        kept = [dataclasses.replace(s, since_step=min(self._since[r] for r in s.ranks)) for s in report.stragglers
                if isinstance(s.ranks, list) and s.ranks and set(s.ranks) <= named]
        self.held_back += len(report.stragglers) - len(kept)
        out = dataclasses.replace(report, stragglers=kept, job_wide=None)
        if kept:
            if len(kept) != len(report.stragglers):
                if report.lateness_steps and all(s.lateness_ms is not None for s in kept):
                    together = costs_ms(report.lateness_steps, sorted(named))[1]
                else:  # ranks whose threads starve the collectives: their shares of its excess
                    together = sum(s.cost_ms_per_step or 0.0 for s in kept)
                out.cost_ms_per_step = together
                out.cost_pct = 100.0 * together / report.step_ms if report.step_ms else None
        else:
            out.waiting, out.cost_ms_per_step, out.cost_pct = [], None, None
        job = report.job_wide
        self._job_streak = self._job_streak + 1 if job is not None and job.cost_pct >= th.min_cost_pct else 0
        if self._job_streak == th.confirm_windows:
            out.job_wide = job
        return out

    def _confirmed(self, rank: int) -> bool:
        """Material in confirm_windows windows in a row and late at steady_pct of their steps,
        or material in persist_windows windows in a row."""
        th, streak = self._th, self._streak[rank]
        if streak < th.confirm_windows:
            return False
        if streak >= th.persist_windows:
            return True
        counts = self._steadiness[rank]
        if any(c is None for c in counts):
            return False  # how steady is not known: named on persistence alone
        return 100.0 * sum(late for late, _ in counts) >= th.steady_pct * sum(judged for _, judged in counts)

