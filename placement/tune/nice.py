"""Give background threads a higher nice value so a hot thread on the same core preempts them.

Raising a nice value needs no privilege (lowering it again would), so this only ever raises.
"""
from __future__ import annotations

import os
from typing import Iterable

from placement.roles import ThreadInfo, ThreadRole

# DataLoader workers only: `other` holds autograd device threads and the OpenMP pool, which
# do the step's own work when the model computes on the CPU.
BACKGROUND_ROLES = (ThreadRole.DATALOADER,)


def renice_background(threads: Iterable[ThreadInfo], nice: int) -> list[int]:
    """Raise every background thread whose nice value is below `nice` to it; return their tids.
    Threads that exited or refuse are skipped."""
    changed = []
    for t in threads:
        if t.role not in BACKGROUND_ROLES:
            continue
        try:
            if os.getpriority(os.PRIO_PROCESS, t.tid) < nice:
                os.setpriority(os.PRIO_PROCESS, t.tid, nice)
                changed.append(t.tid)
        except OSError:
            continue
    return changed
