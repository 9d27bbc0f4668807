"""Where each thread of a rank runs: its role, the planned CPU set, and what /proc reports
(Cpus_allowed_list and the CPU it last ran on). The example job prints this at its end."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from placement import _procfs
from placement.bind.affinity import read_allowed, read_last_cpu
from placement.cpuset import format_cpulist
from placement.roles import ThreadRole


@dataclass(frozen=True)
class ThreadPlacement:
    pid: int
    tid: int
    name: str
    role: ThreadRole
    planned: frozenset[int]  # empty: the role has no set of its own (keeps the stage-1 mask)
    allowed: frozenset[int]  # Cpus_allowed_list read back now
    last_cpu: Optional[int]

    @property
    def on_plan(self) -> bool:
        return not self.planned or self.allowed == self.planned


def where_threads_run(binder) -> list[ThreadPlacement]:
    """Rescan, then read every thread of the rank and of its DataLoader workers back from /proc."""
    binder.rescan()
    rows = []
    for t in binder.threads():
        try:
            allowed = read_allowed(t.pid, t.tid)
            last_cpu = read_last_cpu(t.pid, t.tid)
        except (_procfs.ThreadGone, OSError, ValueError):  # ended meanwhile (or unreadable)
            continue
        rows.append(ThreadPlacement(t.pid, t.tid, t.name, t.role, binder.role_cpus(t.role), allowed, last_cpu))
    return rows


def format_thread_placements(rows: list[ThreadPlacement], prefix: str = "") -> str:
    header = ("pid", "tid", "name", "role", "planned", "allowed", "last cpu", "on plan")
    table = [header] + [(str(r.pid), str(r.tid), r.name, r.role.value, format_cpulist(r.planned) or "-",
                         format_cpulist(r.allowed), "?" if r.last_cpu is None else str(r.last_cpu),
                         "yes" if r.on_plan else "NO") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join(prefix + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)
