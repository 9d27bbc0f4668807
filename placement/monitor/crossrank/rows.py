"""An exchange row: its wire format, and rank 0's reading of what the store hands it.

What
    A row is an 8-byte mark (MARK) then (2 + 12 + exchange_every) float64: the exchange's last
    step (seq), the node rank, stragglers.figures.FIELDS and the per-step collective times
    (encode_row, pack_row). What comes from the c10d store is input (the store has no
    authentication): decode_rows keeps only rows of the exchange's windows that are well formed,
    the first of each rank in each window, and counts the rest; batch_windows, split_rows and
    row_ranks hand its rows to the judgement (crossrank/exchange.py Exchange.judge).

Cost
    Rank 0 reads every exchange: up to SMALL_ROWS rows framed as written are checked as Python
    floats, more with numpy's whole-array passes (its per-call overhead is most of the work at a
    few rows, benchmarks/exchange_scale.py).
"""
from __future__ import annotations

import math
import struct
from typing import Optional

from placement.monitor.stragglers.figures import FIELDS, RankFigures

HEADER = ("mark", "seq", "node_rank")
SEQ, NODE = HEADER.index("seq"), HEADER.index("node_rank")
# Each row starts with this 8-byte mark (a NaN whose payload spells PLACE1: no figure is ever it),
# so that rank 0 finds where rows start in what the store holds, and a row of the wrong length,
# which would swallow the next one's mark, is told apart (decode_rows).
MARK = 0x7FF8_504C_4143_4531


def encode_row(seq: int, node_rank: Optional[int], figs: RankFigures, slots: int) -> bytes:
    return pack_row(seq, node_rank, figs.to_row(slots))


def pack_row(seq: int, node_rank: Optional[float], values: list[float]) -> bytes:
    """MARK, seq, node rank, then the figures (RankFigures.to_row)."""
    head = [float(seq), math.nan if node_rank is None else float(node_rank)]
    return struct.pack("<Q", MARK) + struct.pack(f"<{len(head) + len(values)}d", *head, *values)


# Rows up to which rank 0 handles a window's rows as lists (row_ranks):
# numpy's per-call overhead is most of the work at a few ranks (benchmarks/exchange_scale.py).
SMALL_ROWS = 64
ROWS_READ_MAX = 2  # rows parsed per exchange: at most this many times the job's ranks, + ROWS_READ_SLACK
ROWS_READ_SLACK = 16
# Rank 0's checks of a row (_row_checks): its figures' columns after the header, and the
# columns that hold whole numbers with the least each may be (seq counts from 1)
_F_RANK, _F_FIRST, _F_LAST = FIELDS.index("rank"), FIELDS.index("first_step"), FIELDS.index("last_step")
_F_STEP_MS = FIELDS.index("step_ms")
_WHOLE_COLS = [len(HEADER) + FIELDS.index(name) for name in ("rank", "steps", "first_step", "last_step")] + [SEQ]
_WHOLE_LOW = [0.0, 0.0, 0.0, 0.0, 1.0]


