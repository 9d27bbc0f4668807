"""placerun's automatic monitor: step records for every Python worker, the program unchanged.

`install_auto_monitor(session)` is called by placerun's worker bootstrap; steps are found by
torch's optimizer hooks and DataLoader fetches (steps.py's StepFinder), the monitor started as
attach() starts it (monitor.py). docs/monitor.md says how a step is found.
"""
from placement.auto.monitor import AutoMonitor, AutoState, install as install_auto_monitor
from placement.auto.steps import StepFinder

__all__ = ["AutoMonitor", "AutoState", "StepFinder", "install_auto_monitor"]
