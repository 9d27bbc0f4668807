"""Current MHz of a core from sysfs cpufreq, through one kept fd per core.

/proc/cpuinfo is far too slow to read per step (it formats every CPU); scaling_cur_freq
of the one core a thread ran on costs one pread. Machines without cpufreq (many VMs)
have no such file: every figure is then None, and that is said once.
"""
from __future__ import annotations

import os
from typing import Callable, Optional


class CoreFreq:
    def __init__(self, fail: Callable[[str, BaseException], None], root: str = "/"):
        self._root = root
        self._fail = fail
        self._fds: dict[int, Optional[int]] = {}

    def _fd(self, cpu: int) -> Optional[int]:
        if cpu in self._fds:
            return self._fds[cpu]
        path = os.path.join(self._root, f"sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq")
        try:
            fd: Optional[int] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            fd = None
            self._fail("cpufreq", e)
        self._fds[cpu] = fd
        return fd

    def mhz(self, cpu: Optional[int]) -> Optional[float]:
        """MHz of `cpu` now, or None when it has no cpufreq file or the read fails."""
        if cpu is None:
            return None
        fd = self._fd(cpu)
        if fd is None:
            return None
        try:
            return int(os.pread(fd, 32, 0)) / 1000.0
        except (OSError, ValueError) as e:
            self._fail("cpufreq", e)
            return None

    def close(self) -> None:
        for fd in self._fds.values():
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fds.clear()
