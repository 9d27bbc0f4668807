"""The CPUs the process's cgroup cpuset allows (v1 or v2), read under the root.

proc/self/cgroup gives the process's cgroup path per hierarchy (proc/self/cpuset when
that file is missing), proc/mounts where each hierarchy is mounted; the cpuset file is
read at the cgroup's directory, walking up to the mount point when it is absent there
(a controller not enabled in the leaf, or a container that sees its own cgroup as the
mount's root).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from placement.topology._sysfs import SysfsReader

_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    point: str  # absolute, as the process sees it
    fstype: str
    options: frozenset[str]


def mounts(fs: SysfsReader) -> list[Mount]:
    out = []
    for line in (fs.text("proc/mounts") or "").splitlines():
        parts = line.split()
        if len(parts) >= 4:
            point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), parts[1])
            out.append(Mount(point, parts[2], frozenset(parts[3].split(","))))
    return out


def cgroup_paths(fs: SysfsReader) -> dict[str, str]:
    """Controller -> cgroup path; "" is the v2 unified hierarchy."""
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


def _cpuset_at(fs: SysfsReader, mount_point: str, path: str, files: tuple[str, ...]) -> Optional[frozenset[int]]:
    """The first non-empty cpuset file from the cgroup's directory up to the mount point."""
    mount_rel = mount_point.strip("/")
    parts = [p for p in path.split("/") if p]
    while True:
        d = os.path.join(mount_rel, *parts)
        for name in files:
            cpus = fs.cpus(f"{d}/{name}")
            if cpus:
                return cpus
        if not parts:
            return None
        parts.pop()


def cgroup_cpus(fs: SysfsReader) -> Optional[frozenset[int]]:
    """CPUs the cgroup cpuset allows; None when no cpuset restriction can be found."""
    all_mounts = mounts(fs)
    paths = cgroup_paths(fs)
    if not paths:
        legacy = fs.text("proc/self/cpuset")
        if legacy:
            paths = {"cpuset": legacy, "": legacy}
    v1 = next((m for m in all_mounts if m.fstype == "cgroup" and "cpuset" in m.options), None)
    if v1 is not None and "cpuset" in paths:
        return _cpuset_at(fs, v1.point, paths["cpuset"], ("cpuset.effective_cpus", "cpuset.cpus"))
    v2 = next((m for m in all_mounts if m.fstype == "cgroup2"), None)
    if v2 is not None and "" in paths:
        return _cpuset_at(fs, v2.point, paths[""], ("cpuset.cpus.effective",))
    return None
