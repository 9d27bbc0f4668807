"""CPU hogs for tests: forked busy loops pinned to one CPU (no exec, so they start at once)."""
import os
import signal
import time

from placerun_helpers import allowed


def spin_pinned(cpu: int, nice: int = 0) -> int:
    """Fork a process that spins on `cpu` until killed (at `nice`, where allowed: below 0 needs
    root); returns its pid once the kernel shows it pinned there (right after fork it still has
    the parent's mask)."""
    pid = os.fork()
    if pid == 0:
        try:
            if nice:
                try:
                    os.setpriority(os.PRIO_PROCESS, 0, nice)
                except PermissionError:
                    pass
            os.sched_setaffinity(0, {cpu})
            while True:
                pass
        finally:
            os._exit(0)
    deadline = time.monotonic() + 10
    while allowed(pid) != {cpu} and time.monotonic() < deadline:
        time.sleep(0.001)
    return pid


def stop(pids: list[int]) -> None:
    """Kill and reap every hog in `pids` (emptied)."""
    while pids:
        pid = pids.pop()
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
