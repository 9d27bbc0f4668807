"""What the live metrics cost: a rank's monitor thread per step record, and the node's exporter per
scrape at 8 ranks a node (and more), with the bytes of one scrape.

What
    - rank: RankPublisher.write() (the record sink the monitor thread calls per batch) over batches
      of 20 real StepRecords, with a snapshot file published at most every second as under
      placerun: us per record, on this thread's CPU clock.
    - node: N ranks' snapshots (state.py) in a directory, each with a long job's figures (tuner
      actions, stalls, a straggler named on rank 0's), read and rendered by the placerun agent's
      collector through prometheus_client's text exposition, as one scrape is: CPU ms per scrape
      (median of repeats), bytes, series; per rank and per node (placement.metrics.per_rank=false).
    Nothing here runs on a training thread: the step hook is untouched by the metrics
    (benchmarks/monitor_overhead.py measures it).

    python benchmarks/metrics_scrape.py [--quick]

Last line: {"rank_us_per_record": ..., "scrape_cpu_ms": {"8": ..., ...}, "scrape_bytes": {...},
"series": {...}, "node_aggregate": {...}}
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from placement.events import EventKind  # noqa: E402
from placement.metrics.exporter import SnapshotCollector  # noqa: E402
from placement.metrics.rank import RankPublisher  # noqa: E402
from placement.metrics.state import RankMetrics, SnapshotFile  # noqa: E402
from placement.records.step import RoleSample, StepRecord  # noqa: E402
from placement.roles import ThreadRole  # noqa: E402


def records(first: int, n: int) -> list[StepRecord]:
    return [StepRecord(0, s, 1e9 + s, 10.0 + s % 5, data_ms=1.0, comm_ms=2.0, comm_count=3,
                       roles={ThreadRole.MAIN: RoleSample(threads=1, cpu_ms=6.0, runq_ms=0.3),
                              ThreadRole.NCCL: RoleSample(threads=2, cpu_ms=0.5, runq_ms=0.01)})
            for s in range(first, first + n)]


def rank_cost(steps: int, directory: str) -> float:
    m = RankMetrics({"run": "r", "rank": "0", "local_rank": "0", "node": "n0", "gpu_uuid": ""})
    pub = RankPublisher(m, snapshot=SnapshotFile(m, directory, 0, 1.0, lambda k, line: None))
    batches = [records(1 + i, 20) for i in range(0, steps, 20)]
    c0 = time.thread_time_ns()
    for b in batches:
        pub.write(b)
    return (time.thread_time_ns() - c0) / 1e3 / steps


def fill(directory: str, ranks: int) -> None:
    for r in range(ranks):
        m = RankMetrics({"run": "r", "rank": str(r), "local_rank": str(r % 8), "node": f"node{r // 8:04d}",
                         "gpu_uuid": f"GPU-{r:08x}-0000-0000-0000-000000000000"})
        m.add_records(records(1, 200))
        m.on_event({"type": EventKind.TUNE, "rank": r, "phase": "applied"})
        m.on_event({"type": EventKind.STALL, "rank": r, "phase": "stalled"})
        m.set_binding({"main": (str(2 * r), "0"), "nccl": (str(2 * r + 1), "0"), "pin_memory": (str(2 * r + 1), "0"),
                       "dataloader": ("100-103", "0"), "other": ("100-103", "0")})
        if r == 0:
            m.judged([(3, "cpu-slow", 6.0, "node0000")])
        SnapshotFile(m, directory, r, 1.0, lambda k, line: None).publish(force=True)


def scrape(directory: str, per_rank: bool, repeats: int) -> tuple[float, int, int]:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(directory, per_rank, print))
    times, text = [], b""
    for _ in range(repeats):
        c0 = time.thread_time_ns()
        text = generate_latest(registry)
        times.append((time.thread_time_ns() - c0) / 1e6)
    series = sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))
    return statistics.median(times), len(text), series


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    steps, repeats = (2000, 5) if args.quick else (20000, 20)
    out: dict = {"scrape_cpu_ms": {}, "scrape_bytes": {}, "series": {}, "node_aggregate": {}}
    with tempfile.TemporaryDirectory() as d:
        out["rank_us_per_record"] = round(rank_cost(steps, d), 2)
    print(f"rank: {out['rank_us_per_record']} us of the monitor thread per step record (snapshot at most every 1 s)")
    for ranks in (8, 64) if args.quick else (8, 64, 512):
        with tempfile.TemporaryDirectory() as d:
            fill(d, ranks)
            ms, size, series = scrape(d, True, repeats)
            agg_ms, agg_size, agg_series = scrape(d, False, repeats)
        out["scrape_cpu_ms"][str(ranks)] = round(ms, 2)
        out["scrape_bytes"][str(ranks)] = size
        out["series"][str(ranks)] = series
        out["node_aggregate"][str(ranks)] = {"cpu_ms": round(agg_ms, 2), "bytes": agg_size, "series": agg_series}
        print(f"{ranks:4d} ranks: one scrape {ms:7.2f} ms CPU, {size:8d} bytes, {series:6d} series; "
              f"per node summed: {agg_ms:6.2f} ms, {agg_size:7d} bytes, {agg_series:5d} series")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
