"""Warn once per kind of problem: a probe that fails leaves its figure None and says so one time."""
from __future__ import annotations

import logging

from placement.events import EventKind

log = logging.getLogger("placement")


class WarnOnce:
    """Logs each distinct key once, and writes it as a `warning` event when an EventLog is given."""

    def __init__(self, events=None):
        self.events = events
        self._seen: set[str] = set()

    def __call__(self, key: str, message: str) -> None:
        if key in self._seen:
            return
        self._seen.add(key)
        log.warning("placement: %s", message)
        if self.events is not None:
            try:
                self.events.event(EventKind.WARNING, source="monitor", message=message)
            except Exception:  # a broken log must not turn a warning into an error
                pass


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (its type when it has none), at most `limit` chars."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:limit]
