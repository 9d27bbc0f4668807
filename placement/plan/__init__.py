"""Topology + JobSpec + PlacementConfig -> Plan. make_plan is pure (no I/O at all);
plan_for_node adds discovery and the job's GPUs from the environment."""
from placement.plan.make import make_plan
from placement.plan.model import GpuRef, JobSpec, MemoryPolicy, Plan, RankPlan, RoleAssignment, SCHEMA
from placement.plan.node import plan_for_node
from placement.plan.table import format_plan_table

__all__ = ["GpuRef", "JobSpec", "MemoryPolicy", "Plan", "RankPlan", "RoleAssignment", "SCHEMA",
           "format_plan_table", "make_plan", "plan_for_node"]
