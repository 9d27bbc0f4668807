"""The exchange grid (placement/monitor/crossrank/schedule.py): at short steps rank 0 agrees with
the ranks, through a real TCPStore, to exchange at every 2^k-th window only, each exchange
carrying the windows since the one before, and adds a segment when the paced floor's scale moves
the stride; every rank then sends the same windows, each judged on its own, a rank that found
the grid late removes the keys nobody will take, and a grid line that is not one is said and
read as every window."""
import torch.distributed as dist

from placement.monitor.crossrank.exchange import PREFIX, Exchange, exchange_steps
from placement.monitor.stragglers.figures import RankFigures
from placement.monitor.crossrank.schedule import GRID_LEAD_S, GRID_LOOK_S, LEAD, MAX_SEGMENTS, SETTLE_AFTER, ExchangeGrid

EVERY = 20


def _ranks(store, n: int = 2, min_s: float = 1.0, scale=lambda: 1, clock=None):
    warned: list = []
    more = {} if clock is None else {"clock": clock}
    grids = [ExchangeGrid(EVERY, min_s, Exchange(r, n, store, lambda key, msg: warned.append(msg), slots=EVERY), r, 0,
                          scale, **more) for r in range(n)]
    return grids, warned


def test_before_a_grid_every_window_is_an_exchange_and_rank_0_agrees_one_the_others_find():
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    (g0, g1), warned = _ranks(store)
    assert g0.between(1, 200) == list(range(20, 201, 20)) == g1.between(1, 200)
    g1.step_ms = 5.0
    g1.settle(80)  # rank 1 first: nothing posted yet, it goes on with every window
    assert not g1.settled and g1.stride == 1
    g0.step_ms = 5.0
    g0.settle(SETTLE_AFTER * EVERY - EVERY)  # too early in the run to settle on a step time
    assert not g0.settled
    g0.settle(SETTLE_AFTER * EVERY)
    # 5 ms steps: 16 windows (1.6 s) are the fewest that last 1 s; `since` on that grid, LEAD windows on
    assert (g0.stride, g0.since) == (16, 320) and g0.since >= SETTLE_AFTER * EVERY + LEAD * EVERY
    g1.step_ms = 5.0
    g1.settle(100)
    assert (g1.stride, g1.since) == (16, 320) and g1.settled and warned == []
    # both send the same windows: every one before `since`, then one in 16
    want = list(range(20, 320, 20)) + [320, 640, 960]
    assert g0.between(1, 1000) == g1.between(1, 1000) == want
    for step in range(0, 1000, 7):
        assert g0.next_after(step) == min(n for n in want + [1280] if n > step)
        assert g0.is_exchange(step) == (step in want)
    # ... and every window goes, once, in order: the grid's exchanges carry the windows between
    carried = [w for n in want for w in g0.windows(n)]
    assert carried == [exchange_steps(n, EVERY) for n in range(20, 961, 20)]
    assert [len(g0.windows(n)) for n in (300, 320, 640)] == [1, 1, 16]


