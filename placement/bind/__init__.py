"""Apply a Plan: process and thread affinity, memory policy, env; read back and logged."""
