"""The package's import graph keeps its shape (docs/design.md, layout): no import circle, nothing
imports upward (bind/ and records/ import nothing of the live monitor, report/ reads the log's
schema in records/ and nothing else of the monitor, the monitor imports neither attach_api nor
placement.auto), no room of the monitor grows back into the flat 29 files it was, no module
grows past MAX_LINES, and the step monitor stays a coordinator of at most COORDINATOR_FIELDS
attributes over objects that own their state (it held 46 before the second pass).

Every `import placement...` / `from placement... import` in placement/ (any nesting, imports
inside functions too) resolved to the module it names, read as text with ast.

    python tests/test_layers.py      # the graph's figures as one JSON line
"""
from __future__ import annotations

import ast
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "placement"
# The longest module a reader takes in at once (report/logs.py, the one reader, is 685 lines).
MAX_LINES = 700
# StepMonitor's attributes: the objects it coordinates, its lifecycle, its thread. The next
# per-step feature goes into an object of its room (hook.py, build.py, probes/, sinks/,
# crossrank/, health/), not here.
COORDINATOR_FIELDS = 15


def modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports() -> dict[str, set[str]]:
    """module -> the placement modules it imports."""
    mods = modules()

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name

    deps: dict[str, set[str]] = collections.defaultdict(set)
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names]
            for n in names:
                if n.startswith("placement"):
                    target = resolve(n)
                    if target and target != mod:
                        deps[mod].add(target)
    return {m: deps.get(m, set()) for m in mods}


def circles(deps: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in deps.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in deps:
        if v not in index:
            visit(v)
    return out


# (importer prefix, imported prefix): arrows that would run back up
UPWARD = [("placement.bind", "placement.monitor"), ("placement.records", "placement.monitor"),
          ("placement.report", "placement.monitor"), ("placement.monitor", "placement.attach_api"),
          ("placement.monitor", "placement.auto"), ("placement.monitor", "placement.report"),
          ("placement.records", "placement.report"),
          # the live metrics read records and events; the monitor hands them data, never the reverse
          ("placement.metrics", "placement.monitor"), ("placement.metrics", "placement.attach_api"),
          ("placement.monitor", "placement.metrics"), ("placement.records", "placement.metrics")]


def upward(deps: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, d) for m, ds in deps.items() for d in ds
                  for lo, hi in UPWARD if m.startswith(lo) and (d == hi or d.startswith(hi + ".")))


def rooms() -> dict[str, tuple[int, int]]:
    """The monitor's rooms (placement/records too): folder -> (files, lines)."""
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for path in modules().values():
        folder = str(path.parent.relative_to(ROOT))
        if folder.startswith("placement/monitor") or folder == "placement/records":
            out[folder][0] += 1
            out[folder][1] += len(path.read_text().splitlines())
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}


def instance_fields(path: Path, cls: str) -> set[str]:
    """The `self.x` a class assigns anywhere in its body."""
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    names = set()
    for n in ast.walk(node):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    names.add(e.attr)
    return names


def long_modules() -> dict[str, int]:
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in modules().values()}
    return {k: n for k, n in sorted(lines.items()) if n > MAX_LINES}


def test_no_import_circle():
    assert circles(imports()) == []


def test_nothing_imports_upward():
    assert upward(imports()) == []


def test_no_room_of_the_monitor_grows_into_a_flat_package_again():
    r = rooms()
    assert len(r) >= 6, r
    assert max(files for files, _ in r.values()) <= 10, r


def test_no_module_grows_past_the_line_cap():
    assert long_modules() == {}


def test_the_step_monitor_stays_a_coordinator():
    fields = instance_fields(PKG / "monitor" / "step_monitor.py", "StepMonitor")
    assert 5 <= len(fields) <= COORDINATOR_FIELDS, sorted(fields)


if __name__ == "__main__":
    deps = imports()
    r = rooms()
    total = sum(lines for _, lines in r.values())
    big = max(r, key=lambda k: r[k][1])
    print(json.dumps({"modules": len(deps), "circles": circles(deps), "upward": upward(deps),
                      "monitor_rooms": {k: v[0] for k, v in r.items()}, "biggest_room": big,
                      "biggest_room_lines_pct": round(100.0 * r[big][1] / total, 1),
                      "longest_module_lines": max(len(p.read_text().splitlines()) for p in modules().values()),
                      "step_monitor_fields": len(instance_fields(PKG / "monitor" / "step_monitor.py", "StepMonitor"))}))
