"""Rank 0 names "silent" peers (placement/monitor/crossrank/exchange.py): ranks that neither post a stall
nor send a row while their peers wait in a collective, as a frozen or dead host's ranks do.
In process, over a real TCPStore, with each peer's posts and host lines sent as that rank would."""
import time

import torch.distributed as dist

from hostbed import wait_until
from placement.monitor.crossrank.exchange import Exchange, StoreTransport
from placement.monitor.health.hang import post_line

THRESHOLD_S = 0.3


def _post(store, rank: int, phase: str, in_collective: bool) -> None:
    StoreTransport(store, rank, 4).post_hang(post_line({"phase": phase, "rank": rank, "last_step": 41,
                                                        "in_collective": in_collective}))


def test_ranks_that_say_nothing_while_their_peers_wait_are_named_silent_with_their_host():
    store = dist.TCPStore("127.0.0.1", 0, 4, True, wait_for_workers=False)
    ex = Exchange(0, 4, store, lambda key, msg: None, slots=10, node_rank=0)
    StoreTransport(store, 3, 4).post_host(3, 1, "host1")  # rank 3 said where it runs when it attached
    assert ex.hang_posts() == [] and ex.overdue(THRESHOLD_S) == []  # the first look, nothing yet
    _post(store, 2, "stalled", in_collective=False)  # rank 2 hangs outside a collective: it posts
    _post(store, 1, "stalled", in_collective=True)  # rank 1 waits for a peer in the collective
    assert len(ex.hang_posts()) == 2
    assert ex.overdue(THRESHOLD_S) == []  # not before the limit
    named = wait_until(lambda: ex.overdue(THRESHOLD_S), 10, "rank 3 named silent", poll=0.05)
    assert [(f["phase"], f["rank"], f["how"], f["host"], f["node_rank"]) for f in named] == \
        [("stalled", 3, "silent", "host1", 1)]
    assert named[0]["stalled_s"] >= THRESHOLD_S  # waited more than it, written to the ms (0.3004 -> 0.3)
    time.sleep(THRESHOLD_S)
    assert ex.overdue(THRESHOLD_S) == []  # named once


def test_nobody_is_silent_when_every_waiting_peer_posts_or_they_resume():
    store = dist.TCPStore("127.0.0.1", 0, 4, True, wait_for_workers=False)
    ex = Exchange(0, 4, store, lambda key, msg: None, slots=10)
    ex.hang_posts()
    for rank in (1, 2, 3):
        _post(store, rank, "stalled", in_collective=rank != 3)
    ex.hang_posts()
    time.sleep(THRESHOLD_S * 1.5)
    assert ex.overdue(THRESHOLD_S) == []
    _post(store, 1, "resumed", in_collective=False)  # the wait is over: nothing is named after it
    ex.hang_posts()
    time.sleep(THRESHOLD_S * 1.5)
    assert ex.overdue(THRESHOLD_S) == []
