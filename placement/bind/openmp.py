"""torch's OpenMP runtime counts its CPUs once, when it loads: main keeps the rank's share until then.

What
    hold_main_until_torch(binder): when torch is not imported yet (placerun's stage 2 runs
    before the program), main keeps the stage-1 mask, the rank's whole share, until the
    program's `import torch` has finished; then it is narrowed to its own core, as before.
    attach() runs after the program imported torch: nothing to hold.

Why
    torch's CPU builds run the intra-op pool on GNU OpenMP (libgomp, torch/lib/libgomp.so.1).
    libgomp counts the CPUs of the loading thread's mask once, at load
    (gcc libgomp/config/linux/proc.c gomp_init_num_threads: pthread_getaffinity_np on
    pthread_self; libgomp/env.c initialize_env: gomp_available_cpus is that count), and
    never again. A team with more threads than that count waits at every barrier spinning
    100 times instead of 300,000 before it sleeps in the kernel (env.c initialize_env:
    gomp_throttled_spin_count_var; config/linux/wait.h do_spin), so each parallel region
    of a small op pays a futex sleep and wake-up. Main narrowed to its one core before
    `import torch`, a CPU-only rank whose plan gives the pool main's and `other`'s CPUs
    (plan.auto.intra_op_threads) got the throttled waits where torchrun's unbound process
    does not (benchmarks/framework_callbacks.py: the plain DDP loop, docs/benchmarks.md).
    The pool's threads are bound by role as before: only the count libgomp keeps changes.
"""
from __future__ import annotations

import sys

from placement import imports

HOLD = "torch-import"
WHY = ("main kept the rank's share until torch was imported: its OpenMP runtime counts the CPUs "
       "of the loading thread once, and with more threads than that it sleeps at every barrier")


def hold_main_until_torch(binder) -> bool:
    """Hold main wide until torch's import has finished (nothing when it has already);
    whether a hold was taken."""
    if "torch" in sys.modules:
        return False
    binder.hold_main(HOLD, WHY)
    imports.when_imported("torch", lambda _torch: binder.release_main(HOLD))
    return True
