"""The plan as a text table: one line per rank x role, CPUs in kernel list form, with reasons."""
from __future__ import annotations

from typing import Optional

from placement.cpuset import format_cpulist
from placement.plan.model import Plan
from placement.roles import ThreadRole

_HEADER = ("rank", "gpu", "numa", "memory", "role", "cpus", "reason")


def format_plan_table(plan: Plan) -> str:
    rows: list[tuple[str, ...]] = []
    for r in plan.ranks:
        gpu = "-" if r.gpu is None else f"{r.gpu.index} ({r.gpu.pci})"
        numa = ",".join(map(str, r.numa)) or "-"
        memory = r.memory.mode + (" " + ",".join(map(str, r.memory.nodes)) if r.memory.nodes else "")
        first = (str(r.local_rank), gpu, numa, memory)
        if not r.roles:
            rows.append(first + ("-", "-", "not bound (monitor only)"))
            continue
        for i, role in enumerate(ThreadRole):
            a = r.roles.get(role)
            if a is None:
                continue
            lead = first if i == 0 else ("",) * 4
            rows.append(lead + (role.value, format_cpulist(a.cpus), a.reason))
    widths = [max(len(row[c]) for row in rows + [_HEADER]) for c in range(len(_HEADER) - 1)]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1]

    out = [f"plan: policy {plan.policy}, {len(plan.ranks)} local rank(s)", line(_HEADER)]
    out.extend(line(row) for row in rows)
    for r in plan.ranks:
        if r.env:
            out.append(f"env rank {r.local_rank}: " + " ".join(f"{k}={v}" for k, v in sorted(r.env.items())))
    out.extend(f"warning: {w}" for w in plan.warnings)
    return "\n".join(out)


def warnings_summary(plan: Plan, listed_in: str) -> Optional[str]:
    """The plan's warnings in one line: the shortfall the plan ran through first, else the first
    warning, and how many more `listed_in` lists."""
    if not plan.warnings:
        return None
    first = plan.shortfall.warning() if plan.shortfall is not None else plan.warnings[0]
    more = len(plan.warnings) - 1
    return first + (f" (+{more} more: {listed_in} lists them)" if more else "")
