"""`placement report LOGS... [--plot OUT.png] [--heatmap OUT.png] [--trace OUT.json [--steps A:B]
[--ranks LIST]]`: per-rank
table and events for a few ranks; for a cluster (many ranks, several nodes) who held the job
back, stalled ranks first, and per-node figures; a stacked plot, a ranks x time heatmap and
a Chrome trace-event file."""
from __future__ import annotations

import argparse

from placement.report.cluster import cluster_text, event_counts, summarize_cluster
from placement.report.heatmap import write_heatmap
from placement.report.logs import RANK_TABLE_MAX, LogReadError, read_logs
from placement.report.plot import write_plot
from placement.report.text import report_text, run_lines
from placement.report.trace import TraceFilter, parse_ranks, parse_steps, select, write_trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="+", metavar="LOG",
                   help="monitor logs (<log_dir>/rank<R>.jsonl), directories holding them (searched "
                        "recursively: one per node) or quoted globs ('logs/*/rank*.jsonl')")
    p.add_argument("--plot", metavar="OUT.png", help="also write a PNG stacking each step's time per rank")
    p.add_argument("--heatmap", metavar="OUT.png",
                   help="also write a PNG of ranks x time windows: step time vs the job's median, and CPU stall")
    p.add_argument("--trace", metavar="OUT.json",
                   help="also write the steps and events as Chrome trace-event JSON (Perfetto, chrome://tracing)")
    p.add_argument("--steps", metavar="A:B", type=_steps_arg,
                   help="with --trace: only steps A..B (A: or :B leave one end open)")
    p.add_argument("--ranks", metavar="LIST", type=_ranks_arg,
                   help="with --trace: only these ranks (e.g. 0-7,64,100-103)")
    p.add_argument("--run", metavar="N|ID",
                   help="which run of those the logs hold (its number in order of start, or its id); default: the last")


def _steps_arg(text: str):
    try:
        return parse_steps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ranks_arg(text: str):
    try:
        return parse_ranks(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    if (args.steps is not None or args.ranks is not None) and not args.trace:
        raise LogReadError("--steps and --ranks select what --trace writes: give --trace OUT.json too")
    log = read_logs(args.logs, run=args.run)  # every line parsed once; StepRecords as well for a few ranks
    if args.trace:
        first, last = args.steps or (None, None)
        keep = TraceFilter(first_step=first, last_step=last, ranks=args.ranks)
        selected = select(log, keep)
    ranks = log.ranks()
    nodes = log.nodes()
    if args.plot and len(ranks) > RANK_TABLE_MAX:
        raise LogReadError(f"--plot draws one panel per rank and {len(ranks)} ranks are too many "
                           f"(at most {RANK_TABLE_MAX}); use --heatmap")
    summary = summarize_cluster(log)
    if summary.stalled:  # what a hung job's user looks for first
        print(f"STALLED: {len(summary.stalled)} rank(s) stopped stepping and did not resume: "
              + ", ".join(f"rank {s.rank} after step {'?' if s.last_step is None else s.last_step}"
                          + (" outside any collective" if s.in_collective is False else "")
                          for s in summary.stalled[:10]) + (", ..." if len(summary.stalled) > 10 else ""))
        print("")
    if len(ranks) <= RANK_TABLE_MAX:
        print(report_text(log))
        if summary.holders or summary.stalled or summary.comm_slow_windows or len(nodes) > 1:
            print("")
            print(cluster_text(summary, log, with_nodes=len(nodes) > 1))
    else:
        print(f"placement report: {len(log.files)} file(s), {len(nodes)} node(s), {len(ranks)} ranks, "
              f"{len(log)} step records, {len(log.events)} events")
        if log.skipped:
            print(f"skipped {log.skipped} truncated or corrupt line(s)")
        for line in run_lines(log):
            print(line)
        print("")
        print(cluster_text(summary, log))
        print("")
        print(event_counts(log))
    if args.plot:
        write_plot(log, args.plot)
        print(f"\nplot: {args.plot}")
    if args.heatmap:
        write_heatmap(log, args.heatmap)
        print(f"heatmap: {args.heatmap}")
    if args.trace:
        steps, events = write_trace(log, args.trace, keep, selected)
        print(f"trace: {args.trace} ({steps} steps, {events} events; open in https://ui.perfetto.dev or chrome://tracing)")
    return 0