def decode_rows(raw: bytes, slots: int, seq: int, world_size: Optional[int] = None, windows: int = 1):
    """(the rows of exchange `seq` as a float64 array, the rows dropped as bad): see
    _decode_rows_np, which this is. Up to SMALL_ROWS rows framed as written and all of them
    well formed (most exchanges), the checks run on the rows as Python floats (_decode_small):
    numpy's calls were most of rank 0's decoding there (~300 us an exchange in a DDP job on
    the dev VM, benchmarks/job_cost.py). Anything else, the numpy path from the start."""
    width = len(HEADER) + len(FIELDS) + slots
    n = len(raw) // 8
    seqs = [float(seq - i * slots) for i in range(max(1, windows))]
    dropped = 0
    cap = None if world_size is None else (ROWS_READ_MAX * world_size * len(seqs) + ROWS_READ_SLACK) * width
    if cap is not None and n > cap:
        dropped, n = (n - cap) // width, cap
    if n % width == 0 and n // width <= SMALL_ROWS:
        small = _decode_small(raw, n // width, width, seqs, world_size)
        if small is not None:
            return small[0], dropped + small[1]
    return _decode_rows_np(raw, slots, seq, world_size, windows)


_INF = math.inf


def _decode_small(raw: bytes, count: int, width: int, seqs: list[float], world_size: Optional[int]):
    """decode_rows' result from `count` rows of `width` values framed as written, each checked as
    _row_checks does; None at the first row that is neither of the exchange's windows and well
    formed nor a well-formed row of an earlier exchange (the numpy path then reads it all)."""
    import numpy as np

    as_f, as_q = struct.Struct(f"<{width}d"), struct.Struct(f"<{width}Q")
    h = len(HEADER)
    rank_col, first_col, last_col, figures_from = h + _F_RANK, h + _F_FIRST, h + _F_LAST, h + _F_STEP_MS
    current, oldest = set(seqs), min(seqs)
    whole = list(zip(_WHOLE_COLS, _WHOLE_LOW))
    kept, seen, dup = [], set(), 0
    for i in range(count):
        at = i * width * 8
        q = as_q.unpack_from(raw, at)
        if q[0] != MARK or MARK in q[1:]:
            return None
        r = as_f.unpack_from(raw, at)
        for col, low in whole:  # integer counts: finite, whole, at least their floor (NaN fails)
            v = r[col]
            if not (low <= v < _INF and v.is_integer()):
                return None
        if world_size is not None and not r[rank_col] < world_size:
            return None
        node = r[NODE]
        if node == node and not (0 <= node < _INF and node.is_integer()):
            return None
        if not r[first_col] <= r[last_col]:
            return None
        for v in r[figures_from:]:  # none negative, none infinite (NaN: a figure not measured)
            if v < 0 or v == _INF:
                return None
        s = r[SEQ]
        if s not in current:
            if s < oldest:
                continue  # a well-formed row of an earlier exchange: left out silently
            return None
        key = (s, r[rank_col])
        if key in seen:
            dup += 1
            continue
        seen.add(key)
        kept.append(r)
    return np.array(kept, dtype="<f8").reshape(-1, width), dup


def _decode_rows_np(raw: bytes, slots: int, seq: int, world_size: Optional[int] = None, windows: int = 1):
    """(the rows of exchange `seq` as a float64 array, the rows dropped as bad). An exchange
    carries `windows` windows (the grid's stride, schedule.py): its rows are those of windows
    seq, seq - slots, ... (their own seq column says which; batch_windows splits them). What
    comes from the c10d store is input (the store has no authentication): a row is kept when it
    is of one of those windows and well formed (a rank of the job, an integer in range; integer step
    counts with first <= last; no infinite figure, none negative; a node rank that is an
    integer or unknown), and only the first row of a rank in a window; a row of an earlier
    exchange (a peer's stale write) is left out silently; a row of the wrong length (which would
    shift every later row) is stepped over to the next row that starts with a mark, and counted;
    past ROWS_READ_MAX x world_size x windows + ROWS_READ_SLACK rows nothing is parsed."""
    import numpy as np

    width = len(HEADER) + len(FIELDS) + slots
    arr = np.frombuffer(raw[:len(raw) // 8 * 8], dtype="<f8")
    marks = arr.view("<u8") == MARK
    dropped = 0
    seqs = np.array([seq - i * slots for i in range(max(1, windows))], dtype="<f8")
    cap = None if world_size is None else (ROWS_READ_MAX * world_size * len(seqs) + ROWS_READ_SLACK) * width
    if cap is not None and len(arr) > cap:
        dropped += (len(arr) - cap) // width
        arr, marks = arr[:cap], marks[:cap]
    if len(arr) % width == 0:
        rows = arr.reshape(-1, width)
        good, stale = _row_checks(rows, marks.reshape(-1, width), seqs, world_size)
        if (good | stale).all():  # framed as written: the common case, vectorised
            return _first_of_each_rank(rows[good], dropped)
    # A row of the wrong length in the stream: walk it, row by row from each mark.
    kept, pos = [], 0
    starts = np.flatnonzero(marks)
    while True:
        at = starts[np.searchsorted(starts, pos):]
        if not len(at):
            break
        if pos == 0 and at[0] != 0:
            dropped += 1  # bytes before the first mark (a bad row is counted where it starts)
        pos = int(at[0])
        if pos + width > len(arr):
            dropped += 1
            break
        good, stale = _row_checks(arr[pos:pos + width].reshape(1, width), marks[pos:pos + width].reshape(1, width),
                                  seqs, world_size)
        if good[0]:
            kept.append(arr[pos:pos + width])
        elif not stale[0]:
            dropped += 1
        pos += width if good[0] or stale[0] else 1
    rows = np.array(kept, dtype="<f8").reshape(-1, width)
    return _first_of_each_rank(rows, dropped)


def _row_checks(rows, marks, seqs, world_size: Optional[int]):
    """(rows of the exchange's windows `seqs` well formed, well-formed rows of an earlier
    exchange) masks; `marks`: where MARK is, in the same shape (a row has it first and nowhere
    else). A few whole-array passes: numpy's per-call overhead is most of the cost at a few
    rows, and rank 0 runs this at every exchange."""
    import numpy as np

    h = len(HEADER)
    with np.errstate(invalid="ignore"):
        whole = rows[:, _WHOLE_COLS]  # integer counts: finite, whole, at least their floor (NaN fails all)
        ok = ((whole == np.floor(whole)) & (whole >= _WHOLE_LOW) & (whole < np.inf)).all(axis=1)
        ok &= marks[:, 0] & ~marks[:, 1:].any(axis=1)
        if world_size is not None:
            ok &= rows[:, h + _F_RANK] < world_size
        node = rows[:, NODE]
        ok &= (node != node) | ((node == np.floor(node)) & (node >= 0) & (node < np.inf))
        ok &= rows[:, h + _F_FIRST] <= rows[:, h + _F_LAST]
        figures = rows[:, h + _F_STEP_MS:]
        ok &= ~((figures < 0) | (figures == np.inf)).any(axis=1)  # NaN: a figure not measured
        seq = rows[:, SEQ]
        current = (seq[:, None] == seqs).any(axis=1)
        return ok & current, ok & ~current & (seq < seqs.min())


def _first_of_each_rank(rows, dropped: int):
    """The first row of each rank in each window (a second is a duplicate: dropped and counted)."""
    import numpy as np

    if len(rows) <= 1:
        return rows, dropped
    seq, rank = rows[:, SEQ], rows[:, len(HEADER) + _F_RANK]
    top, ranks = seq.max(), rank.max() + 1
    if (top - seq.min() + 1) * ranks < 2.0 ** 52:
        # one key per (window, rank), exact in float64 (both whole: _row_checks); np.unique of
        # rows is a sort of tuples, several times slower at the few rows of most exchanges
        _, first = np.unique((top - seq) * ranks + rank, return_index=True)
    else:
        _, first = np.unique(rows[:, [SEQ, len(HEADER) + _F_RANK]], axis=0, return_index=True)
    if len(first) == len(rows):
        return rows, dropped
    first.sort()
    return rows[first], dropped + len(rows) - len(first)


def batch_windows(rows, seq: int, slots: int, windows: int):
    """The rows of each window an exchange carried (decode_rows' rows), oldest window first:
    [(window seq, its rows)]."""
    col = rows[:, SEQ]
    return [(w, rows[col == w]) for w in (seq - i * slots for i in reversed(range(max(1, windows))))]


def split_rows(rows):
    """(the figure rows: RankFigures.to_row per rank, rank -> node rank) of decoded exchange rows."""
    rank = len(HEADER) + FIELDS.index("rank")
    node_of = {int(r): (None if n != n else int(n)) for r, n in zip(rows[:, rank].tolist(), rows[:, NODE].tolist())}
    return rows[:, len(HEADER):], node_of


def row_ranks(rows, world_size: int) -> tuple[list[int], list[int], list[int]]:
    """(ranks, the last step of each one's row, the job's ranks with no row) of decoded exchange
    rows, ranks outside the job dropped (numpy: rank 0 does this for every rank at every exchange;
    below SMALL_ROWS rows, lists: numpy's call overhead is most of it there)."""
    import numpy as np

    if len(rows) <= SMALL_ROWS:
        pairs = [(int(r), int(s)) for r, s in zip(rows[:, len(HEADER) + FIELDS.index("rank")].tolist(),
                                                  rows[:, len(HEADER) + FIELDS.index("last_step")].tolist())
                 if 0 <= r < world_size]
        seen = {r for r, _ in pairs}
        return [r for r, _ in pairs], [s for _, s in pairs], [r for r in range(world_size) if r not in seen]
    ranks = rows[:, len(HEADER) + FIELDS.index("rank")].astype(int)
    keep = (ranks >= 0) & (ranks < world_size)
    seen = np.zeros(world_size, dtype=bool)
    seen[ranks[keep]] = True
    return (ranks[keep].tolist(), rows[keep, len(HEADER) + FIELDS.index("last_step")].astype(int).tolist(),
            np.flatnonzero(~seen).tolist())
