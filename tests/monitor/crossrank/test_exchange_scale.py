"""Rank 0's judgement at 4,096 ranks from the rows the store hands it (no processes): the event
names the worst ranks in full and counts the rest by kind, the same verdicts a full classify gives."""
import json
import random


from placement.monitor.crossrank.rows import HEADER, SMALL_ROWS, decode_rows, encode_row, row_ranks, split_rows
from placement.monitor.stragglers.event import NAMED, TRIAGE_ABOVE, WindowJudgement, judge_rows, straggler_event
from placement.report.cluster import straggler_ranks
from placement.monitor.stragglers.figures import FIELDS, RankFigures, Thresholds
from placement.monitor.stragglers.classify import classify

T = 1_800_000_000.0
SLOTS = 10


def figs(rank, kind=""):
    rng = random.Random(rank)
    late = {"cpu-slow": 0.02, "compute-slow": 0.012, "data-slow": 0.025}.get(kind, 0.0)
    # a rank late by L ms waits L ms less in the step's collectives than the earliest
    comm = tuple(40.0 - late * 1e3 - rng.random() * 0.2 for i in range(SLOTS))
    return RankFigures(rank, SLOTS, 21, 30, 100.0 + rng.random(), 0.5 + (25.0 if kind == "data-slow" else 0.0),
                       sum(comm) / SLOTS, 0.1 + (20.0 if kind == "cpu-slow" else 0.0), 0.05, 75.0, None, comm)


def kind(rank):
    return "cpu-slow" if 40 <= rank < 48 else "data-slow" if rank == 4000 else \
        "compute-slow" if rank % 100 == 7 else ""


