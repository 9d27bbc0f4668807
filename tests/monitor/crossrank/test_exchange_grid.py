"""The exchange grid (placement/monitor/crossrank/schedule.py): at short steps rank 0 agrees with
the ranks, through a real TCPStore, to exchange at every 2^k-th window only, each exchange
carrying the windows since the one before; every rank then sends the same windows, each judged
on its own, a rank that found the grid late removes the keys nobody will take, and a grid line
that is not one is said and read as every window."""
import torch.distributed as dist

from placement.monitor.crossrank.exchange import PREFIX, Exchange, exchange_steps
from placement.monitor.stragglers.figures import RankFigures
from placement.monitor.crossrank.schedule import LEAD, SETTLE_AFTER, ExchangeGrid

EVERY = 20


def _ranks(store, n: int = 2, min_s: float = 1.0):
    warned: list = []
    grids = [ExchangeGrid(EVERY, min_s, Exchange(r, n, store, lambda key, msg: warned.append(msg), slots=EVERY), r, 0)
             for r in range(n)]
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
    for bad in (b"320 3", b"330 16", b"-20 2", b"\x00" * 500, b"320"):
        dist.PrefixStore(PREFIX, store).set("grid", bad)
        dist.PrefixStore(PREFIX, store).add("grid/n", 1)
        assert g1.exchange.read_grid() == (0, 1)
    assert len(warned) == 5 and all("exchange grid" in w and len(w) < 400 for w in warned)
    g1.step_ms = 5.0
    g1.settle(100)
    assert g1.settled and g1.between(1, 100) == [20, 40, 60, 80, 100]
