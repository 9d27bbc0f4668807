"""`placement report LOGS... [--plot OUT.png] [--heatmap OUT.png] [--trace OUT.json [--steps A:B]
[--ranks LIST]]`: per-rank
table and events for a few ranks; for a cluster (many ranks, several nodes) who held the job
back, stalled ranks first, and per-node figures; a stacked plot, a ranks x time heatmap and
a Chrome trace-event file."""
from __future__ import annotations

import argparse


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


def _steps_arg(text: str):
    from placement.monitor.report_trace import parse_steps

    try:
        return parse_steps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ranks_arg(text: str):
    from placement.monitor.report_trace import parse_ranks

    try:
        return parse_ranks(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    from placement.monitor.logread import LogReadError, read_logs
    from placement.monitor.report_cluster import RANK_TABLE_MAX, cluster_text, event_counts, summarize_cluster
    from placement.monitor.steptable import read_table

    if (args.steps is not None or args.ranks is not None) and not args.trace:
        raise LogReadError("--steps and --ranks select what --trace writes: give --trace OUT.json too")
    table = read_table(args.logs)
    if args.trace:
        from placement.monitor.report_trace import TraceFilter, select

        first, last = args.steps or (None, None)
        keep = TraceFilter(first_step=first, last_step=last, ranks=args.ranks)
        selected = select(table, keep)
    ranks = table.ranks()
    nodes = table.nodes()
    if args.plot and len(ranks) > RANK_TABLE_MAX:
        raise LogReadError(f"--plot draws one panel per rank and {len(ranks)} ranks are too many "
                           f"(at most {RANK_TABLE_MAX}); use --heatmap")
    summary = summarize_cluster(table)
    if summary.stalled:  # what a hung job's user looks for first
        print(f"STALLED: {len(summary.stalled)} rank(s) stopped stepping and did not resume: "
              + ", ".join(f"rank {s.rank} after step {'?' if s.last_step is None else s.last_step}"
                          + (" outside any collective" if s.in_collective is False else "")
                          for s in summary.stalled[:10]) + (", ..." if len(summary.stalled) > 10 else ""))
        print("")
    log = None
    if len(ranks) <= RANK_TABLE_MAX:
        from placement.monitor.report_text import report_text

        log = read_logs(args.logs)
        print(report_text(log))
        if summary.holders or summary.stalled or summary.comm_slow_windows or len(nodes) > 1:
            print("")
            print(cluster_text(summary, table, with_nodes=len(nodes) > 1))
    else:
        print(f"placement report: {len(table.files)} file(s), {len(nodes)} node(s), {len(ranks)} ranks, "
              f"{len(table)} step records, {len(table.events)} events")
        if table.skipped:
            print(f"skipped {table.skipped} truncated or corrupt line(s)")
        if table.earlier_runs:
            print(f"{len(table.earlier_runs)} rank(s) whose log holds several runs: the last one is reported")
        print("")
        print(cluster_text(summary, table))
        print("")
        print(event_counts(table))
    if args.plot:
        from placement.monitor.report_plot import write_plot

        write_plot(log, args.plot)
        print(f"\nplot: {args.plot}")
    if args.heatmap:
        from placement.monitor.report_heatmap import write_heatmap

        write_heatmap(table, args.heatmap)
        print(f"heatmap: {args.heatmap}")
    if args.trace:
        from placement.monitor.report_trace import write_trace

        steps, events = write_trace(table, args.trace, keep, selected)
        print(f"trace: {args.trace} ({steps} steps, {events} events; open in https://ui.perfetto.dev or chrome://tracing)")
    return 0
