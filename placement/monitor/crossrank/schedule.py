"""Which steps are exchange steps, the same on every rank, and which of them this rank still owes.

What
    A window is the `every` (monitor.exchange_every) steps that exchange_steps(n) names. At
    first each window is an exchange of its own (n = every, 2 every, ...). At short steps that
    is several exchanges a second, each a few store round trips: the largest share of what
    placement's monitor thread spent in a DDP job at 10 ms steps (benchmarks/job_cost.py). So
    rank 0 settles a grid once its steps have a steady median: from exchange step `since` on,
    an exchange is every `stride`-th window (a power of two), the fewest that leave
    monitor.exchange_min_s between two exchanges at its step time, and it carries the
    `stride` windows since the one before (windows()), a row each, in one store round trip.
    Every window is still judged on its own, in order: a straggler is named on the same window
    as without the grid, up to one exchange (about exchange_min_s) later in time.

The agreement
    Ranks must send the same windows. Rank 0 posts (since, stride) under "grid" in the
    exchange's store (Exchange.post_grid) with `since` at least LEAD windows after its own
    step; every rank, rank 0 included (a monitor that replaces another, mid-run, finds the grid
    its predecessor agreed), looks at each of its exchanges until it finds it (one round trip
    each: Exchange.read_grid), then never again. Ranks of a DDP job are within a step of each
    other, so each finds it before `since`. A rank that finds it late has sent windows past
    `since` that rank 0 will never take: it removes their keys itself (Exchange.forget), after
    its own last such send, so none is left in the job's store.

Threads
    Owned by the monitor thread (or whoever holds the monitor's lock): no lock of its own.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Optional

from placement.monitor.crossrank.exchange import MAX_GRID_STRIDE, Exchange, exchange_steps
from placement.pacing import doubling

# Windows between the exchange at which rank 0 posts the grid and `since`: every rank looks at
# each exchange, so one window would do for ranks in step; two leave room for one a window ahead.
LEAD = 2
# Rank 0 settles the grid at the first exchange at least this many windows into the run (the
# first steps, warm-up and the DataLoader's start, are no step time to settle on).
SETTLE_AFTER = 4


class ExchangeGrid:
    """The exchange steps of this run, and this rank's place on them."""

    def __init__(self, every: int, min_s: float, exchange: Optional[Exchange], rank: int, step: int):
        self.every = every
        self.min_s = min_s
        self.exchange = exchange
        self.rank = rank
        self.stride = 1  # windows per exchange, from `since` on
        self.since = math.inf  # the first exchange step of the agreed grid (before it: every window)
        self.settled = min_s <= 0  # found (or nothing to agree): no more looks
        self.sent = step - step % every  # the last exchange step this rank took part in
        self.handed = step  # the last step the monitor thread has looked for exchange steps through
        self.due: deque[int] = deque()  # exchange steps whose windows are not sent yet
        self.step_ms: Optional[float] = None  # the last median step time handed over (rank 0 settles on it)

    @property
    def on(self) -> bool:
        return self.exchange is not None and self.exchange.enabled

    def is_exchange(self, step: int) -> bool:
        if step <= 0 or step % self.every:
            return False
        return step < self.since or (step - self.since) % (self.every * self.stride) == 0

    def next_after(self, step: int) -> int:
        """The first exchange step after `step`. (The training thread asks too, at hand-overs: a
        grid settled between its reads of `since` and `stride` only moves one hand-over.)"""
        n = (step // self.every + 1) * self.every
        if n < self.since:
            return n
        period = self.every * self.stride
        return int(self.since + max(0, -(-(n - self.since) // period)) * period)

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
        """At exchange `step`: look for the agreed grid, and on rank 0, once the run is
        SETTLE_AFTER windows in and a median step time was handed over, agree one."""
        if self.settled or not self.on:
            return
        found = self.exchange.read_grid()
        step_ms = self.step_ms
        if found is None and self.rank == 0 and step >= SETTLE_AFTER * self.every and step_ms:
            stride = doubling(self.every, step_ms, self.min_s, MAX_GRID_STRIDE)
            period = self.every * stride
            since = -(-(step + LEAD * self.every) // period) * period
            self.exchange.post_grid(since, stride)
            found = (since, stride)
        if found is None:
            return
        self.since, self.stride = found
        self.settled = True
        # Windows this rank sent past `since` that the grid leaves out (it found it late):
        # nobody takes them; this rank's last send to each is behind it, so it removes them.
        for n in range(max(self.since, self.every), self.sent + 1, self.every):  # (since: a multiple of every)
            if not self.is_exchange(n):
                self.exchange.forget(n)
        self.due = deque(n for n in self.due if self.is_exchange(n))

    def figures(self) -> dict:
        """The end event's: the grid agreed (exchange_since: its first exchange step;
        exchange_stride: windows per exchange), null before one was."""
        agreed = self.settled and self.since != math.inf
        return {"exchange_since": int(self.since) if agreed else None, "exchange_stride": self.stride if agreed else None}

    def windows(self, step: int) -> list[tuple[int, int]]:
        """The windows (first, last) exchange `step` carries, oldest first: those after the
        exchange step before it (one window before `since`, `stride` from it on)."""
        before = step - self.every if step <= self.since else step - self.every * self.stride
        return [exchange_steps(n, self.every) for n in range(before + self.every, step + 1, self.every)]
