"""One rule for what placement paces in time at short steps: the monitor's hand-overs
(monitor/hook.py StepHook.pace), the exchange grid (monitor/crossrank/schedule.py) and the
tuner's windows (tune/tuner.py paced_window). Each is a unit of steps times the fewest power of
two that lasts a floor in time. One function, so that a tuner window paced to the hand-overs'
floor ends at a hand-over, and ranks whose step times differ a little still meet at the larger
one's steps.
"""
from __future__ import annotations


def doubling(steps: int, step_ms: float, min_s: float, cap: int) -> int:
    """The fewest power of two k for which k x `steps` steps of `step_ms` last `min_s`, at most
    the largest power of two not above `cap`; 1 when the step time is not known (<= 0) or
    min_s is 0."""
    k = 1
    if step_ms > 0:
        while k * 2 <= cap and k * steps * step_ms < min_s * 1e3:
            k *= 2
    return k
