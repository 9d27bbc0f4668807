"""Appending pre-encoded step records to the rank's EventLog.

StepRecord.to_json formats a record at about a fifth of json.dumps' cost, and a batch of
them goes out in one EventLog.write_lines.
"""
from __future__ import annotations

from typing import Sequence

from placement.events import EventLog
from placement.records.step import StepRecord


def write_records(events: EventLog, records: Sequence[StepRecord]) -> None:
    """One write for a batch of records. The steps between two readings of the counters share
    one roles dict (StepMonitor._role_samples): its JSON is made once."""
    lines = []
    shared, encoded = None, ""
    for r in records:
        if r.roles is not shared:
            shared, encoded = r.roles, r.roles_json()
        lines.append(r.to_json(encoded))
    events.write_lines(lines)
