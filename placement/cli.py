"""`placement topo | plan | doctor | report | selftest`: a thin dispatcher; each subcommand is its own module
(placement.commands.<name>, or the package's own command module, e.g. placement.doctor.command)
exposing `add_arguments(parser)` and `run(args) -> int`."""
from __future__ import annotations

import argparse
import importlib
import sys

from placement.errors import PlacementError

SUBCOMMANDS = {
    "topo": "show the machine's CPU/NUMA/GPU/NIC topology",
    "plan": "show the per-rank, per-role CPU plan placerun would apply",
    "doctor": "check the host for settings that hurt training (NUMA balancing, governor, ...)",
    "report": "summarise monitor JSONL logs: per-rank or per-node figures, who held the job back, plot, heatmap, trace",
    "selftest": "run a short job under placerun on this GPU node and check placement and comm timing",
}

# Subcommands whose module is not placement.commands.<name>.
MODULES = {"doctor": "placement.doctor.command"}


def _module(name: str):
    return importlib.import_module(MODULES.get(name, f"placement.commands.{name}"))


class OneLineParser(argparse.ArgumentParser):
    """Argument errors as every other bad input of placement: one line naming the value, exit 2
    (argparse's own message names the argument, the value and the choices)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="placement", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    sub.required = True
    for name, help_text in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        _module(name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = _module(args.command)
    try:
        return int(module.run(args) or 0)
    except PlacementError as e:
        print(f"placement {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # `placement topo | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
