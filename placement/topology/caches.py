"""L3 groups: which online CPUs share a level-3 cache.

Follows hwloc (hwloc/topology-linux.c, `look_sysfscpu`, the cache loop): a cache is the set of
CPUs in its `shared_cpu_map` (the `_list` file only where the map is missing), never its `id`
(ids repeat across packages on some machines); an empty map (ia64) means the CPU's own core; the
set is cut to the online CPUs.

Where we differ on purpose: hwloc creates a cache only from the first CPU of its set; we take the
set from the first CPU that describes it, so a cache whose first CPU lacks a cache/ directory
(described for some CPUs only) is still the set the others name. A CPU already inside an L3 read
from an earlier CPU is not read again, so a 224-CPU machine costs one cache directory per L3.
"""
from __future__ import annotations

from typing import Optional

from placement.topology._sysfs import CPU_DIR, SysfsReader


def read_set(fs: SysfsReader, rel_dir: str, names: tuple[str, ...], *, empty_ok: bool = False
             ) -> Optional[frozenset[int]]:
    """The CPU set of the first of the files `names` that `rel_dir` holds and that parses (a file
    ending in `_list` is a cpu list, any other a hex mask); empty sets are skipped unless empty_ok."""
    for name in names:
        if not fs.has(rel_dir, name):
            continue
        rel = f"{rel_dir}/{name}"
        s = fs.cpus(rel) if name.endswith("_list") else fs.cpus(None, rel)
        if s is not None and (s or empty_ok):
            return s
    return None


def _l3_index(fs: SysfsReader, cache: str) -> Optional[str]:
    """The cache/indexN directory of the CPU's L3 (a unified or data cache of level 3)."""
    # index3 is the L3 on nearly every machine: try it before the other indexes.
    names = sorted((n for n in fs.listdir(cache) or () if n.startswith("index")), key=lambda n: (n != "index3", n))
    for name in names:
        d = f"{cache}/{name}"
        if fs.integer(f"{d}/level") != 3:
            continue
        if fs.has(d, "type") and (fs.text(f"{d}/type") or "").startswith("Instruction"):
            continue
        return d
    return None


def l3_keys(fs: SysfsReader, online: frozenset[int],
            core_set: dict[int, frozenset[int]]) -> dict[int, int]:
    """cpu -> L3 key (lowest online CPU of the L3). CPUs in no readable L3 get no key.

    core_set: each CPU's core as the kernel lists it (its thread siblings), the set an empty map means.
    """
    key_of: dict[int, int] = {}
    for cpu in sorted(online):
        if cpu in key_of:
            continue
        index = _l3_index(fs, f"{CPU_DIR}/cpu{cpu}/cache")
        if index is None:
            continue
        shared = read_set(fs, index, ("shared_cpu_map", "shared_cpu_list"), empty_ok=True)
        if shared is None:
            continue
        if not shared:  # ia64 writes an empty L3 map: hwloc takes the core set instead
            shared = core_set.get(cpu, frozenset({cpu}))
        group = (shared & online) | {cpu}
        key = min(group)
        for c in group:
            key_of.setdefault(c, key)
    return key_of
