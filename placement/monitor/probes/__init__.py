"""What the monitor reads of the rank's threads: main's counters (counters.py), every thread's
span reading and the hot threads' per-step reads (threads.py), read off the training thread and
tagged with a step (sampled.py), the cores' clock (cpufreq.py), and how often the kernel
counters are read (budget.py: the probe cadence that keeps the monitor inside
monitor.budget_pct)."""
from placement.monitor.probes.budget import MAX_EVERY, ProbeBudget
from placement.monitor.probes.threads import RoleSampler, ThreadScan

__all__ = ["MAX_EVERY", "ProbeBudget", "RoleSampler", "ThreadScan"]
