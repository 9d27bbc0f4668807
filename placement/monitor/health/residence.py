"""The periodic memory-residence look, on the monitor thread (never the training thread).

Every monitor.residence_every_s (first after FIRST_LOOK_S) the monitor thread samples where the
rank's pages are (residence.py: a move_pages sample of its anonymous mappings; ~1.5 ms of CPU
in a torch process, about a quarter each reading /proc/self/maps, parsing it, spreading the
addresses and the move_pages call, the number of pages asked fixed whatever the process's size;
the `residence` event's cost_us) and, apart, the buffers of the last batch a watched DataLoader handed out (the
pinned host buffers its pin-memory thread filled; ordinary pages on a CPU-only host), and writes
one `residence` event. A look whose share on the planned node(s) is below
monitor.residence_min_pct gives one `warning` event naming where the other pages are, once until
the share is back above it (said then too).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

from placement import residence
from placement.events import EventKind
from placement.monitor.warn import log

FIRST_LOOK_S = 10.0  # the job has allocated its model and first batches by then


class ResidenceWatch:
    def __init__(self, planned: Sequence[int], every_s: float, min_pct: float, events, rank: int,
                 last_batch: Callable[[], Any], *, query: Optional[residence.Query] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.planned = tuple(planned)
        self.every_s = every_s
        self.min_pct = min_pct
        self.events = events
        self.rank = rank
        self.last_batch = last_batch
        self.query = query
        self.clock = clock
        self._next = clock() + min(FIRST_LOOK_S, every_s)
        self._low: set[str] = set()  # what was said to be below the threshold and has not recovered
        self.failed: Optional[str] = None  # why the last look could not be made

    def tick(self) -> bool:
        """Look if one is due (True when it looked)."""
        now = self.clock()
        if now < self._next:
            return False
        self._next = now + self.every_s
        self.look()
        return True

    def look(self) -> list[residence.Residence]:
        looks = []
        got, why = residence.safe(lambda: residence.sample_process(self.planned, query=self.query))
        if got is not None:
            looks.append(got)
        self.failed = why
        buffers, pinned = residence.tensor_buffers(self.last_batch())
        if buffers:
            what = "pinned batch buffers" if pinned else "batch buffers"
            got, why = residence.safe(lambda: residence.sample_buffers(what, buffers, self.planned, query=self.query))
            if got is not None:
                looks.append(got)
        fields: dict[str, Any] = {"looks": [r.to_dict() for r in looks]}
        if self.failed:
            fields["null"] = self.failed
        self.events.event(EventKind.RESIDENCE, **fields)
        for r in looks:
            self._judge(r)
        return looks

    def _judge(self, r: residence.Residence) -> None:
        warning = residence.below(r, self.min_pct)
        if warning is not None and r.what not in self._low:
            self._low.add(r.what)
            msg = f"rank {self.rank}: {warning}"
            log.warning("placement: %s", msg)
            self.events.event(EventKind.WARNING, message=msg, residence=r.to_dict())
            self.events.flush()
        elif warning is None and r.what in self._low and r.share_pct is not None:
            self._low.discard(r.what)
            msg = f"rank {self.rank}: memory residence back to {r.share_pct:.1f}%: {r.describe()}"
            log.warning("placement: %s", msg)
            self.events.event(EventKind.RESIDENCE, message=msg, looks=[r.to_dict()])