def test_4096_ranks_name_the_worst_and_count_the_rest_by_kind():
    world = 4096
    raw = b"".join(encode_row(3, r // 8, figs(r, kind(r)), SLOTS) for r in range(world))
    raw += encode_row(2, 0, figs(5), SLOTS)  # a stale row of the previous exchange is dropped
    rows, dropped = decode_rows(raw, SLOTS, 3, world)
    assert dropped == 0  # a stale row is no bad row
    assert rows.shape[0] == world and world > TRIAGE_ABOVE
    figures, report, nodes = judge_rows(*split_rows(rows), SLOTS, None, Thresholds())
    assert len(figures) < world // 4  # candidates and a sample, not every rank
    assert len(report.stragglers) == NAMED
    assert report.stragglers[0].kind == "data-slow" and report.stragglers[0].ranks == [4000]
    assert {s.ranks[0] for s in report.stragglers[1:]} < set(range(40, 48))
    expected = {k: sorted(r for r in range(world) if kind(r) == k) for k in ("cpu-slow", "data-slow", "compute-slow")}
    event = straggler_event(WindowJudgement(report, figures, nodes, world, []))
    assert straggler_ranks(event) == expected  # named + counted = every slow rank, by kind
    assert event["more"]["compute-slow"]["count"] == len(expected["compute-slow"])
    assert nodes == {4000: 500, **{r: 5 for s in report.stragglers[1:] for r in s.ranks}}
    assert isinstance(event["waiting"], str) and len(json.dumps(event)) < 8000
    # The same verdicts as classify over every rank's figures.
    full = classify([figs(r, kind(r)) for r in range(world)])
    assert {k: full.names(k) for k in expected} == expected


def test_rows_framed_as_written_keep_the_first_of_each_rank_in_each_window():
    """The vectorised path (every row of the right length, each of the exchange's windows or an
    earlier one): an exchange of two windows (steps to 10 and to 20) with a second row of rank 1
    in the later one, other figures: dropped and counted; a row of an earlier exchange left out
    silently; the rest kept in the order written."""
    import dataclasses

    def row(seq, rank, step_ms=100.0):
        return encode_row(seq, 0, dataclasses.replace(figs(rank), rank=rank, step_ms=step_ms), SLOTS)

    raw = row(10, 0) + row(10, 1) + row(20, 1) + row(20, 0) + row(20, 1, step_ms=999.0) + row(5, 2) + row(10, 2)
    rows, dropped = decode_rows(raw, SLOTS, 20, world_size=4, windows=2)
    seq, rank = rows[:, HEADER.index("seq")].tolist(), rows[:, len(HEADER) + FIELDS.index("rank")].tolist()
    assert list(zip(seq, rank)) == [(10, 0), (10, 1), (20, 1), (20, 0), (10, 2)]
    assert rows[2, len(HEADER) + FIELDS.index("step_ms")] == 100.0  # the first of rank 1's two rows
    assert dropped == 1


def test_a_few_rows_checked_as_python_floats_decode_as_numpy_decodes_them():
    """decode_rows checks up to SMALL_ROWS rows framed as written as Python floats and hands
    anything else to the numpy path: on 3,000 random exchanges of good rows, stale and future
    ones, duplicates, and rows spoilt in one value (NaN, infinite, negative, fractional, out of
    range, a mark inside, the mark gone, a byte short), both give the same rows and the same
    count dropped."""
    import dataclasses
    import math
    import struct

    import numpy as np

    from placement.monitor.crossrank.rows import MARK, _decode_rows_np, _decode_small

    rng = random.Random(7)
    width = len(HEADER) + len(FIELDS) + SLOTS
    spoil = [math.nan, math.inf, -math.inf, -1.0, 0.5, 1e300, 7.0, 4096.0]
    checked = {"fast": 0, "numpy": 0}
    for case in range(3000):
        world, windows, seq = rng.choice([1, 2, 4, 9]), rng.choice([1, 2, 3]), rng.choice([20, 30, 50])
        raw = b""
        for _ in range(rng.randint(0, 3 * world)):
            w = seq - SLOTS * rng.choice([0, 0, 0, 1, 2, 3, 5, -1])
            fig = dataclasses.replace(figs(rng.randrange(world + 1)), rank=rng.randrange(world + 1))
            row = encode_row(w if w > 0 else 1, rng.choice([0, 1, None]), fig, SLOTS)
            if rng.random() < 0.15:  # one value spoilt, or its framing
                values = list(struct.unpack(f"<{width}d", row))
                how = rng.random()
                if how < 0.7:
                    values[rng.randrange(1, width)] = rng.choice(spoil)
                    row = struct.pack("<Q", MARK) + struct.pack(f"<{width - 1}d", *values[1:])
                elif how < 0.8:
                    row = row[:-8]
                elif how < 0.9:
                    row = row[:16] + struct.pack("<Q", MARK) + row[24:]
                else:
                    row = struct.pack("<d", 1.0) + row[8:]
            raw += row
        if rng.random() < 0.05:
            raw += b"\x01\x02\x03"  # bytes past the last whole value
        ws = world if rng.random() < 0.9 else None  # (None: no rank bound, as at close)
        got = decode_rows(raw, SLOTS, seq, ws, windows)
        want = _decode_rows_np(raw, SLOTS, seq, ws, windows)
        assert got[1] == want[1], case
        assert got[0].shape == want[0].shape and np.array_equal(got[0], want[0], equal_nan=True), case
        n = len(raw) // 8
        fast = n % width == 0 and _decode_small(raw, n // width, width, [float(seq - i * SLOTS) for i in
                                                                        range(windows)], ws) is not None
        checked["fast" if fast else "numpy"] += 1
    assert checked["fast"] > 500 and checked["numpy"] > 500, checked  # both paths well exercised


def test_bad_rows_from_the_store_are_dropped_counted_and_the_window_still_judged():
    """What comes from the c10d store is input: rank 0 over a real TCPStore, world 4; beside the
    good rows of ranks 1 and 3 come a row whose rank is NaN, one whose rank is infinite, one whose
    node rank is infinite, one of a rank outside the job, a duplicate of rank 1, a negative figure
    and a row of the wrong length before rank 3's (which would shift every later row). Each bad
    one is dropped and counted, said once, and the window is judged on ranks 0, 1 and 3."""
    import math

    import torch.distributed as dist

    from placement.monitor.crossrank.exchange import Exchange, StoreTransport
    from placement.monitor.crossrank.rows import pack_row
    from placement.monitor.stragglers.figures import FIELDS, RankFigures

    every = 10

    def row(rank, node=0.0, step_ms=20.0):
        figs = RankFigures(0, every, 1, 10, step_ms, 0.5, 5.0, 0.1, 0.05, 10.0, None, tuple(5.0 for _ in range(every)))
        values = figs.to_row(every)
        values[FIELDS.index("rank")] = rank
        return pack_row(10, node, values)

    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    said = []
    ex = Exchange(0, 4, store, lambda key, msg: said.append((key, msg)), slots=every)
    ex.WAIT_S = 0.5
    peer = StoreTransport(store, 1, 4)
    for raw in (row(1.0), row(math.nan), row(math.inf), row(2.0, node=math.inf), row(7.0), row(1.0),
                row(2.0, step_ms=-5.0), row(2.0)[:-24], row(3.0)):
        peer.store.append("10/rows", raw)
    peer.store.add("10/n", 3)
    figs0 = RankFigures(0, every, 1, 10, 20.0, 0.5, 5.0, 0.1, 0.05, 10.0, None, tuple(5.0 for _ in range(every)))
    assert ex.submit([figs0]) == []
    verdicts = ex.collect(block=True)
    assert len(verdicts) == 1 and verdicts[0].ranks_judged == 3, verdicts
    verdict = verdicts[0]
    assert sorted(int(f.rank) for f in verdict.figures) == [0, 1, 3]
    assert ex.rows_dropped == 7, ex.rows_dropped
    assert [k for k, _ in said].count("exchange-bad-rows") == 1


def test_rank_0s_own_rows_never_go_through_the_store_and_a_row_that_claims_them_is_a_duplicate():
    """Rank 0 judges: its own rows stay in the process (two round trips an exchange fewer) and are
    read first, so a row in the store that says it is rank 0's (a stale or forged one) is a
    duplicate, dropped and counted; rank 0's figures are its own."""
    import torch.distributed as dist

    from placement.monitor.crossrank.exchange import PREFIX, Exchange, StoreTransport
    from placement.monitor.crossrank.rows import pack_row

    every = 10

    def figures(rank, step_ms):
        return RankFigures(rank, every, 1, 10, step_ms, 0.5, 5.0, 0.1, 0.05, 10.0, None, tuple(5.0 for _ in range(every)))

    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    said = []
    ex = Exchange(0, 3, store, lambda key, msg: said.append(key), slots=every)
    assert ex.submit([figures(0, 20.0)]) == []
    prefixed = dist.PrefixStore(PREFIX, store)
    assert not prefixed.check(["10/rows"]) and not prefixed.check(["10/n"])  # nothing of rank 0's in the store
    peer = StoreTransport(store, 1, 3)
    for rank, step_ms in ((1, 21.0), (0, 999.0), (2, 22.0)):  # rank 1 sends its row and one claiming rank 0's
        peer.store.append("10/rows", pack_row(10, 0, figures(rank, step_ms).to_row(every)))
    peer.store.add("10/n", 2)
    verdicts = ex.collect(block=True)
    assert len(verdicts) == 1 and verdicts[0].ranks_judged == 3
    assert {f.rank: f.step_ms for f in verdicts[0].figures} == {0: 20.0, 1: 21.0, 2: 22.0}
    assert ex.rows_dropped == 1 and said.count("exchange-bad-rows") == 1


def test_row_ranks_by_lists_at_a_few_ranks_says_what_numpy_says_at_many():
    """row_ranks handles up to SMALL_ROWS rows as lists (numpy's call overhead was most of rank
    0's work per window at a few ranks) and more with numpy: the same ranks, last steps and
    missing ranks either way, rows of ranks outside the job dropped."""
    import numpy as np

    world = 2 * SMALL_ROWS
    present = [r for r in range(world) if r % 3]  # every third rank sent nothing
    raw = b"".join(encode_row(3, 0, figs(r), SLOTS) for r in present)
    rows, _ = decode_rows(raw, SLOTS, 3, world)
    assert len(rows) > SMALL_ROWS
    big = row_ranks(rows, world)
    assert big == (present, [30] * len(present), [r for r in range(world) if r not in present])
    small = rows[:SMALL_ROWS // 2]
    in_lists = row_ranks(small, world)
    assert in_lists == (present[:SMALL_ROWS // 2], [30] * (SMALL_ROWS // 2),
                        [r for r in range(world) if r not in present[:SMALL_ROWS // 2]])
    # The numpy path over the same rows (padded past SMALL_ROWS with rows of a rank outside the
    # job, which both drop) agrees.
    outside = np.repeat(small[:1], SMALL_ROWS, axis=0)
    outside[:, len(HEADER) + FIELDS.index("rank")] = world + 5
    assert row_ranks(np.concatenate([small, outside]), world) == in_lists
    assert row_ranks(np.concatenate([small[:3], outside[:2]]), world) == row_ranks(small[:3], world)
