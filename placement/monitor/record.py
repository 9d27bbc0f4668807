"""One per-step, per-rank record of the monitor (JSONL line with "type": "step").

Figures a probe could not read are None (and warned about once), never guessed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

VERDICTS = ("cpu-bound", "comm-bound", "data-bound", "balanced")


@dataclass
class RoleSample:
    """What the threads of one role did during one step (deltas over the step)."""

    threads: int = 0
    cpu_ms: Optional[float] = None  # on-CPU time (schedstat field 1)
    runq_ms: Optional[float] = None  # time runnable but waiting for a CPU (schedstat field 2)
    nivcsw: Optional[int] = None  # involuntary context switches
    migrations: Optional[int] = None  # times the thread's last CPU changed between samples
    minflt: Optional[int] = None  # minor faults
    mhz: Optional[float] = None  # current MHz of the core it last ran on (mean over threads)
    cpus: list[int] = field(default_factory=list)  # CPUs the role's threads last ran on

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RoleSample":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class StepRecord:
    rank: int
    step: int
    t: float  # wall clock at the end of the step (time.time())
    step_ms: float
    data_ms: float = 0.0  # time blocked waiting for the next batch
    comm_ms: float = 0.0  # time in collectives (NCCL: PyTorch's own timing; gloo: call wall time)
    comm_count: int = 0
    roles: dict[str, RoleSample] = field(default_factory=dict)
    verdict: str = "balanced"
    local_rank: int = 0
    # When this rank entered its first collective of the step (time.time()); tells the late
    # arriver from the ranks that waited for it.
    comm_enter_t: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {"type": "step", **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepRecord":
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        kw["roles"] = {r: RoleSample.from_dict(s) for r, s in (d.get("roles") or {}).items()}
        return cls(**kw)
