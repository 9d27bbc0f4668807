"""Appending pre-encoded step records to the rank's EventLog.

StepRecord.to_json formats a record at about a third of json.dumps' cost; writing a batch
of them needs an EventLog that takes lines (`write_lines`). StepLog adds that to
placement.events.EventLog; a plain EventLog (the one placerun's stage 1 opens) gets one
EventLog.write per record instead.
"""
from __future__ import annotations

from typing import Sequence

from placement.events import EventLog, log
from placement.monitor.record import StepRecord


class StepLog(EventLog):
    """An EventLog that also appends already-encoded JSONL lines, one write per batch."""

    def write_lines(self, lines: Sequence[str]) -> None:
        if self._file is None or not lines:
            return
        blob = "\n".join(lines) + "\n"
        with self._lock:
            try:
                self._file.write(blob)
            except (OSError, ValueError) as e:
                if not self._failed:
                    self._failed = True
                    log.warning("placement: cannot write %s (%s); further records are dropped", self.path, e)


def write_records(events, records: Sequence[StepRecord]) -> None:
    """One write for a batch of records when the EventLog takes encoded lines (`write_lines`);
    else one EventLog.write per record (json.dumps of its dict: ~3x the encoding cost)."""
    write_lines = getattr(events, "write_lines", None)
    if write_lines is not None:
        write_lines([r.to_json() for r in records])
        return
    for r in records:
        events.write(r.to_dict())
