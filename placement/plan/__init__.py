"""Topology + JobSpec + PlacementConfig -> Plan. Pure: no I/O at all."""
from placement.plan.model import GpuRef, JobSpec, MemoryPolicy, Plan, RankPlan, RoleAssignment, SCHEMA

__all__ = ["GpuRef", "JobSpec", "MemoryPolicy", "Plan", "RankPlan", "RoleAssignment", "SCHEMA"]
