"""What placerun hands every worker of its node: one file, named by one environment variable.

    PLACEMENT_PLAN_FILE=<tmpdir>/handoff.json    schema placement.handoff/1
      config              the PlacementConfig placerun resolved (overrides, YAML, defaults)
      plan                the node's Plan: per local rank its roles' CPU sets and the physical
                          cores of its share with their perf_rank (RankPlan.cores)
      keep_env            env names the user set before placerun: the plan's env leaves them
      virtual_local_rank  under torchrun --virtual-local-rank: the CUDA_VISIBLE_DEVICES list
                          placerun saw, from which a worker finds its local rank; else null

The plan carries everything a worker needs of the node (the tuner moves roles between the
cores it lists), so no worker reads or rediscovers the Topology. placerun writes the file once,
before torch's agent starts (elastic restarts reuse it); a worker reads it in stage 1
(placement.bootstrap). attach() without placerun plans in-process and has no hand-off.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from placement._procfs import read_bounded
from placement.config import PlacementConfig
from placement.errors import PlacementError
from placement.plan.model import Plan

SCHEMA = "placement.handoff/1"
PLAN_FILE_ENV = "PLACEMENT_PLAN_FILE"
FILE_NAME = "handoff.json"
HANDOFF_MAX = 64 * 1024 * 1024  # the plan of an 8192-CPU node, cores included, is a few MB


class HandoffError(PlacementError):
    """The hand-off file placerun gives its workers is missing or unreadable."""


@dataclass(frozen=True)
class VirtualLocalRank:
    """torchrun --virtual-local-rank: torch sets LOCAL_RANK=0 for every worker and
    CUDA_VISIBLE_DEVICES to the local rank's entry of the agent's own CUDA_VISIBLE_DEVICES list,
    or to str(local_rank) when the agent has none (torch/distributed/elastic/agent/server/
    local_elastic_agent.py, LocalElasticAgent._set_local_rank_env, torch 2.13), so the rank is
    found back from that entry."""

    devices: Optional[tuple[str, ...]]  # the CUDA_VISIBLE_DEVICES list placerun saw; None: unset

    def local_rank(self, environ: Mapping[str, str]) -> int:
        visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        try:
            return int(visible) if self.devices is None else [d.strip() for d in self.devices].index(visible)
        except ValueError:
            parent = None if self.devices is None else list(self.devices)
            raise HandoffError(f"--virtual-local-rank: CUDA_VISIBLE_DEVICES={visible!r} is not an entry of the "
                               f"launcher's list {parent!r}, so this worker's local rank is unknown") from None


@dataclass
class Handoff:
    config: PlacementConfig
    plan: Plan
    keep_env: tuple[str, ...] = ()
    virtual_local_rank: Optional[VirtualLocalRank] = None

    def local_rank(self, environ: Mapping[str, str]) -> Optional[int]:
        """This worker's local rank where LOCAL_RANK does not say it (--virtual-local-rank), else None."""
        return None if self.virtual_local_rank is None else self.virtual_local_rank.local_rank(environ)

    def to_dict(self) -> dict[str, Any]:
        v = self.virtual_local_rank
        return {"schema": SCHEMA, "config": self.config.to_dict(), "plan": self.plan.to_dict(),
                "keep_env": list(self.keep_env),
                "virtual_local_rank": None if v is None else {"devices": None if v.devices is None else list(v.devices)}}

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: str = "") -> "Handoff":
        """HandoffError (one line naming the file and the part) when `d` is not a hand-off."""
        where = f"the plan file {path!r}"
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            got = d.get("schema") if isinstance(d, dict) else type(d).__name__
            raise HandoffError(f"{where} is not a placement plan: schema {got!r} is not {SCHEMA!r}")
        plan = _part(Plan.from_dict, d.get("plan"), f"{where} is not a placement plan")
        config = _part(PlacementConfig.from_dict, d.get("config") or {}, f"{where} is not a placement config")
        v = d.get("virtual_local_rank")
        devices = None if v is None or v.get("devices") is None else tuple(str(x) for x in v["devices"])
        return cls(config, plan, tuple(d.get("keep_env") or ()), None if v is None else VirtualLocalRank(devices))

    def write(self, directory: str) -> str:
        """Write the file into `directory`; its path (the value of PLACEMENT_PLAN_FILE)."""
        path = os.path.join(directory, FILE_NAME)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)
        return path

    @classmethod
    def read(cls, path: str) -> "Handoff":
        try:
            text = read_bounded(path, HANDOFF_MAX)
        except OSError as e:
            raise HandoffError(f"cannot read the plan file {path!r}: {e.strerror or e}") from None
        try:
            d = json.loads(text)
        except ValueError as e:
            raise HandoffError(f"the plan file {path!r} is not a placement plan: {e}") from None
        return cls.from_dict(d, path)

    @classmethod
    def load(cls, environ: Mapping[str, str] = os.environ) -> "Handoff":
        """The hand-off of this worker, from the file PLACEMENT_PLAN_FILE names."""
        path = environ.get(PLAN_FILE_ENV)
        if not path:
            raise HandoffError(f"{PLAN_FILE_ENV} is not set: placement.bootstrap runs under placerun, "
                               "e.g. `placerun --nproc-per-node 2 train.py`")
        return cls.read(path)


def _part(build, data: Any, what: str):
    try:
        return build(data)
    except (PlacementError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise HandoffError(f"{what}: {e}") from None
