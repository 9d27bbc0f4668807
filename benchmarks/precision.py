"""How often rank 0 names a straggler on a job where nothing is wrong, how fast it names real ones,
and whether the cost it gives them is the one injected.

A real gloo job (WORLD ranks on this host, each step a STEP_MS sleep then an all_reduce, as a
balanced data-parallel loop; placement.attach with its DEFAULT monitor settings unless
overridden) runs:
- balanced: --windows exchange windows (60 with --quick, 2,000 without) every rank alike; false
  events = `straggler` events naming a rank in them, per 1,000 windows (job-wide slowdowns, which
  name no rank, are counted apart);
- injected: for each of 5%, 10% and 30%, from the first step of an exchange window rank 1 sleeps
  that share of its median balanced step longer each step (it is X% slower) for INJECT_WINDOWS
  windows, then GAP_WINDOWS balanced windows follow.
  Per injection: windows from its first slow step to the end of the first window whose event names
  rank 1 (the window that holds the onset counts as 1), and the cost that event gives against the
  cost injected (rank 1's extra sleep, ms per step: the job's step grows by that much). Events
  naming someone in the gap windows after the first one are false too.

    python benchmarks/precision.py [--quick] [--windows N] [placement.monitor.KEY=VALUE ...]

Last line: {"false_per_1000_windows": ..., "named_within_windows": {"5": ..., "10": ..., "30": ...}, ...}
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_ranks import attach_rank, monitor_config, start_ranks  # noqa: E402  (benchmarks/, the script's own folder)

WORLD = 3
STEP_MS = 10.0
INJECTED_PCT = (5, 10, 30)
INJECT_WINDOWS, GAP_WINDOWS = 4, 4


def schedule(balanced_windows: int, every: int) -> tuple[int, dict[int, tuple[int, int]]]:
    """(total steps, pct -> (first slow step, last slow step)): each injection starts at the first
    step of an exchange window (crossrank/exchange.py exchange_steps) after the balanced ones."""
    from placement.monitor.crossrank.exchange import exchange_steps

    def window_start(k: int) -> int:  # the first step of the k-th exchange window
        return exchange_steps(k * every, every)[0]

    out = {}
    k = balanced_windows + 2
    for pct in INJECTED_PCT:
        first = window_start(k)
        out[pct] = (first, first + INJECT_WINDOWS * every - 1)
        k += INJECT_WINDOWS + GAP_WINDOWS
    return window_start(k) + every, out


def worker(log_dir: str, overrides: str, balanced_windows: int, every: int) -> None:
    import torch
    import torch.distributed as dist

    rank, h = attach_rank(log_dir, overrides)
    total, injected = schedule(balanced_windows, every)
    x = torch.ones(1024)
    lengths: list[float] = []  # rank 1's balanced steps, seconds: what "X% slower" is of
    last = time.perf_counter()
    for step in range(1, total + 1):
        pct = next((p for p, (a, b) in injected.items() if a <= step <= b), 0) if rank == 1 else 0
        extra_s = pct / 100.0 * statistics.median(lengths) if pct else 0.0
        time.sleep(STEP_MS / 1e3 + extra_s)
        dist.all_reduce(x)
        h.step()
        now = time.perf_counter()
        if not pct and len(lengths) < 1000:
            lengths.append(now - last)
        last = now
    if rank == 1:
        Path(log_dir, "step_s.json").write_text(json.dumps(statistics.median(lengths)))
    h.close()
    dist.barrier()
    os._exit(0)  # gloo's teardown can outlive its peers' exit; the logs are flushed


def run(balanced_windows: int, every: int, overrides: list[str], keep: str = "") -> dict:
    from placement.report.logs import read_logs

    with tempfile.TemporaryDirectory(prefix="placement-precision-") as d:
        log_dir = Path(keep or d)
        log_dir.mkdir(parents=True, exist_ok=True)
        procs = start_ranks(WORLD, [__file__, "--worker", str(log_dir), ",".join(overrides), str(balanced_windows),
                                    str(every)])
        t0 = time.monotonic()
        for p in procs:
            _, err = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise SystemExit(f"a rank failed (exit {p.returncode}): {err.decode(errors='replace')[-2000:]}")
        wall_s = time.monotonic() - t0
        log = read_logs([str(log_dir)])
        step_s = json.loads((log_dir / "step_s.json").read_text())
    events = sorted((e for e in log.events if e.get("type") == "straggler"), key=lambda e: e["steps"][1])
    total, injected = schedule(balanced_windows, every)
    balanced_last = injected[INJECTED_PCT[0]][0] - 1

    def names(e: dict, rank: int) -> bool:
        return any(s.get("ranks") == [rank] for s in e.get("stragglers") or [])

    def judged_after(lo: int, hi: int) -> list[dict]:
        return [e for e in events if lo <= e["steps"][0] and e["steps"][1] <= hi]

    quiet = judged_after(1, balanced_last)
    named_within, cost_ms, cost_pct = {}, {}, {}
    for i, pct in enumerate(INJECTED_PCT):
        first, last = injected[pct]
        hit = next((e for e in events if e["steps"][1] >= first and e["steps"][0] <= last and names(e, 1)), None)
        named_within[str(pct)] = None if hit is None else -(-(hit["steps"][1] - first + 1) // every)
        s = None if hit is None else next(s for s in hit["stragglers"] if s.get("ranks") == [1])
        cost_ms[str(pct)] = None if s is None else s.get("cost_ms_per_step")
        cost_pct[str(pct)] = None if s is None else s.get("cost_pct")
        gap_end = injected[INJECTED_PCT[i + 1]][0] - 1 if i + 1 < len(INJECTED_PCT) else total
        quiet += judged_after(last + every + 1, gap_end)  # from the window after the one holding the end
    false_events = [e for e in quiet if e.get("stragglers")]  # naming a rank where none was slowed
    gap_windows = len(INJECTED_PCT) * (GAP_WINDOWS - 1)
    windows = balanced_windows + gap_windows
    return {
        "world": WORLD, "step_ms": STEP_MS, "exchange_every": every, "wall_s": round(wall_s, 1),
        "balanced_windows": windows, "false_straggler_events": len(false_events),
        "false_per_1000_windows": round(1000.0 * len(false_events) / windows, 2),
        # a slowdown every rank shared (the collectives, with this VM's other load): said once each,
        # no rank named; not a false straggler, counted apart
        "job_wide_events": sum(1 for e in quiet if e.get("job_wide")),
        "named_within_windows": named_within,
        "balanced_step_ms": round(step_s * 1e3, 3),
        "injected_ms_per_step": {str(p): round(step_s * 1e3 * p / 100.0, 3) for p in INJECTED_PCT},
        "named_cost_ms_per_step": cost_ms, "named_cost_pct": cost_pct,
        "met": len(false_events) * 10_000 <= windows and all(v is not None and v <= 2 for v in named_within.values()),
        "overrides": overrides,
    }


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="60 balanced windows instead of 2,000 (under a minute)")
    p.add_argument("--windows", type=int, default=None, help="balanced exchange windows (default 2,000; --quick 60)")
    p.add_argument("--log-dir", default="", help="keep the ranks' logs here (default: a temporary directory)")
    p.add_argument("overrides", nargs="*", metavar="placement.monitor.KEY=VALUE")
    args = p.parse_args(argv)
    cfg = monitor_config("precision", args.overrides)  # bad overrides: one line, exit 2
    if cfg is None:
        return 2
    windows = args.windows if args.windows is not None else (60 if args.quick else 2000)
    if windows < 1:
        print(f"precision: --windows {windows} is not valid; valid: a whole number of windows >= 1", file=sys.stderr)
        return 2
    print(json.dumps(run(windows, cfg.monitor.exchange_every, args.overrides, args.log_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
