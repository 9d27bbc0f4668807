"""Topology + JobSpec + PlacementConfig -> Plan. make_plan is pure (no I/O at all);
plan_for_node adds discovery and the job's GPUs from the environment.

The planner itself is imported on first use: workers only need the Plan dataclasses."""
from placement.plan.model import GpuRef, JobSpec, MemoryPolicy, Plan, RankPlan, RoleAssignment, SCHEMA

_LAZY = {"make_plan": "placement.plan.make", "plan_for_node": "placement.plan.node",
         "format_plan_table": "placement.plan.table"}

__all__ = ["GpuRef", "JobSpec", "MemoryPolicy", "Plan", "RankPlan", "RoleAssignment", "SCHEMA", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'placement.plan' has no attribute {name!r}")
