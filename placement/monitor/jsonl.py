"""Appending pre-encoded step records to the rank's EventLog."""
from __future__ import annotations

from typing import Sequence

from placement.monitor.record import StepRecord


def write_records(events, records: Sequence[StepRecord]) -> None:
    """One write for a batch of records when the EventLog takes encoded lines (`write_lines`);
    else one EventLog.write per record (json.dumps of its dict: ~3x the encoding cost)."""
    write_lines = getattr(events, "write_lines", None)
    if write_lines is not None:
        write_lines([r.to_json() for r in records])
        return
    for r in records:
        events.write(r.to_dict())
