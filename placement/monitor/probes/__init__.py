"""What the step hook and the monitor thread read of the rank's threads: main's counters at each
probe step (counters.py), every thread's span reading and the hot threads' per-step reads
(threads.py), the cores' clock (cpufreq.py), and how often the kernel counters are read
(budget.py: the probe cadence that keeps the hook inside monitor.budget_pct)."""
from placement.monitor.probes.budget import MAX_EVERY, ProbeBudget
from placement.monitor.probes.threads import RoleSampler, ThreadScan

__all__ = ["MAX_EVERY", "ProbeBudget", "RoleSampler", "ThreadScan"]
