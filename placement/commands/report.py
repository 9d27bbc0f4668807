"""`placement report RUN.jsonl... [--plot OUT.png]`: per-rank table, events in order, and a plot."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="+", metavar="RUN.jsonl",
                   help="monitor logs (one per rank: <log_dir>/rank<R>.jsonl), or their directory")
    p.add_argument("--plot", metavar="OUT.png", help="also write a PNG stacking each step's time per rank")


def run(args: argparse.Namespace) -> int:
    from placement.monitor.logread import read_logs
    from placement.monitor.report_text import report_text

    log = read_logs(args.logs)
    print(report_text(log))
    if args.plot:
        from placement.monitor.report_plot import write_plot

        write_plot(log, args.plot)
        print(f"\nplot: {args.plot}")
    return 0
