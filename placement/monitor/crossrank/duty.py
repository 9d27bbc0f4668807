"""This rank's part in the exchange, on the monitor thread: which of its windows go to rank 0
when (the grid, schedule.py), sending them once their steps are built, the last ones at close,
and, on rank 0, every judged window published: to the judgement observers (the live metrics)
and, where it names someone, as a `straggler` event and its log lines.

Threads
    Owned by the monitor thread (or whoever holds the monitor's lock): no lock of its own.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from placement.events import EventKind
from placement.monitor.crossrank.exchange import Exchange
from placement.monitor.crossrank.schedule import ExchangeGrid
from placement.monitor.stragglers.event import WindowJudgement, straggler_event, straggler_lines
from placement.monitor.stragglers.figures import RankFigures
from placement.monitor.warn import WarnOnce, first_line, log

# Exchanges waiting for their steps to be built beyond which the oldest goes as it is (see send_due).
MAX_EXCHANGES_DUE = 64
# How long rank 0's close waits in all for the rows of the last windows (its peers close too).
EXCHANGE_CLOSE_S = 2.0


class ExchangeDuty:
    """The exchange's schedule and sends for one rank; `exchange` None: there is none (one rank,
    no store), and every call is a no-op but the grid's bookkeeping."""

    def __init__(self, exchange: Optional[Exchange], grid: ExchangeGrid,
                 window: Callable[[int, int], RankFigures], events, warn: WarnOnce):
        self.exchange = exchange
        self.grid = grid
        self._window = window  # (first, last) -> this rank's figures of those steps (sinks: ExchangeWindow)
        self._events = events
        self._warn = warn
        self._observers: list[Callable[[WindowJudgement], None]] = []

    @property
    def on(self) -> bool:
        return self.exchange is not None and self.exchange.enabled

    @property
    def awaiting(self) -> bool:
        """Rank 0: an exchange it sent waits for its peers' rows."""
        return self.on and self.exchange.pending

    def on_judged(self, observe: Callable[[WindowJudgement], None]) -> None:
        """Rank 0: call observe(judgement) with every window judged, on the monitor thread."""
        self._observers.append(observe)

    def send_due(self, built_through: int) -> bool:
        """Send the due exchanges whose steps are all built (through `built_through`), oldest
        first (True: one was sent). An exchange waits for its steps: with NCCL durations read
        from the flight recorder, a build without a poll (FrCadence spaces them out to keep the
        GIL budget) builds no step, and sending then would send an empty window; the next build
        with a poll, at most comm/nccl.py MAX_POLL_S later, builds them. Rank 0 keys exchanges
        by their last step, so a late row is still judged with its peers' (it waits
        Exchange.WAIT_S). More than MAX_EXCHANGES_DUE waiting (steps never built): the oldest
        goes as it is."""
        grid = self.grid
        sent = False
        while grid.due:
            step = grid.due[0]
            if grid.windows(step)[-1][1] > built_through and len(grid.due) <= MAX_EXCHANGES_DUE:
                break
            grid.settle(step)  # (it may drop `step`: a window the grid leaves out)
            if grid.due and grid.due[0] == step:
                grid.due.popleft()
                self._submit(step)
                sent = True
        return sent

    def collect(self) -> None:
        """Rank 0, between sends: the exchanges whose rows came in since, judged and published."""
        if self.exchange.pending:
            self._publish(self.exchange.collect())

    def _submit(self, step: int, wait_s: Optional[float] = None) -> None:
        """Send the figures of the same absolute steps as every other rank (built here whatever
        this rank's probe cadence), a row per window the exchange carries; later steps wait for
        the next exchange."""
        figs = [self._window(first, last) for first, last in self.grid.windows(step)]
        self.grid.sent = step
        self._publish(self.exchange.submit(figs, wait_s=wait_s))

    def send_the_rest(self, last_step: int) -> None:
        """At close, every record built: the windows not exchanged yet (an exchange step whose
        hand-over the exit path drained, then the steps after the last exchange window, which
        end at this rank's last step), so that the last steps are judged too. Rank 0 waits
        for their rows at most EXCHANGE_CLOSE_S in all."""
        ex, grid = self.exchange, self.grid
        if not self.on or last_step == 0:
            return
        deadline = time.monotonic() + EXCHANGE_CLOSE_S
        grid.due.clear()
        for step in grid.between(grid.sent + 1, last_step):
            self._submit(step, wait_s=max(0.0, deadline - time.monotonic()))
        done = grid.windows(grid.sent)[-1][1] if grid.sent else 0  # the last step sent
        if done < last_step:
            # windows like the others (exchange_every steps, the first cut at `done`), counted
            # back from this rank's last step, as decode_rows reads an exchange's windows
            ends = range(last_step, done, -grid.every)
            figs = [self._window(max(done + 1, last - grid.every + 1), last) for last in reversed(ends)]
            self._publish(ex.submit(figs, wait_s=max(0.0, deadline - time.monotonic()), at_exit=True))
        self._publish(ex.close(timeout_s=max(0.0, deadline - time.monotonic())))

    def post_hang(self, post: dict, wait_s: float = 0.0) -> None:
        """This rank's hang post into the store, where rank 0's peer watch reads it."""
        if self.exchange is not None:
            self.exchange.post_hang(post, wait_s=wait_s)

    def figures(self) -> dict:
        """The end event's: rank 0's naming counts and the grid agreed (none without an exchange)."""
        ex = self.exchange
        if ex is None:
            return {}
        judged = {} if self.grid.rank != 0 else \
            {"straggler_candidates_held_back": ex.naming.held_back,  # naming.py: not costly, or not yet confirmed
             "exchange_rows_dropped": ex.rows_dropped}
        judged.update(self.grid.figures())
        return judged

    def _publish(self, verdicts: list[WindowJudgement]) -> None:
        """Rank 0: every judged window to the judgement observers (the live metrics: who is named
        and who no longer is); one `straggler` event, and its log lines, per window that names
        someone (or starts a job-wide slowdown)."""
        for verdict in verdicts:
            for observe in self._observers:
                try:
                    observe(verdict)
                except Exception as e:
                    self._warn(f"judged:{type(e).__name__}", f"a judged window's observer failed ({first_line(e)})")
            if not (verdict.report.stragglers or verdict.report.job_wide):
                continue
            fields = straggler_event(verdict)
            self._events.event(EventKind.STRAGGLER, **fields)
            for line in straggler_lines(verdict.report, fields["steps"], verdict.hosts):
                log.warning("%s", line)
