"""`placement report LOGS... [--run N|ID] [--read auto|steps|digests] [--json] [--plot OUT.png] [--heatmap OUT.png] [--trace
OUT.json [--steps A:B] [--ranks LIST]]` and `placement report --compare BASE NEW`: per-rank table
and events for a few ranks; for a cluster (many ranks, several nodes) who held the job back,
hung ranks first, and per-node figures; a stacked plot, a ranks x time heatmap and a Chrome
trace-event file; two runs side by side."""
from __future__ import annotations

import argparse
import json
import sys

from placement.report.cluster import cluster_text, event_counts, summarize_cluster
from placement.report.compare import compare, compare_text
from placement.report.document import report_document
from placement.report.heatmap import write_heatmap
from placement.report.logs import DIGESTS_FROM, RANK_TABLE_MAX, LogReadError, ReadMode, estimated_step_lines, read_logs
from placement.report.plot import write_plot
from placement.report.text import printable, read_line, report_text, run_lines
from placement.report.trace import TraceFilter, parse_ranks, parse_steps, select, write_trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="*", metavar="LOG",
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
    p.add_argument("--read", choices=[str(m) for m in ReadMode], default=str(ReadMode.AUTO),
                   help="what of the step records is read: `steps` parses every line (every view), `digests` only "
                        "the digests monitor.digest_every writes (the tables and events of a long job in a fraction "
                        f"of the time), `auto` (default) digests past ~{DIGESTS_FROM // 1_000_000}M step lines")
    p.add_argument("--json", action="store_true", help="print the report as one JSON document (placement.report/1)")
    p.add_argument("--compare", nargs=2, metavar=("BASE", "NEW"),
                   help="two runs side by side, each LOG[@RUN] (a file, directory or glob, and which of its runs): "
                        "step time, throughput, the parts of a step, and whether the difference is beyond the noise")


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


def _print(*parts, **kw) -> None:
    """print(), a log's strings escaped (text.printable): what the report prints came from files."""
    print(*(printable(str(p)) for p in parts), **kw)


def run(args: argparse.Namespace) -> int:
    if args.compare:
        if args.logs or args.plot or args.heatmap or args.trace or args.run:
            raise LogReadError("--compare BASE NEW takes its two runs alone (LOG[@RUN] each); "
                               "give the other options without it")
        comparison = compare(*args.compare)
        _print(json.dumps(comparison.to_dict()) if args.json else compare_text(comparison))
        return 0
    if not args.logs:
        raise LogReadError("give the monitor logs to report (LOG..., e.g. placement_logs/), or --compare BASE NEW")
    if (args.steps is not None or args.ranks is not None) and not args.trace:
        raise LogReadError("--steps and --ranks select what --trace writes: give --trace OUT.json too")
    mode = ReadMode(args.read)
    wants_steps = [flag for flag, v in (("--plot", args.plot), ("--heatmap", args.heatmap), ("--trace", args.trace)) if v]
    if wants_steps and mode == ReadMode.DIGESTS:
        raise LogReadError(f"{wants_steps[0]} draws every step and --read digests reads none; give --read steps "
                           "(or auto) with it")
    if wants_steps and mode == ReadMode.AUTO:
        mode = ReadMode.STEPS  # the pictures need every step: asked for, they are read whatever the size
    log = read_logs(args.logs, run=args.run, read=mode)  # each line parsed once; StepRecords too for a few ranks
    if log.long_without_digests:
        _print(f"these logs hold ~{estimated_step_lines(log.files)} step lines and no digests (monitor.digest_every=0, "
              "or written before digests): every line was parsed", file=sys.stderr)
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
    if args.json:
        _side_outputs(args, log, keep if args.trace else None, selected if args.trace else None, sys.stderr)
        _print(json.dumps(report_document(log, summary), default=str))
        return 0
    if summary.stalled:  # what a hung job's user looks for first
        _print(f"HUNG: {len(summary.stalled)} rank(s) stopped stepping and did not resume: "
              + ", ".join(f"rank {s.rank} after step {'?' if s.last_step is None else s.last_step}"
                          + (" outside any collective" if s.in_collective is False else "")
                          for s in summary.stalled[:10]) + (", ..." if len(summary.stalled) > 10 else ""))
        _print("")
    if len(ranks) <= RANK_TABLE_MAX:
        _print(report_text(log))
        if summary.holders or summary.stalled or summary.comm_slow_windows or len(nodes) > 1:
            _print("")
            _print(cluster_text(summary, log, with_nodes=len(nodes) > 1))
    else:
        _print(f"placement report: {len(log.files)} file(s), {len(nodes)} node(s), {len(ranks)} ranks, "
              f"{log.step_count()} step records, {len(log.events)} events")
        if log.from_digests:
            _print(read_line(log))
        if log.skipped:
            _print(f"skipped {log.skipped} truncated or corrupt line(s)")
        for path, why in log.unreadable:
            _print(f"skipped file {path}: {why}")
        if log.links_skipped:
            _print(f"skipped {log.links_skipped} link(s) in the directories read (not followed)")
        for line in run_lines(log):
            _print(line)
        _print("")
        _print(cluster_text(summary, log))
        _print("")
        _print(event_counts(log))
    _side_outputs(args, log, keep if args.trace else None, selected if args.trace else None, sys.stdout)
    return 0


def _side_outputs(args: argparse.Namespace, log, keep, selected, out) -> None:
    """The files asked for beside the report (--plot, --heatmap, --trace), each said on `out`."""
    if args.plot:
        write_plot(log, args.plot)
        print(f"\nplot: {args.plot}", file=out)
    if args.heatmap:
        write_heatmap(log, args.heatmap)
        print(f"heatmap: {args.heatmap}", file=out)
    if args.trace:
        steps, events = write_trace(log, args.trace, keep, selected)
        print(f"trace: {args.trace} ({steps} steps, {events} events; open in https://ui.perfetto.dev or chrome://tracing)",
              file=out)
