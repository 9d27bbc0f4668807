"""The wall clock the monitor stamps step ends and collective entries with (time.time()).

PLACEMENT_TEST_CLOCK_OFFSET_S (tests only) shifts it by that many seconds, standing in for
a host whose clock is off (NTP skew between nodes): no cross-rank figure may change with it
(stragglers/figures.py measures lateness from durations). Read once, at import.
"""
from __future__ import annotations

import logging
import os
import time

ENV = "PLACEMENT_TEST_CLOCK_OFFSET_S"


def _offset() -> float:
    raw = os.environ.get(ENV, "")
    if not raw:
        return 0.0
    try:
        return float(raw)
    except ValueError:
        logging.getLogger("placement").warning("placement: %s=%r is not a number of seconds; ignored", ENV, raw)
        return 0.0


OFFSET_S = _offset()


def wall() -> float:
    return time.time() + OFFSET_S
