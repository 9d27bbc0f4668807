"""The per-rank JSONL stream: step records and events (bind, tune, rollback, straggler, warning).

One file per rank, `<log_dir>/rank<R>.jsonl`. Writes are buffered and flushed every
N records by the caller and at close; a write error is reported once, never raised
into training code.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Optional

log = logging.getLogger("placement")

EVENT_KINDS = ("bind", "tune", "rollback", "straggler", "warning", "memory", "start", "end")


def rank_log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank}.jsonl")


class EventLog:
    """Append-only JSONL writer shared by binder, monitor and tuner of one rank."""

    def __init__(self, path: Optional[str], rank: int = 0):
        self.path = path
        self.rank = rank
        self._lock = threading.Lock()
        self._file = None
        self._failed = False
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", buffering=1 << 16)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        line = json.dumps(record, separators=(",", ":"), default=_jsonable)
        with self._lock:
            try:
                self._file.write(line + "\n")
            except (OSError, ValueError) as e:
                if not self._failed:
                    self._failed = True
                    log.warning("placement: cannot write %s (%s); further records are dropped", self.path, e)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Write one event record and return it."""
        rec = {"type": kind, "t": time.time(), "rank": self.rank, **fields}
        self.write(rec)
        return rec

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.flush()
                except (OSError, ValueError):
                    pass

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.flush()
                    self._file.close()
                except (OSError, ValueError):
                    pass
                self._file = None


def _jsonable(o: Any) -> Any:
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "value"):
        return o.value
    return str(o)