def test_an_exchange_of_several_windows_is_judged_a_window_at_a_time_in_order():
    """Two ranks over a real TCPStore send 3 windows in one exchange; rank 1 is slow in the last
    two: rank 0 judges each window with both ranks, in order, and names rank 1 on the second
    of them (its second costly window in a row: monitor.straggler_confirm_windows), since the first."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    warned: list = []
    ex0, ex1 = (Exchange(r, 2, store, lambda key, msg: warned.append(msg), slots=EVERY) for r in range(2))

    def figs(rank: int, n: int) -> RankFigures:
        first, last = exchange_steps(n, EVERY)
        late = rank == 1 and n > 20
        comm = tuple(0.5 if late else 8.0 for _ in range(last - first + 1))  # rank 0 waits for rank 1
        return RankFigures(rank, last - first + 1, first, last, 20.0, 0.0, comm[0], 0.1, None,
                           19.0 if late else 11.0, None, comm)

    ex1.submit([figs(1, n) for n in (20, 40, 60)])
    assert ex0.submit([figs(0, n) for n in (20, 40, 60)]) == []
    verdicts = ex0.collect(block=True)
    assert [v.ranks_judged for v in verdicts] == [2, 2, 2] and ex0.rows_dropped == 0, verdicts
    named = [[(s.ranks, s.since_step) for s in v.report.stragglers] for v in verdicts]
    assert named == [[], [], [([1], exchange_steps(40, EVERY)[0])]], named
    assert warned == []


def test_long_steps_keep_every_window_and_a_zero_floor_never_asks():
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    (g0, g1), _ = _ranks(store)
    g0.step_ms = 80.0
    g0.settle(100)  # 20 steps of 80 ms already last more than 1 s
    g1.step_ms = 80.0
    g1.settle(120)
    assert (g0.stride, g1.stride) == (1, 1) and g1.settled
    assert g1.between(1, 400) == list(range(20, 401, 20))
    off = ExchangeGrid(EVERY, 0.0, Exchange(0, 2, store, lambda k, m: None, slots=EVERY), 0, 0)
    assert off.settled and off.between(1, 100) == [20, 40, 60, 80, 100]


def test_a_rank_that_finds_the_grid_late_removes_the_windows_it_sent_that_nobody_takes():
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    (g0, g1), _ = _ranks(store)
    g0.step_ms = 5.0
    g0.settle(100)
    assert g0.since == 320
    peek = dist.PrefixStore(PREFIX, store)
    # rank 1 was ahead and sent windows 320-380 before it looked (a job whose ranks are not in step)
    for n in (320, 340, 360, 380):
        g1.exchange.transport.send(n, b"row")
        g1.sent = n
    g1.due.extend([380, 400])
    g1.step_ms = 5.0
    g1.settle(380)
    assert g1.since == 320 and g1.stride == 16
    assert peek.check(["320/n"])  # on the grid: rank 0 takes it
    assert not any(peek.check([f"{n}/n"]) or peek.check([f"{n}/rows"]) for n in (340, 360, 380))
    assert list(g1.due) == []  # 380 and 400 are off the grid: not sent


def test_a_grid_line_that_is_not_one_is_said_and_read_as_every_window():
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    (g0, g1), warned = _ranks(store)
    bad_lines = (b"320 3", b"330 16", b"-20 2", b"\x00" * 500, b"320", b"320 16 320 16", b"320 16 960 32",
                 b"640 16 320 16", b" ".join([b"%d 1" % (20 * i) for i in range(1, 18)]))
    for n, bad in enumerate(bad_lines, 1):
        dist.PrefixStore(PREFIX, store).set("grid", bad)
        dist.PrefixStore(PREFIX, store).add("grid/n", 1)
        assert g1.exchange.read_grid() == (n, ())  # no segment: every window
        assert g1.exchange.read_grid(known=n) is None  # (no new post: one round trip, no get)
    assert len(warned) == len(bad_lines) and all("exchange grid" in w and len(w) < 400 for w in warned)
    dist.PrefixStore(PREFIX, store).set("grid", b"320 16 1280 32 2560 16")
    dist.PrefixStore(PREFIX, store).add("grid/n", 1)
    assert g1.exchange.read_grid() == (len(bad_lines) + 1, ((320, 16), (1280, 32), (2560, 16)))
    g1.step_ms = 5.0
    g1.settle(100)
    assert g1.settled and g1.between(1, 100) == [20, 40, 60, 80, 100]


def test_the_floor_stretched_rank_0_adds_a_segment_the_others_find_and_every_window_still_goes_once():
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    scale, now = [1], [0.0]
    (g0, g1), warned = _ranks(store, scale=lambda: scale[0], clock=lambda: now[0])
    for g in (g0, g1):
        g.step_ms = 5.0
    g0.settle(SETTLE_AFTER * EVERY)
    g1.settle(100)
    assert g0.segments == g1.segments == ((0, 1), (320, 16))
    # the budget stretches the floor x2: the hand-overs alone stretch (the grid is one doubling behind)
    scale[0] = 2
    g0.settle(400)
    assert g0.segments == ((0, 1), (320, 16))
    # ... x4: 32 windows (3.2 s) are the fewest that last 2 s; the new segment starts
    # GRID_LEAD_S of steps on, on a step of both strides
    scale[0] = 4
    g0.settle(300)
    assert g0.segments == ((0, 1), (320, 16))  # the last segment is not in force yet: no other
    g0.settle(400)
    since = g0.since
    assert g0.stride == 32 and since >= 400 + GRID_LEAD_S * 1e3 / 5.0 and since % (32 * EVERY) == 0
    # rank 1 looked less than GRID_LOOK_S ago: it goes on with what it has, and sends a window
    # of the old grid past the new `since` (it was ahead), then finds the new one
    g1.settle(420)
    assert g1.segments == ((0, 1), (320, 16))
    peek = dist.PrefixStore(PREFIX, store)
    off = since + 16 * EVERY  # on the old grid, not on the new one
    for n in (since, off):
        g1.exchange.transport.send(n, b"row")
        g1.sent = n
    g1.handed = off + 2 * EVERY
    now[0] += GRID_LOOK_S
    g1.settle(off + EVERY)
    assert g1.segments == g0.segments and warned == []
    assert peek.check([f"{since}/n"]) and not peek.check([f"{off}/n"])  # the key nobody takes, removed
    assert list(g1.due) == []  # nothing due through its hand-over on the new grid
    # the floor back to 1: a third segment, again LEAD_S on
    scale[0] = 1
    g0.settle(since)
    third = g0.since
    assert g0.segments == ((0, 1), (320, 16), (since, 32), (third, 16)) and third % (32 * EVERY) == 0
    # every window goes once, in order, on both ranks' grids; a segment's first exchange carries
    # the windows since the last exchange of the segment before
    now[0] += GRID_LOOK_S
    g1.settle(since + 40)
    end = third + 4 * 16 * EVERY
    want = g0.between(1, end)
    assert want == g1.between(1, end) and all(g0.is_exchange(n) for n in want)
    assert [w for n in want for w in g0.windows(n)] == [exchange_steps(n, EVERY) for n in range(20, end + 1, 20)]
    assert (len(g0.windows(since)), len(g0.windows(since + 32 * EVERY)), len(g0.windows(third))) == (16, 32, 32)
    for step in range(0, end, 13):
        assert g0.next_after(step) == min(n for n in want if n > step)
    # at most MAX_SEGMENTS segments, however often the floor moves
    for i in range(3 * MAX_SEGMENTS):
        scale[0] = 1 + (i % 2) * 7
        g0.settle(g0.segments[-1][0])
    assert len(g0.segments) == MAX_SEGMENTS + 1
    assert g0.figures()["exchange_segments"] == MAX_SEGMENTS
