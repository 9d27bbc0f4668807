"""Every monitor.exchange_every steps, one small all-gather of each rank's window figures on
a side gloo group (created at attach: every rank must call attach). The all-gather is
asynchronous: it is issued at the exchange step and collected at a later step once done,
so no rank waits for it. Rank 0 classifies and writes a `straggler` event.
"""
from __future__ import annotations

import datetime
from typing import Callable

from placement.monitor.straggler import FIELDS, RankFigures, StragglerReport, Thresholds, classify, comm_baseline
from placement.monitor.warn import WarnOnce, first_line


class Exchange:
    # How long submit() waits for the previous exchange (a peer more than a whole exchange
    # window behind). The monitor thread waits, not training; exits wait for it (EXIT_WAIT_S).
    WAIT_S = 10.0

    def __init__(self, rank: int, world_size: int, all_gather: Callable, warn: WarnOnce,
                 on_report: Callable[[StragglerReport, list[RankFigures]], None], slots: int,
                 thresholds: Thresholds = Thresholds()):
        import torch.distributed as dist

        self.rank = rank
        self.world_size = world_size
        self._all_gather = all_gather  # the unwrapped torch.distributed.all_gather
        self._warn = warn
        self._on_report = on_report
        self._th = thresholds
        self._pending = None  # (work, outputs)
        self.slots = slots  # per-step entry times sent (monitor.exchange_every, the same on every rank)
        self.transfer_history: list[float] = []  # collective time of straggler-free windows
        self.group = dist.new_group(backend="gloo")  # collective: every rank is here now

    def submit(self, figs: RankFigures) -> None:
        """Send this rank's figures (waits for the previous exchange first, so they stay in order)."""
        import torch

        self.collect(block=True)
        row = torch.tensor(figs.to_row(self.slots), dtype=torch.float64)
        outputs = [torch.empty(len(FIELDS) + self.slots, dtype=torch.float64) for _ in range(self.world_size)]
        try:
            work = self._all_gather(outputs, row, group=self.group, async_op=True)
        except Exception as e:
            self._warn("exchange", f"cross-rank exchange failed ({first_line(e)}); straggler naming is off")
            self.group = None
            return
        self._pending = (work, outputs)

    def collect(self, block: bool = False) -> None:
        """Finish the pending exchange if it is done (or wait for it with `block`)."""
        if self._pending is None:
            return
        work, outputs = self._pending
        try:
            if not block and not work.is_completed():
                return
            work.wait(datetime.timedelta(seconds=self.WAIT_S))
        except Exception as e:
            self._pending = None
            self._warn("exchange", f"cross-rank exchange failed ({first_line(e)})")
            return
        self._pending = None
        if self.rank != 0:
            return
        figures = [RankFigures.from_row(o.tolist()) for o in outputs]
        report = classify(figures, comm_baseline(self.transfer_history, self._th), self._th)
        if not report.stragglers and report.transfer_ms is not None:
            self.transfer_history = (self.transfer_history + [report.transfer_ms])[-50:]
        self._on_report(report, figures)

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def enabled(self) -> bool:
        return self.group is not None

    def close(self, timeout_s: float = 10.0) -> None:
        """Let a pending exchange finish (its peers issued it at the same step, so it is
        quick) before the group can be torn down under it; give up after `timeout_s`."""
        if self._pending is None:
            return
        work, _ = self._pending
        self._pending = None
        try:
            work.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            self._warn("exchange-close", f"last cross-rank exchange did not finish ({first_line(e)})")
