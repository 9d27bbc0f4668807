"""CPUs: which exist and are online, their groups (package, die, cluster, core, L3) and the
single-thread performance evidence behind `perf_rank`.

Groups come from the kernel's sibling sets (`*_list`, else the hex mask), else from the
ids (old kernels). A CPU already covered by a sibling set read from another CPU is not
read again, so a 224-CPU machine costs about one file per group, not per CPU. A group's
key is the lowest online CPU id in it: unique machine-wide, whatever the kernel's ids are.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from placement.cpuset import MAX_CPUS
from placement.topology._sysfs import SysfsReader
from placement.topology.model import Cpu

CPU_DIR = "sys/devices/system/cpu"
_CPU_NAME = re.compile(r"cpu(\d+)$")
# cluster_id/die_id values that mean "the machine has no such object".
_NO_ID = (-1, 0xFFFF)


def cpu_ids(fs: SysfsReader) -> tuple[list[int], frozenset[int]]:
    """(every CPU the tree knows, the online ones).

    Known: a cpuN directory or an id in cpu/present. Online: cpu/online when present,
    else each CPU's own `online` file (absent on the boot CPU: online).
    """
    names = fs.listdir(CPU_DIR) or ()
    with_dir = {int(m.group(1)) for m in map(_CPU_NAME.match, names) if m}
    beyond = sorted(c for c in with_dir if c >= MAX_CPUS)
    if beyond:  # no kernel has such a CPU: a broken or hand-made tree
        fs.warn(CPU_DIR, f"cpu{beyond[0]}" + (f" and {len(beyond) - 1} more" if len(beyond) > 1 else "")
                + f" beyond the kernel's limit of {MAX_CPUS} cpus: ignored")
        with_dir.difference_update(beyond)
    present = fs.cpus(f"{CPU_DIR}/present") or frozenset()
    known = sorted(with_dir | present)
    online = fs.cpus(f"{CPU_DIR}/online")
    if not online:  # absent (old kernels) or empty, which no running system can be
        online = frozenset(c for c in with_dir if fs.integer(f"{CPU_DIR}/cpu{c}/online") != 0)
    return known, frozenset(online) & frozenset(known)


@dataclass(frozen=True)
class _Level:
    """How one kind of group is read: sibling-set files tried in order, an optional id file whose
    `_NO_ID` values mean the object does not exist, and the ids that identify it on old kernels."""

    sets: tuple[str, ...]
    gate: Optional[str] = None
    ids: tuple[str, ...] = ()


_LEVELS = {
    "core": _Level(("core_cpus_list", "thread_siblings_list", "core_cpus", "thread_siblings"),
                   ids=("physical_package_id", "die_id", "core_id")),
    "package": _Level(("package_cpus_list", "core_siblings_list", "package_cpus", "core_siblings"),
                      ids=("physical_package_id",)),
    "die": _Level(("die_cpus_list", "die_cpus"), gate="die_id"),
    "cluster": _Level(("cluster_cpus_list", "cluster_cpus"), gate="cluster_id"),
}


def _read_set(fs: SysfsReader, rel_dir: str, names: tuple[str, ...]) -> Optional[frozenset[int]]:
    """The first non-empty CPU set among the files `names` that `rel_dir` holds."""
    for name in names:
        if not fs.has(rel_dir, name):
            continue
        rel = f"{rel_dir}/{name}"
        s = fs.cpus(rel) if name.endswith("_list") else fs.cpus(None, rel)
        if s:
            return s
    return None


def _group_keys(online: frozenset[int], read_set: Callable[[int], Optional[frozenset[int]]],
                read_ids: Optional[Callable[[int], Optional[tuple]]] = None) -> dict[int, int]:
    """cpu -> key (lowest online CPU of its group). CPUs whose group cannot be read get no key."""
    key_of: dict[int, int] = {}
    by_ids: dict[tuple, set[int]] = {}
    for cpu in sorted(online):
        if cpu in key_of:
            continue
        siblings = read_set(cpu)
        if siblings is None:
            ids = read_ids(cpu) if read_ids else None
            if ids is not None:
                by_ids.setdefault(ids, set()).add(cpu)
            continue
        group = (siblings & online) | {cpu}
        key = min(group)
        for c in group:
            key_of.setdefault(c, key)
    for group in by_ids.values():
        key = min(group)
        for c in group:
            key_of.setdefault(c, key)
    return key_of


def _level_keys(fs: SysfsReader, online: frozenset[int], level: _Level) -> dict[int, int]:
    def read_set(cpu: int) -> Optional[frozenset[int]]:
        topo = f"{CPU_DIR}/cpu{cpu}/topology"
        if level.gate is not None:
            gate = fs.integer(f"{topo}/{level.gate}") if fs.has(topo, level.gate) else None
            if gate is None or gate in _NO_ID:
                return None
        return _read_set(fs, topo, level.sets)

    def read_ids(cpu: int) -> Optional[tuple]:
        topo = f"{CPU_DIR}/cpu{cpu}/topology"
        values = tuple(fs.integer(f"{topo}/{name}") if fs.has(topo, name) else None for name in level.ids)
        # die_id is optional in the core tuple (old kernels have none); the others are required.
        if values[0] is None or values[-1] is None:
            return None
        return values

    return _group_keys(online, read_set, read_ids if level.ids else None)


def _l3_keys(fs: SysfsReader, online: frozenset[int]) -> dict[int, int]:
    def read_set(cpu: int) -> Optional[frozenset[int]]:
        cache = f"{CPU_DIR}/cpu{cpu}/cache"
        # index3 is the L3 on nearly every machine: try it before the other indexes.
        names = sorted((n for n in fs.listdir(cache) or () if n.startswith("index")),
                       key=lambda n: (n != "index3", n))
        for name in names:
            if fs.integer(f"{cache}/{name}/level") == 3:
                return _read_set(fs, f"{cache}/{name}", ("shared_cpu_list", "shared_cpu_map"))
        return None

    return _group_keys(online, read_set)


def group_keys(fs: SysfsReader, online: frozenset[int]) -> dict[str, dict[int, int]]:
    """For "package", "die", "cluster", "core", "l3": cpu -> group key."""
    keys = {name: _level_keys(fs, online, level) for name, level in _LEVELS.items()}
    keys["l3"] = _l3_keys(fs, online)
    return keys


@dataclass(frozen=True)
class PerfEvidence:
    """Single-thread peak evidence of one CPU, strongest first (see perf_ranks)."""

    highest_perf: Optional[int]  # ACPI CPPC
    prefcore_ranking: Optional[int]  # amd-pstate preferred-core ranking
    max_khz: Optional[int]  # cpufreq cpuinfo_max_freq
    base_khz: Optional[int]  # cpufreq base_frequency (SST-BF high-priority cores have a higher one)


def perf_evidence(fs: SysfsReader, online: frozenset[int]) -> dict[int, PerfEvidence]:
    out = {}
    for cpu in sorted(online):
        d = f"{CPU_DIR}/cpu{cpu}"
        cppc, cpufreq = fs.has(d, "acpi_cppc"), fs.has(d, "cpufreq")
        out[cpu] = PerfEvidence(fs.integer(f"{d}/acpi_cppc/highest_perf") if cppc else None,
                                fs.integer(f"{d}/cpufreq/amd_pstate_prefcore_ranking") if cpufreq else None,
                                fs.integer(f"{d}/cpufreq/cpuinfo_max_freq") if cpufreq else None,
                                fs.integer(f"{d}/cpufreq/base_frequency") if cpufreq else None)
    return out


def perf_ranks(evidence: dict[int, PerfEvidence]) -> dict[int, int]:
    """Dense rank by expected single-thread peak, 0 = fastest; equal evidence, equal rank.

    Evidence is compared in order (CPPC highest_perf, then prefcore ranking, then max, then
    base frequency); a kind no CPU reports is left out, a CPU missing a kind others report
    ranks below them on it.
    """
    fields = [f for f in PerfEvidence.__dataclass_fields__
              if any(getattr(e, f) is not None for e in evidence.values())]

    def score(e: PerfEvidence) -> tuple[int, ...]:
        return tuple(-1 if getattr(e, f) is None else getattr(e, f) for f in fields)

    distinct = sorted({score(e) for e in evidence.values()}, reverse=True)
    rank = {s: i for i, s in enumerate(distinct)}
    return {cpu: rank[score(e)] for cpu, e in evidence.items()}


def discover_cpus(fs: SysfsReader, known: list[int], online: frozenset[int], node_of: dict[int, int],
                  allowed: frozenset[int]) -> list[Cpu]:
    keys = group_keys(fs, online)
    evidence = perf_evidence(fs, online)
    ranks = perf_ranks(evidence)
    cpus = []
    for cpu in known:
        if cpu not in online:
            cpus.append(Cpu(id=cpu, online=False, allowed=cpu in allowed))
            continue
        e = evidence[cpu]
        cpus.append(Cpu(id=cpu, online=True, allowed=cpu in allowed,
                        package=keys["package"].get(cpu), die=keys["die"].get(cpu),
                        cluster=keys["cluster"].get(cpu), core=keys["core"].get(cpu),
                        l3=keys["l3"].get(cpu), numa=node_of.get(cpu),
                        max_khz=e.max_khz, base_khz=e.base_khz, highest_perf=e.highest_perf,
                        prefcore_ranking=e.prefcore_ranking, perf_rank=ranks[cpu]))
    return cpus
