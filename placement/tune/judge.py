"""Was an action worth keeping? The median step time of the first whole window after it
took force, against the quiet baseline (the median of the quiet windows' medians), with a
noise band measured from those quiet windows; and how long to back off after an action
that was not.

Why not against the window that triggered it: that window was chosen for looking bad, so
any later window tends to look better (regression to the mean) and the verdict leans to
"keep". Against the quiet baseline: a move is kept when the step is back at the quiet
level (within the band), or, when it is not, when it beat the trouble it was made for by
more than the band (a partial fix; the trigger window's level stands for the trouble).
Before any quiet window was seen, only the second test applies.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from placement.tune.window import WindowStats

# Quiet-window medians kept for the noise band.
QUIET_WINDOWS_KEPT = 8
# Between-window noise is estimated once this many quiet windows were seen.
MIN_QUIET_FOR_BAND = 3
# The band is this many times the typical relative change between two quiet windows
# (about two standard deviations for normal noise), and at least BAND_SE standard errors of
# the difference of two quiet windows' medians.
BAND_SPREAD = 3.0
BAND_SE = 2.0
# Before any quiet window was seen (trouble from the first steps on).
DEFAULT_NOISE_PCT = 10.0


class NoiseBand:
    """How much the median step time moves between windows when nothing is done, measured
    from quiet windows only: the windows an action is judged on are disturbed by definition."""

    def __init__(self) -> None:
        self._medians: deque[float] = deque(maxlen=QUIET_WINDOWS_KEPT)
        self._median_se: deque[float] = deque(maxlen=QUIET_WINDOWS_KEPT)

    def add_quiet(self, stats: WindowStats) -> None:
        self._medians.append(stats.median_ms)
        self._median_se.append(stats.median_se_pct())

    def baseline_ms(self) -> float | None:
        """The usual median step time when nothing is wrong; None before any quiet window."""
        return statistics.median(self._medians) if self._medians else None

    def pct(self) -> float:
        if not self._medians:
            return DEFAULT_NOISE_PCT
        within = BAND_SE * math.sqrt(2.0) * statistics.median(self._median_se)
        m = list(self._medians)
        if len(m) < MIN_QUIET_FOR_BAND:
            return within
        # The typical change between two windows from their deviations from the baseline:
        # the median of those ignores one window in three far off (a level shift no rule
        # recognised, e.g. a co-runner's first window before its threads were seen), where the
        # median of consecutive changes, with three windows the mean of two, would widen the
        # band to that shift and keep every later action from being kept. For independent
        # windows a change between two is sqrt(2) times a deviation from the centre.
        base = statistics.median(m)
        deviations = [100.0 * abs(x - base) / base for x in m] if base > 0 else [0.0]
        return max(within, BAND_SPREAD * math.sqrt(2.0) * statistics.median(deviations))


@dataclass(frozen=True)
class Verdict:
    keep: bool
    before_ms: float  # the trigger window's median (the trouble the action was made for)
    after_ms: float
    gain_pct: float  # > 0: the step got faster than in the trigger window
    noise_pct: float
    why: str
    quiet_ms: float | None = None  # the quiet baseline it was judged against

    def effect(self) -> dict[str, float | None]:
        return {"before_median_ms": round(self.before_ms, 3), "after_median_ms": round(self.after_ms, 3),
                "gain_pct": round(self.gain_pct, 2), "noise_pct": round(self.noise_pct, 2),
                "quiet_median_ms": None if self.quiet_ms is None else round(self.quiet_ms, 3)}


def judge(quiet_ms: float | None, trigger: WindowStats, after: WindowStats, noise_pct: float,
          min_gain_pct: float) -> Verdict:
    """Keep when the median step of the window after the action is back at the quiet level
    (within noise_pct + min_gain_pct of it), or beat the trigger window's by more than that."""
    b, a = trigger.median_ms, after.median_ms
    gain = 100.0 * (b - a) / b if b > 0 else 0.0
    need = noise_pct + min_gain_pct
    quiet = f", quiet {quiet_ms:.2f} ms" if quiet_ms is not None else ""
    if quiet_ms is not None and a <= quiet_ms * (1.0 + need / 100.0) and gain > noise_pct:
        why = f"median step {b:.2f} -> {a:.2f} ms ({gain:+.1f}%), back within {need:.1f}% of quiet {quiet_ms:.2f} ms"
        return Verdict(True, b, a, gain, noise_pct, why, quiet_ms)
    if gain > need:
        why = f"median step {b:.2f} -> {a:.2f} ms ({gain:+.1f}%, beyond the {need:.1f}% needed{quiet})"
        return Verdict(True, b, a, gain, noise_pct, why, quiet_ms)
    verdict = "worse" if gain < -noise_pct else "no gain"
    why = f"{verdict}: median step {b:.2f} -> {a:.2f} ms ({gain:+.1f}%, {need:.1f}% needed{quiet})"
    return Verdict(False, b, a, gain, noise_pct, why, quiet_ms)


class Backoff:
    """Per key (rule, role): after the n-th revert in a row the key waits min(2**n, cap) windows."""

    def __init__(self, cap_windows: int) -> None:
        self.cap = cap_windows
        self._reverts: dict[tuple[str, str], int] = {}
        self._until: dict[tuple[str, str], int] = {}

    def blocked(self, key: tuple[str, str], window: int) -> bool:
        return window < self._until.get(key, 0)

    def on_revert(self, key: tuple[str, str], window: int) -> int:
        """Record a revert at `window`; return the windows the key now waits."""
        n = self._reverts.get(key, 0) + 1
        self._reverts[key] = n
        wait = min(2 ** n, self.cap)
        self._until[key] = window + wait + 1
        return wait

    def on_keep(self, key: tuple[str, str]) -> None:
        self._reverts.pop(key, None)
        self._until.pop(key, None)
