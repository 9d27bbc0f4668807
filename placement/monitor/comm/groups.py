"""Which backend each process group really runs, from its backend config, never from the
string the user passed to init_process_group.

Why
    `get_backend(group)` gives that string back as given, so comparing it with "nccl" misses
    NCCL groups; the backend config names the backend of each device (below).

Upstream
    torch 2.13 (torch/distributed/distributed_c10d.py):
    - `get_backend(group)` returns that string as given: "undefined" when init_process_group()
      was called without one, "cpu:gloo,cuda:nccl" or "cuda:nccl" literally (Backend.__new__
      keeps unknown names, line 330), so comparing it with "nccl" misses NCCL groups.
    - `get_backend_config(group)` (line 1451) returns str(BackendConfig), "device:backend" pairs
      (BackendConfig.__repr__, line 483): "undefined" becomes the accelerator's default
      (BackendConfig.__init__, line 419: "cuda:nccl" on a GPU host, "cpu:gloo" here), "nccl"
      becomes "cuda:nccl", "gloo" "cpu:gloo,cuda:gloo".
    - a group with NCCL in its map gets NCCL as its default backend (lines 2073-2087), so
      `pg._register_on_completion_hook` (ProcessGroup.hpp:983, getDefaultBackend()) reaches
      ProcessGroupNCCL.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class GroupBackend:
    """One process group and the backend of each of its devices."""

    group: Any  # the ProcessGroup object (default group first)
    devices: dict[str, str]  # {"cpu": "gloo", "cuda": "nccl"}
    config: str  # get_backend_config's string, e.g. "cpu:gloo,cuda:nccl"

    @property
    def nccl(self) -> bool:
        return "nccl" in self.devices.values()

    @property
    def name(self) -> str:
        """One word for logs: "nccl" when any device runs NCCL, the backend when all devices
        share one, else the config string."""
        if self.nccl:
            return "nccl"
        names = set(self.devices.values())
        return names.pop() if len(names) == 1 else self.config


def parse_backend_config(config: str) -> dict[str, str]:
    """"cpu:gloo,cuda:nccl" -> {"cpu": "gloo", "cuda": "nccl"} (BackendConfig.__repr__'s form);
    a bare name (not expected from get_backend_config) maps to "*"."""
    devices: dict[str, str] = {}
    for pair in str(config).lower().split(","):
        pair = pair.strip()
        if not pair:
            continue
        device, sep, backend = pair.partition(":")
        if sep:
            devices[device.strip()] = backend.strip()
        else:
            devices["*"] = device
    return devices


def describe_group(dist, group) -> Optional[GroupBackend]:
    """The backend map of one group, None when this rank is not in it or it is gone."""
    try:
        config = dist.get_backend_config(group)
    except Exception:
        return None
    return GroupBackend(group, parse_backend_config(config), str(config))


def group_backends() -> list[GroupBackend]:
    """Every process group of this rank, the default group first; [] without one."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except ImportError:
        return []
    if not (dist.is_available() and dist.is_initialized()):
        return []
    default = c10d._get_default_group()
    groups = [default] + [g for g in list(getattr(c10d._world, "pg_map", {}).keys()) if g is not default]
    return [d for d in (describe_group(dist, g) for g in groups) if d is not None]


def nccl_groups() -> list[Any]:
    """Every process group with NCCL on some device (groups created later are not seen)."""
    return [g.group for g in group_backends() if g.nccl]


def default_backend() -> Optional[str]:
    """The default group's backend in one word (GroupBackend.name), None without a group."""
    groups = group_backends()
    return groups[0].name if groups else None
