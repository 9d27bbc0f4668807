"""Rank 0 names "silent" peers (placement/monitor/health/peers.py): ranks that neither post a hang
nor send a row while their peers wait in a collective, as a frozen or dead host's ranks do.
In process, over a real TCPStore, with each peer's posts and host lines sent as that rank would,
and rank 0's peer watch polled by hand."""
import time

import torch.distributed as dist

from hostbed import wait_until
from placement.monitor.crossrank.exchange import Exchange, StoreTransport
from placement.monitor.health.hang import post_line
from placement.monitor.health.peers import PeerLiveness, PeerWatch

THRESHOLD_S = 0.3


def _post(store, rank: int, phase: str, in_collective: bool) -> None:
    StoreTransport(store, rank, 4).post_hang(post_line({"phase": phase, "rank": rank, "last_step": 41,
                                                        "in_collective": in_collective}))


def _watch(store, **kw) -> tuple[PeerWatch, list]:
    """Rank 0's exchange and its peer watch (not started: each test polls it), and what it writes."""
    ex = Exchange(0, 4, store, lambda key, msg: None, slots=10, liveness=PeerLiveness(4), **kw)
    written: list = []
    return PeerWatch(ex, lambda: THRESHOLD_S, written.append, poll_s=0.0), written


def _silent(written: list) -> list:
    out = [f for f in written if f.get("how") == "silent"]
    written.clear()
    return out


def test_ranks_that_say_nothing_while_their_peers_wait_are_named_silent_with_their_host():
    store = dist.TCPStore("127.0.0.1", 0, 4, True, wait_for_workers=False)
    watch, written = _watch(store, node_rank=0)
    StoreTransport(store, 3, 4).post_host(3, 1, "host1")  # rank 3 said where it runs when it attached
    assert watch.poll() and written == []  # the first look, nothing yet
    _post(store, 2, "stalled", in_collective=False)  # rank 2 hangs outside a collective: it posts
    _post(store, 1, "stalled", in_collective=True)  # rank 1 waits for a peer in the collective
    watch.poll()
    assert sorted(f["rank"] for f in written if f["how"] == "posted") == [1, 2]  # both posts read and named
    assert _silent(written) == []  # not before the limit

    def named():
        watch.poll()
        return _silent(written)

    named = wait_until(named, 10, "rank 3 named silent", poll=0.05)
    assert [(f["phase"], f["rank"], f["how"], f["host"], f["node_rank"]) for f in named] == \
        [("stalled", 3, "silent", "host1", 1)]
    assert named[0]["stalled_s"] >= THRESHOLD_S  # waited more than it, written to the ms (0.3004 -> 0.3)
    time.sleep(THRESHOLD_S)
    watch.poll()
    assert _silent(written) == []  # named once


def test_nobody_is_silent_when_every_waiting_peer_posts_or_they_resume():
    store = dist.TCPStore("127.0.0.1", 0, 4, True, wait_for_workers=False)
    watch, written = _watch(store)
    watch.poll()
    for rank in (1, 2, 3):
        _post(store, rank, "stalled", in_collective=rank != 3)
    watch.poll()
    time.sleep(THRESHOLD_S * 1.5)
    watch.poll()
    assert _silent(written) == []
    _post(store, 1, "resumed", in_collective=False)  # the wait is over: nothing is named after it
    watch.poll()
    time.sleep(THRESHOLD_S * 1.5)
    watch.poll()
    assert _silent(written) == []


def test_a_resume_posted_after_the_watchs_last_look_is_written_at_close():
    """A job whose last steps after a hang run in less than one watch poll: rank 0's close
    takes one last look, so the rank it named stalled is not left without its resume."""
    store = dist.TCPStore("127.0.0.1", 0, 4, True, wait_for_workers=False)
    ex = Exchange(0, 4, store, lambda key, msg: None, slots=10, liveness=PeerLiveness(4))
    written: list = []
    watch = PeerWatch(ex, lambda: THRESHOLD_S, written.append, poll_s=600.0)  # its thread never looks
    watch.poll()
    _post(store, 1, "stalled", in_collective=True)
    watch.poll()
    assert [(f["phase"], f["rank"]) for f in written] == [("stalled", 1)]
    watch.start()
    _post(store, 1, "resumed", in_collective=False)
    watch.close(wait_s=5.0)
    assert [(f["phase"], f["rank"]) for f in written] == [("stalled", 1), ("resumed", 1)]
    assert not watch._thread.is_alive()
