"""Which steps are exchange steps, the same on every rank, and which of them this rank still owes.

What
    A window is the `every` (monitor.exchange_every) steps that exchange_steps(n) names. At
    first each window is an exchange of its own (n = every, 2 every, ...). At short steps that
    is several exchanges a second, each a few store round trips: the largest share of what
    placement's monitor thread spent in a DDP job at 10 ms steps (benchmarks/job_cost.py). So
    rank 0 settles a grid once its steps have a steady median: from exchange step `since` on,
    an exchange is every `stride`-th window (a power of two), the fewest that leave
    monitor.exchange_min_s x half the paced floor's scale (probes/budget.py PacedFloor: stretched
    while placement costs more than monitor.budget_pct; see _agree) between two exchanges at its step time,
    and it carries the windows since the exchange before (windows()), a row each, in one store
    round trip. When the floor's scale moves the stride it wants, rank 0 adds a segment (a
    later `since`, the new stride) to the grid. Every window is still judged on its own, in
    order: a straggler is named on the same window as without the grid, up to one exchange
    later in time.

The agreement
    Ranks must send the same windows. Rank 0 posts the grid's segments ("<since> <stride>"
    each, `since` increasing) under "grid" in the exchange's store (Exchange.post_grid), each new
    one starting at least LEAD windows and GRID_LEAD_S after its own step, on a step of both its
    stride and the one before (so the exchange before it is on the grid too). Every rank looks
    at its exchanges (one round trip: Exchange.read_grid, a `get` only when the post count
    moved): until it finds a grid (rank 0 included: a monitor that replaces another, mid-run,
    finds the grid its predecessor agreed), then at most every GRID_LOOK_S. Ranks of a DDP job
    are within a step of each other, so each finds a segment before its `since`. A rank that
    finds it late has sent windows past `since` that rank 0 will never take: it removes their
    keys itself (Exchange.forget), after its own last such send, so none is left in the job's
    store. Rank 0 adds at most MAX_SEGMENTS segments (the floor's changes back off in time:
    PacedFloor).

Threads
    Owned by the monitor thread (or whoever holds the monitor's lock): no lock of its own. The
    training thread reads next_after() at hand-overs: the segments are one tuple, replaced
    whole, so it reads one grid or the next.
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable, Optional

from placement.monitor.crossrank.exchange import MAX_GRID_SEGMENTS, MAX_GRID_STRIDE, Exchange, exchange_steps
from placement.pacing import doubling

# Windows between the exchange at which rank 0 posts a segment and its `since`: every rank looks
# at each exchange until it finds the first, so one window would do for ranks in step; two leave
# room for one a window ahead.
LEAD = 2
# Rank 0 settles the grid at the first exchange at least this many windows into the run (the
# first steps, warm-up and the DataLoader's start, are no step time to settle on).
SETTLE_AFTER = 4
# Once a grid is found, a rank looks for a new segment at most this often (a round trip each) ...
GRID_LOOK_S = 2.0
# ... and a segment rank 0 adds later starts at least this long after its step. A rank looks
# before a send when GRID_LOOK_S passed since its last look, so it misses a segment only when it
# sends past `since` less than GRID_LOOK_S after a look made before rank 0 posted: the ranks'
# steps are within one of each other, and rank 0 posts at most a hand-over's processing after
# its step; this leaves more than GRID_LOOK_S for both.
GRID_LEAD_S = 5.0
MAX_SEGMENTS = MAX_GRID_SEGMENTS


class ExchangeGrid:
    """The exchange steps of this run, and this rank's place on them."""

    def __init__(self, every: int, min_s: float, exchange: Optional[Exchange], rank: int, step: int,
                 scale: Callable[[], int] = lambda: 1, clock: Callable[[], float] = time.monotonic):
        self.every = every
        self.min_s = min_s
        self.exchange = exchange
        self.rank = rank
        self._scale = scale  # the paced floor's scale (rank 0 stretches the grid by it)
        self._clock = clock
        # ((since, stride), ...): from each `since` on, every stride-th window is an exchange
        # (the first: every window from the start), until the next segment's since
        self.segments: tuple[tuple[int, int], ...] = ((0, 1),)
        self.settled = min_s <= 0  # a grid found or agreed (or nothing to agree): looks get rarer
        self._posts = 0  # the store's grid post count at this rank's last read
        self._looked = -math.inf  # when this rank last looked (clock)
        self.sent = step - step % every  # the last exchange step this rank took part in
        self.handed = step  # the last step the monitor thread has looked for exchange steps through
        self.due: deque[int] = deque()  # exchange steps whose windows are not sent yet
        self.step_ms: Optional[float] = None  # the last median step time handed over (rank 0 settles on it)

    @property
    def since(self) -> float:
        """The first exchange step of the last segment agreed (inf before one was)."""
        return self.segments[-1][0] if len(self.segments) > 1 else math.inf

    @property
    def stride(self) -> int:
        """Windows per exchange from `since` on."""
        return self.segments[-1][1]

    @property
    def on(self) -> bool:
        return self.exchange is not None and self.exchange.enabled

    def _segment(self, step: int, segments: tuple) -> int:
        """The index of the segment that holds `step`."""
        i = len(segments) - 1
        while segments[i][0] > step:
            i -= 1
        return i

    def is_exchange(self, step: int, segments: Optional[tuple] = None) -> bool:
        if step <= 0 or step % self.every:
            return False
        segments = self.segments if segments is None else segments
        since, stride = segments[self._segment(step, segments)]
        return (step - since) % (self.every * stride) == 0

    def next_after(self, step: int) -> int:
        """The first exchange step after `step`. (The training thread asks too, at hand-overs: a
        segment added between its reads only moves one hand-over.)"""
        segments = self.segments
        n = (step // self.every + 1) * self.every
        i = self._segment(n, segments)
        since, stride = segments[i]
        period = self.every * stride
        out = since + -(-(n - since) // period) * period
        # (a segment's since is an exchange step of the one before it too)
        return int(min(out, segments[i + 1][0]) if i + 1 < len(segments) else out)

    def between(self, first: int, last: int) -> list[int]:
        """The exchange steps in first..last."""
        out, n = [], self.next_after(first - 1)
        while n <= last:
            out.append(n)
            n = self.next_after(n)
        return out

    def hand(self, through: int, step_ms: Optional[float] = None) -> bool:
        """The monitor thread has the steps through `through` (their median step time
        `step_ms`): their exchange steps join `due` (True when one did)."""
        steps = self.between(self.handed + 1, through) if self.on else []
        self.handed = max(self.handed, through)
        self.step_ms = step_ms or self.step_ms
        self.due.extend(steps)
        return bool(steps)

    def settle(self, step: int) -> None:
        """At exchange `step`: look for the agreed grid (until found, then every GRID_LOOK_S);
        on rank 0, once the run is SETTLE_AFTER windows in and a median step time was handed
        over, agree one, and add a segment when the stride it wants moved."""
        if self.min_s <= 0 or not self.on:
            return
        now = self._clock()
        if not (self.settled and (self.rank == 0 or now - self._looked < GRID_LOOK_S)):
            self._looked = now
            found = self.exchange.read_grid(self._posts)
            if found is not None:
                self._posts, segments = found
                self._take(((0, 1),) + segments)
        if self.rank == 0 and step >= SETTLE_AFTER * self.every and self.step_ms:
            self._agree(step, self.step_ms)

    def _agree(self, step: int, step_ms: float) -> None:
        """Rank 0: the grid's stride for this step time and floor; a segment added when it moved."""
        segments = self.segments
        # One doubling behind the floor: its first stretches the hand-overs, the records and the
        # tuner's windows alone (what costs most per doubling); exchanges, whose pace is how soon
        # a straggler is named, stretch only when that was not enough. (At x2 from the first
        # doubling, benchmarks/detection.py --quick named its 1.3 s straggler never: its windows
        # went to an exchange after the rank it freezes next had stopped.)
        want = doubling(self.every, step_ms, self.min_s * max(1, self._scale() // 2), MAX_GRID_STRIDE)
        last_since, stride = segments[-1]
        if len(segments) > 1 and (want == stride or last_since > step or len(segments) > MAX_SEGMENTS):
            return  # as it is; a segment not in force yet; or the most segments
        if len(segments) == 1 and self.settled:
            return  # a grid of every window read from the store (a line that was not one)
        period = self.every * max(stride, want)
        lead = LEAD * self.every if len(segments) == 1 else max(LEAD * self.every, GRID_LEAD_S * 1e3 / step_ms)
        since = int(-(-(step + lead) // period) * period)
        added = segments + ((since, want),)
        self.exchange.post_grid(added[1:])
        self._posts += 1
        self._take(added)

    def _take(self, segments: tuple) -> None:
        """The grid `segments` from now on. Windows this rank sent past a new segment's `since`
        that it leaves out (it found the segment late): nobody takes them; this rank's last
        send to each is behind it, so it removes them."""
        old, self.segments = self.segments, segments
        self.settled = True
        # the grids agree before the first segment one has and the other has not (rank 0 only
        # adds segments; a line that is not a grid drops them all)
        first = min((since for since, _ in set(segments) ^ set(old)), default=None)
        if first is None:
            return
        for n in range(max(self.every, first - first % self.every), self.sent + 1, self.every):
            if self.is_exchange(n, old) and not self.is_exchange(n):
                self.exchange.forget(n)
        self.due = deque(self.between(self.sent + 1, self.handed))

    def figures(self) -> dict:
        """The end event's: the grid agreed, its last segment (exchange_since: its first exchange
        step; exchange_stride: windows per exchange) and how many segments it had (rank 0 adds
        one when the floor's scale moves the stride), null before one was."""
        agreed = self.settled and len(self.segments) > 1
        return {"exchange_since": int(self.since) if agreed else None, "exchange_stride": self.stride if agreed else None,
                "exchange_segments": len(self.segments) - 1 if agreed else None}

    def windows(self, step: int) -> list[tuple[int, int]]:
        """The windows (first, last) exchange `step` carries, oldest first: those after the
        exchange step before it (on the segment before at a segment's first)."""
        segments = self.segments
        i = self._segment(step, segments)
        since, stride = segments[i]
        if step == since and i > 0:
            stride = segments[i - 1][1]
        before = step - self.every * stride
        return [exchange_steps(n, self.every) for n in range(before + self.every, step + 1, self.every)]
