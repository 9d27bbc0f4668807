"""Rank 0's straggler judgement re-run over a job's logs, with the monitor's thresholds or others:
how many windows would name a rank, and how many did when the job ran.

Each exchange window is rebuilt from the step records every rank logged, as the live exchange
builds it (crossrank/exchange.py exchange_steps, stragglers/figures.py figures_from_records), then judged by the monitor's own
classify and Naming, with the comm baseline kept as the exchange keeps it. On a log written with
the same settings the re-judged events are the logged ones (the soak of docs/monitor.md: 63 named
and 5 job-wide, both ways); with other overrides, what those would have named. For a balanced job
every window that names a rank is a false straggler.

    python benchmarks/rejudge.py LOGS... [--quick] [placement.monitor.KEY=VALUE ...]

(--quick: the first 1,000 windows.) Last line: {"windows": ..., "named_windows": ..., "logged_named_windows": ...}
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gloo_ranks import monitor_config  # noqa: E402  (benchmarks/, the script's own folder)

QUICK_WINDOWS = 1000


def rejudge(records: dict, every: int, th, max_windows: int = 0) -> dict:
    """Windows judged, those naming a rank, job-wide ones, per rank the windows naming it, and the
    windows with a material candidate and the longest run of them for one rank (what
    monitor.straggler_persist_windows must stay above on a balanced job)."""
    from placement.monitor.stragglers.naming import Naming
    from placement.monitor.stragglers.classify import classify, comm_baseline, next_transfer_history
    from placement.monitor.crossrank.exchange import exchange_steps
    from placement.monitor.stragglers.figures import figures_from_records

    ranks = sorted(records)
    by_step = {r: {rec.step: rec for rec in records[r]} for r in ranks}
    last = min(max(by_step[r], default=0) for r in ranks)
    naming, history = Naming(th), []
    out = {"windows": 0, "named_windows": 0, "job_wide_windows": 0, "named_ranks": {}, "first_step": None,
           "last_step": None, "candidate_windows": 0, "longest_candidate_streak": 0}
    streak: dict[int, int] = {}  # rank -> consecutive windows as a material candidate
    step = 0
    while not max_windows or out["windows"] < max_windows:
        step += every
        first, final = exchange_steps(step, every)
        if final > last:
            break
        figures = [figures_from_records(r, [by_step[r][s] for s in range(first, final + 1) if s in by_step[r]],
                                        first, final) for r in ranks]
        report = classify(figures, comm_baseline(history, th), th)
        named = naming.decide(report, first)
        history = next_transfer_history(history, report)
        out["windows"] += 1
        material = {r for c in report.stragglers if c.material for r in c.ranks}
        out["candidate_windows"] += bool(material)
        streak = {r: streak.get(r, 0) + 1 for r in material}
        out["longest_candidate_streak"] = max([out["longest_candidate_streak"], *streak.values()])
        out["first_step"] = out["first_step"] or first
        out["last_step"] = final
        if named.stragglers:
            out["named_windows"] += 1
            for r in named.names():
                out["named_ranks"][str(r)] = out["named_ranks"].get(str(r), 0) + 1
        out["job_wide_windows"] += named.job_wide is not None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", help="log files or directories, then placement.monitor.KEY=VALUE overrides")
    p.add_argument("--quick", action="store_true", help=f"the first {QUICK_WINDOWS:,} windows")
    args = p.parse_args(argv)
    overrides = [a for a in args.logs if a.startswith("placement.")]
    paths = [a for a in args.logs if not a.startswith("placement.")]
    cfg = monitor_config("rejudge", overrides)  # bad overrides: one line, exit 2
    if cfg is None:
        return 2
    from placement.errors import PlacementError
    from placement.report.logs import read_logs

    try:
        log = read_logs(paths)
    except PlacementError as e:
        print(f"rejudge: {e}", file=sys.stderr)
        return 2
    if not log.records or len(log.records) < 2:
        print(f"rejudge: {' '.join(paths)} holds the step records of {len(log.records or {})} rank(s); "
              "valid: the logs of a job of 2 ranks or more", file=sys.stderr)
        return 2
    from placement.monitor.stragglers.figures import Thresholds

    out = rejudge(log.records, cfg.monitor.exchange_every, Thresholds.from_monitor(cfg.monitor),
                  QUICK_WINDOWS if args.quick else 0)
    lo, hi = out["first_step"] or 0, out["last_step"] or 0
    logged = [e for e in log.events if e.get("type") == "straggler" and lo <= e["steps"][0] and e["steps"][1] <= hi]
    out["logged_named_windows"] = sum(1 for e in logged if e.get("stragglers"))
    out["logged_job_wide_windows"] = sum(1 for e in logged if e.get("job_wide"))
    out["named_per_10k_windows"] = round(1e4 * out["named_windows"] / out["windows"], 2) if out["windows"] else None
    out["overrides"] = overrides
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
