"""Errors that reach the user as one line (CLI exit code 2), never as a traceback."""
import sys


class PlacementError(Exception):
    """Base class: the message is one line naming the value and the valid choices."""

    exit_code = 2


class ConfigError(PlacementError):
    """A configuration key or value is unknown or out of range."""


class TopologyError(PlacementError):
    """The topology root or an NCCL topology file cannot be read as a whole."""


class PlanError(PlacementError):
    """The plan cannot be met (shortfall named) and `strict` is on."""


def say(line: str) -> None:
    """One line on stderr, in one write: a job's ranks share that pipe, and print() writes a
    line's text and its newline apart, so two ranks' lines could run together. (Inside a signal
    handler, events._say writes to fd 2 itself.)"""
    stream = sys.stderr
    stream.write(line + "\n")
    stream.flush()
