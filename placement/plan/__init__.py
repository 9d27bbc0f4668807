"""Topology + JobSpec + PlacementConfig -> Plan. Pure: no I/O at all."""
from placement.plan.model import GpuRef, MemoryPolicy, Plan, RankPlan, RoleAssignment, SCHEMA

__all__ = ["GpuRef", "MemoryPolicy", "Plan", "RankPlan", "RoleAssignment", "SCHEMA"]
