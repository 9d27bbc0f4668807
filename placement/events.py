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
import weakref
from typing import Any, Optional, Sequence

log = logging.getLogger("placement")


def rank_log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank}.jsonl")


_open_logs: "weakref.WeakSet[EventLog]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker) inherits the rank's unflushed lines; if it ever
    # flushed them, the rank's records would be written twice. Point the inherited fd at
    # /dev/null and forget the log: the rank writes its own lines.
    for ev in list(_open_logs):
        f, ev._file = ev._file, None
        if f is None:
            continue
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, f.fileno())
            os.close(devnull)
        except OSError:
            pass
        _orphaned.append(f)  # kept alive so its buffer is never flushed to a reused fd


_orphaned: list = []
os.register_at_fork(after_in_child=_after_fork_in_child)


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
            _open_logs.add(self)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self.write_lines((json.dumps(record, separators=(",", ":"), default=_jsonable),))

    def write_lines(self, lines: Sequence[str]) -> None:
        """Append already-encoded JSONL lines in one write (the monitor's batched step records)."""
        if self._file is None or not lines:
            return
        blob = "\n".join(lines) + "\n"
        with self._lock:
            try:
                self._file.write(blob)
            except (OSError, ValueError, AttributeError) as e:  # AttributeError: closed meanwhile
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
