"""CPUs: which exist and are online, and their groups (package, die, cluster, core, AMD compute
unit, L3), with the performance evidence of placement/topology/perf.py.

Groups come from the kernel's sibling sets, else from the ids (old kernels). As hwloc does
(hwloc/topology-linux.c, `look_sysfscpu`), the hex masks are read (`core_cpus`/`thread_siblings`,
`package_cpus`/`core_siblings`, ...) and the `_list` files only where a mask is missing: where a
tree's two disagree, the mask is what hwloc reads. A CPU already covered by a sibling set read from
another CPU is not read again, so a 224-CPU machine costs about one file per group, not per CPU.
A group's key is the lowest online CPU id in it: unique machine-wide, whatever the kernel's ids are.

AMD compute units (family 15h Bulldozer..Excavator, and 16h as hwloc tests it): the kernel lists
the two cores of a compute unit, which share a front end, L1i and L2, as thread siblings, each
with its own core_id. hwloc (`hwloc_linuxfs_look_cpu`: is_amd_with_CU from proc/cpuinfo's vendor
and family; `look_sysfscpu`: threadwithcoreid when siblings' core_ids differ) makes each of them
a core; so do we, and keep the pair as `compute_unit` (None on every other machine).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from placement.topology._sysfs import CPU_DIR, SysfsReader
from placement.topology.caches import l3_keys, read_set as read_first_set
from placement.topology.model import Cpu
from placement.topology.perf import perf_evidence, perf_ranks

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
    "core": _Level(("core_cpus", "thread_siblings", "core_cpus_list", "thread_siblings_list"),
                   ids=("physical_package_id", "die_id", "core_id")),
    "package": _Level(("package_cpus", "core_siblings", "package_cpus_list", "core_siblings_list"),
                      ids=("physical_package_id",)),
    "die": _Level(("die_cpus", "die_cpus_list"), gate="die_id"),
    "cluster": _Level(("cluster_cpus", "cluster_cpus_list"), gate="cluster_id"),
}


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
        return read_first_set(fs, topo, level.sets)

    def read_ids(cpu: int) -> Optional[tuple]:
        topo = f"{CPU_DIR}/cpu{cpu}/topology"
        values = tuple(fs.integer(f"{topo}/{name}") if fs.has(topo, name) else None for name in level.ids)
        # die_id is optional in the core tuple (old kernels have none); the others are required.
        if values[0] is None or values[-1] is None:
            return None
        return values

    return _group_keys(online, read_set, read_ids if level.ids else None)


def _members(keys: dict[int, int]) -> dict[int, frozenset[int]]:
    """cpu -> every CPU with its key."""
    groups: dict[int, set[int]] = {}
    for cpu, key in keys.items():
        groups.setdefault(key, set()).add(cpu)
    return {cpu: frozenset(groups[key]) for cpu, key in keys.items()}


_CPUINFO_FIELD = re.compile(r"^(vendor_id|cpu family)\s*:\s*(\S+)", re.MULTILINE)


def _amd_with_compute_units(fs: SysfsReader) -> bool:
    """proc/cpuinfo's first processor is an AMD of family 21 (15h) or 22 (16h), as hwloc tests."""
    text = fs.head("proc/cpuinfo")
    first = dict(_CPUINFO_FIELD.findall((text or "").split("\n\n", 1)[0]))
    return first.get("vendor_id") == "AuthenticAMD" and first.get("cpu family") in ("21", "22")


def _siblings_are_cores(fs: SysfsReader, siblings: dict[int, frozenset[int]]) -> bool:
    """Whether thread siblings have core_ids of their own, judged on the first CPU with a sibling
    (hwloc's threadwithcoreid)."""
    for cpu in sorted(siblings):
        others = sorted(siblings[cpu] - {cpu})
        if others:
            ids = [fs.integer(f"{CPU_DIR}/cpu{c}/topology/core_id") for c in (cpu, others[0])]
            return ids[0] != ids[1]
    return False


def group_keys(fs: SysfsReader, online: frozenset[int]) -> dict[str, dict[int, int]]:
    """For "package", "die", "cluster", "core", "compute_unit", "l3": cpu -> group key."""
    keys = {name: _level_keys(fs, online, level) for name, level in _LEVELS.items()}
    siblings = _members(keys["core"])
    keys["compute_unit"] = {}
    if any(len(s) > 1 for s in siblings.values()) and _amd_with_compute_units(fs) \
            and _siblings_are_cores(fs, siblings):
        keys["compute_unit"] = keys["core"]
        keys["core"] = {cpu: cpu for cpu in keys["core"]}
    keys["l3"] = l3_keys(fs, online, siblings)
    return keys


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
                        compute_unit=keys["compute_unit"].get(cpu),
                        l3=keys["l3"].get(cpu), numa=node_of.get(cpu),
                        max_khz=e.max_khz, base_khz=e.base_khz, highest_perf=e.highest_perf,
                        prefcore_ranking=e.prefcore_ranking, perf_rank=ranks[cpu]))
    return cpus
