"""A rank's health checks between hand-overs, on the monitor thread: its own hang (hang.py),
rank 0's watch over its peers (peers.py, its own thread), where its pages are (residence.py).

Threads
    watch() and resume_at_close() run on the monitor thread or an exit path, never under the
    monitor's lock: a hung main thread may hold it. The peer watch has its own thread.
"""
from __future__ import annotations

from time import perf_counter_ns
from typing import Any, Callable, Iterable, Optional, Sequence

from placement.monitor.health.hang import HangWatch
from placement.monitor.health.peers import PeerWatch, write_peer_hang
from placement.monitor.health.residence import ResidenceWatch
from placement.monitor.warn import WarnOnce, first_line

# How long this rank's close waits for its last hang post to be in the store, and rank 0's close
# for its peer watch to end (crossrank/duty.py EXCHANGE_CLOSE_S: the rows of the last windows).
CLOSE_WAIT_S = 2.0


class RankHealth:
    """The hang watch, the peer watch (rank 0, with an exchange) and the residence watch of one
    rank. `duty`: the rank's exchange duty (crossrank/duty.py: hang posts go to rank 0 through
    it); `comm`: its comm source (whether main waits inside a collective)."""

    def __init__(self, cfg, events, rank: int, world_size: int, comm, duty, warn: WarnOnce,
                 planned_nodes: Sequence[int] = (), last_batch: Callable[[], Any] = lambda: None,
                 stretched: Callable[[], bool] = lambda: False):
        self.hang = HangWatch(cfg.hang_factor, cfg.hang_min_s, cfg.hang_pause_s)
        self._who = (events, rank, world_size)
        self._comm = comm
        self._duty = duty
        self._warn = warn
        self._peers: Optional[PeerWatch] = None  # rank 0: its peers' liveness
        self._stretched = stretched  # the monitor's budget stretched its paced floor: the peer watch looks half as often
        self._residence: Optional[ResidenceWatch] = None  # where the rank's pages are against `planned_nodes`
        if planned_nodes and cfg.residence_every_s > 0:
            self._residence = ResidenceWatch(tuple(planned_nodes), cfg.residence_every_s, cfg.residence_min_pct,
                                             events, rank, last_batch)

    @property
    def poll_s(self) -> float:
        """How often the monitor thread looks, at most."""
        return self.hang.poll_s

    def start(self, step: int, now_ns: int) -> None:
        """Step `step` + 1 begins at `now_ns`; rank 0 starts watching its peers."""
        events, rank, _ = self._who
        self.hang.progress(step, now_ns)
        exchange = self._duty.exchange
        if exchange is not None and rank == 0 and self._peers is None:
            self._peers = PeerWatch(exchange, self.hang.threshold_s, lambda fields: write_peer_hang(events, fields),
                                    self.hang.poll_s, own=lambda: self.hang.post, stretched=self._stretched).start()

    def step_times(self, step_ms: Iterable[float]) -> None:
        """Steps built: their times set the hang limit (a multiple of the median)."""
        self.hang.step_times(step_ms)

    def watch(self, step: int) -> None:
        """Between hand-overs: has the training thread completed a step lately (`step`: the
        last it completed), and where are the rank's pages, at the residence watch's own rate."""
        self._watch_hang(step)
        if self._residence is None:
            return
        try:
            self._residence.tick()
        except Exception as e:
            self._warn(f"residence:{type(e).__name__}", f"residence watch failed ({type(e).__name__}: {first_line(e)})")

    def _watch_hang(self, step: int) -> None:
        events, rank, world_size = self._who
        hang = self.hang
        try:
            now = perf_counter_ns()
            hung = hang.check(step, now)
            post = None
            if hung is not None:
                # in a collective or not: what tells the hung rank from the peers it holds (none alone)
                inside = self._comm.in_collective() if world_size > 1 else None
                # outside any collective with peers to judge it: hung, or a job-wide pause (peers.py)
                post = hang.report(hung, events, rank, inside, self._comm.null_why if inside is None else None,
                                   hold=inside is False and self._duty.on)
            elif hang.write_held(events, rank, now):
                pass
            elif hang.resumed is not None:
                post = hang.report_resumed(events, rank)
            if post is not None:
                self._duty.post_hang(post)  # rank 0 names it in its log too
        except Exception as e:
            self._warn(f"stall:{type(e).__name__}", f"stall watch failed ({type(e).__name__}: {first_line(e)})")

    def resume_at_close(self, step: int) -> None:
        """A hang that ended after the monitor thread's last watch (the steps after it can
        take less than one watch poll) is reported resumed now, and its post is in the store
        before this rank's last exchange rows: rank 0's last look, after those rows, reads it."""
        hang = self.hang
        if hang.hung is None:
            return
        hang.check(step, perf_counter_ns())  # a hang reported: only notes a resume
        if hang.resumed is None:
            return
        events, rank, _ = self._who
        self._duty.post_hang(hang.report_resumed(events, rank), wait_s=CLOSE_WAIT_S)

    def close(self) -> None:
        if self._peers is not None:
            self._peers.close(wait_s=CLOSE_WAIT_S)
