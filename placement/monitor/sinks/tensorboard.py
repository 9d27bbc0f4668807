"""TensorBoard scalars (monitor.tensorboard: true and tensorboard installed).

One point per flushed batch of steps (the batch's means), not one per step: a
SummaryWriter.add_scalar costs tens of microseconds, several per step would eat the
monitor's whole budget.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from placement.records.step import StepRecord
from placement.records.summary import stall_ms
from placement.monitor.warn import WarnOnce, first_line
from placement.roles import ThreadRole


def open_writer(log_dir: str, rank: int, warn: WarnOnce):
    """A SummaryWriter under <log_dir>/tensorboard/rank<R>, or None when tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        warn("tensorboard", f"monitor.tensorboard is on but tensorboard is not importable ({first_line(e)}); "
                            "no TensorBoard scalars")
        return None
    return SummaryWriter(log_dir=os.path.join(log_dir, "tensorboard", f"rank{rank}"))


def _mean(values) -> Optional[float]:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def write_batch(writer, records: Sequence[StepRecord]) -> None:
    if writer is None or not records:
        return
    step = records[-1].step
    main = [r.roles.get(ThreadRole.MAIN) for r in records]
    for tag, value in (("placement/step_ms", _mean(r.step_ms for r in records)),
                       ("placement/data_ms", _mean(r.data_ms for r in records)),
                       ("placement/comm_ms", _mean(r.comm_ms for r in records)),
                       ("placement/cpu_stall_ms", _mean(stall_ms(r) for r in records)),
                       ("placement/main_cpu_ms", _mean(s.cpu_ms for s in main if s is not None))):
        if value is not None:
            writer.add_scalar(tag, value, step)
