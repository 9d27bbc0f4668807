"""Rank 0's judgement at 4,096 ranks from the rows the store hands it (no processes): the event
names the worst ranks in full and counts the rest by kind, the same verdicts a full classify gives."""
import json
import random


from placement.monitor.crossrank.exchange import decode_rows, encode_row, split_rows
from placement.monitor.stragglers.event import NAMED, TRIAGE_ABOVE, WindowJudgement, judge_rows, straggler_event
from placement.report.cluster import straggler_ranks
from placement.monitor.stragglers.figures import RankFigures, Thresholds
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
    rows = decode_rows(raw, SLOTS, 3)
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
