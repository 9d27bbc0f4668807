"""Apply a Plan: process and thread affinity, memory policy, env; read back and logged."""
from placement.bind.affinity import BindResult, apply_process_mask, bind_thread, read_allowed, read_last_cpu
from placement.bind.binder import RoleBinder
from placement.bind.memory import AppliedMemory, apply_memory_policy, read_mempolicy
from placement.roles import ThreadInfo

__all__ = ["AppliedMemory", "BindResult", "RoleBinder", "ThreadInfo", "apply_memory_policy",
           "apply_process_mask", "bind_thread", "read_allowed", "read_last_cpu", "read_mempolicy"]
