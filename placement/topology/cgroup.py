"""The CPUs the process's cpuset allows, read under the root: cgroup v2, cgroup v1 (also mounted
with `noprefix`) and the legacy cpuset filesystem.

Follows hwloc's reading (hwloc/topology-linux.c):
- where the cpuset hierarchy is mounted, `hwloc_find_linux_cgroup_mntpnt`: the standard places
  first (sys/fs/cgroup/cpuset.cpus.effective: v2; sys/fs/cgroup/cpuset/cpuset.cpus: v1;
  dev/cpuset/cpus: the cpuset filesystem), then proc/mounts in order: a `cgroup2` mount whose
  cgroup.controllers lists cpuset, a `cpuset` mount, a `cgroup` mount with the cpuset option
  (with `noprefix` its files are named like the cpuset filesystem's: `cpus`, not `cpuset.cpus`);
- the process's cpuset path, `hwloc_read_linux_cgroup_name`: proc/self/cpuset, else the cpuset
  (v1) or unified (v2) line of proc/self/cgroup;
- which file, `hwloc_admin_disable_set_from_cgroup`: v2 `cpuset.cpus.effective`; v1
  `cpuset.cpus` (not `cpuset.effective_cpus`: offline CPUs are removed by the caller, and on a
  live system sched_getaffinity narrows it further); the cpuset filesystem and v1 `noprefix`: `cpus`.

Where we differ on purpose:
- a missing or empty file at the cgroup's directory is looked for in its parents up to the mount
  point (hwloc then reports no restriction): a controller not enabled in the leaf, or a container
  that sees its own cgroup as the mount's root, still gets its real set;
- a `cgroup2` mount without a readable cgroup.controllers is taken (trees gathered without that
  file); one that lists controllers without cpuset is skipped, as hwloc does (hybrid systems);
- proc/self/cgroup's line is the one of the hierarchy found, not merely the first cpuset-or-unified line.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from enum import Enum
from typing import Optional

from placement.topology._sysfs import SysfsReader

_OCTAL = re.compile(r"\\([0-7]{3})")


class CpusetKind(Enum):
    """How a cpuset hierarchy names its CPU file (hwloc's enum hwloc_linux_cgroup_type_e)."""

    CGROUP2 = "cpuset.cpus.effective"
    CGROUP1 = "cpuset.cpus"
    CPUSET = "cpus"  # the legacy cpuset filesystem, and cgroup v1 mounted with noprefix


@dataclass(frozen=True)
class Mount:
    point: str  # absolute, as the process sees it
    fstype: str
    options: frozenset[str]


@dataclass(frozen=True)
class CpusetMount:
    kind: CpusetKind
    point: str


def mounts(fs: SysfsReader) -> list[Mount]:
    out = []
    for line in (fs.text("proc/mounts") or "").splitlines():
        parts = line.split()
        if len(parts) >= 4:
            point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), parts[1])
            out.append(Mount(point, parts[2], frozenset(parts[3].split(","))))
    return out


def cgroup_paths(fs: SysfsReader) -> dict[str, str]:
    """Controller -> cgroup path from proc/self/cgroup; "" is the v2 unified hierarchy."""
    text = fs.text("proc/self/cgroup")
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            out[""] = path
        for c in controllers.split(","):
            if c:
                out[c] = path
    return out


def _cgroup2_has_cpuset(fs: SysfsReader, point: str) -> bool:
    controllers = fs.text(f"{point.strip('/')}/cgroup.controllers")
    return controllers is None or "cpuset" in controllers.split()


def cpuset_mount(fs: SysfsReader) -> Optional[CpusetMount]:
    """Where the cpuset hierarchy is mounted and how it names its files; None if nowhere."""
    for kind, point in ((CpusetKind.CGROUP2, "/sys/fs/cgroup"), (CpusetKind.CGROUP1, "/sys/fs/cgroup/cpuset"),
                        (CpusetKind.CPUSET, "/dev/cpuset")):
        if fs.has(point.strip("/"), kind.value):
            return CpusetMount(kind, point)
    for m in mounts(fs):
        if m.fstype == "cgroup2" and _cgroup2_has_cpuset(fs, m.point):
            return CpusetMount(CpusetKind.CGROUP2, m.point)
        if m.fstype == "cpuset":
            return CpusetMount(CpusetKind.CPUSET, m.point)
        if m.fstype == "cgroup" and "cpuset" in m.options:
            return CpusetMount(CpusetKind.CPUSET if "noprefix" in m.options else CpusetKind.CGROUP1, m.point)
    return None


def cpuset_path(fs: SysfsReader, kind: CpusetKind) -> Optional[str]:
    """The process's cpuset path inside its hierarchy."""
    named = fs.text("proc/self/cpuset")
    if named:
        return named.splitlines()[0]
    paths = cgroup_paths(fs)
    return paths.get("" if kind is CpusetKind.CGROUP2 else "cpuset")


def _cpuset_at(fs: SysfsReader, mount_point: str, path: str, name: str) -> Optional[frozenset[int]]:
    """The first non-empty cpuset file from the cgroup's directory up to the mount point."""
    mount_rel = mount_point.strip("/")
    parts = [p for p in path.split("/") if p]
    while True:
        cpus = fs.cpus(os.path.join(mount_rel, *parts, name))
        if cpus:
            return cpus
        if not parts:
            return None
        parts.pop()


def cgroup_cpus(fs: SysfsReader) -> Optional[frozenset[int]]:
    """CPUs the cpuset allows (offline ones included: the caller removes them); None when no
    cpuset restriction can be found."""
    mount = cpuset_mount(fs)
    if mount is None:
        return None
    path = cpuset_path(fs, mount.kind)
    if path is None:
        return None
    return _cpuset_at(fs, mount.point, path, mount.kind.value)
