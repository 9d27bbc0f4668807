"""torch's DataLoader worker-count check, answered as for the process torchrun would have started.

What
    Before it starts workers, `DataLoader.check_worker_number_rationality` (torch/utils/data/
    dataloader.py, called from `__init__` and `_get_iterator`) warns when `num_workers` exceeds
    the CPUs it counts: `len(os.sched_getaffinity(0))` (torch 2.11; `torch._utils.cpu_count()` in
    2.13, the same call). `sched_getaffinity(0)` is the *calling thread's* mask, and placement
    narrows main to its own core (and the process to the rank's share), so every DataLoader with
    two or more workers warned "Our suggested max number of worker in current system is 1" under
    placerun (seen on an H200, docs/benchmarks.md) where torchrun gives no such line. The check now
    counts the CPUs the process was launched with (before stage 1: torchrun's mask).

Why this way
    torch's rule is kept: no warning while `num_workers` fits those CPUs (the check has no other
    effect, so it is not called then); past them, torch's own check runs with the calling thread's
    mask widened to them for its length (its count and message; the warning then names this frame
    where torch's would name its caller, the text unchanged). No thread is born meanwhile.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Iterable

MODULE = "torch.utils.data.dataloader"
_PATCHED = "_placement_share_check"
# The CPUs the check counts: the latest session's (a later attach() in the process replaces it).
_launched: list[Callable[[], Iterable[int]]] = [lambda: ()]


def count_workers_against(module, launched: Callable[[], Iterable[int]]) -> None:
    """Wrap module.DataLoader.check_worker_number_rationality (once per class) so that it counts
    `launched()`'s CPUs when the calling thread's mask is narrower; `launched` replaces the one
    given before and is asked at each call (empty: torch's own reading)."""
    _launched[0] = launched
    cls = module.DataLoader
    original = cls.check_worker_number_rationality
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def check_worker_number_rationality(loader):
        cpus = set(_launched[0]())
        try:
            mine = os.sched_getaffinity(0)
        except OSError:
            return original(loader)
        if not cpus or cpus <= mine:
            return original(loader)
        if loader.num_workers <= len(cpus):  # torch warns only past the CPUs it counts
            return None
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:  # a share the thread may not widen to (a cpuset changed): torch's own count
            return original(loader)
        try:
            return original(loader)
        finally:
            try:
                os.sched_setaffinity(0, mine)
            except OSError:
                pass

    setattr(check_worker_number_rationality, _PATCHED, True)
    cls.check_worker_number_rationality = check_worker_number_rationality
