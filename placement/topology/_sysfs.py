"""Reading files under a topology root, the way sysfs needs it.

Every discovery module reads through one SysfsReader: paths are relative to the root
("sys/devices/system/cpu/online"), a missing file is simply None (most facts are
optional), NUL bytes are dropped, reads are bounded and refuse what is not a regular file, and a
file that exists but cannot be read or parsed adds one warning naming it and reads as None, so one
bad file never fails discovery.
"""
from __future__ import annotations

import errno
import os
import stat
from typing import Optional

from placement._procfs import read_bounded
from placement.cpuset import parse_cpulist, parse_cpumask

CPU_DIR = "sys/devices/system/cpu"
NODE_DIR = "sys/devices/system/node"

_ABSENT = (errno.ENOENT, errno.ENOTDIR)
# sysfs attributes are at most a page (cpu lists of huge machines a few pages); procfs files read
# here (numa_balancing, cgroup files) are smaller still.
FILE_MAX = 1024 * 1024


class SysfsReader:
    def __init__(self, root: str):
        self.root = os.path.realpath(root)
        self.warnings: list[str] = []
        self._listings: dict[str, Optional[frozenset[str]]] = {}

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def warn(self, rel: str, problem: str) -> None:
        self.warnings.append(f"{self.path(rel)}: {problem}")

    def text(self, rel: str) -> Optional[str]:
        """The file's text without NUL bytes and surrounding whitespace; None if absent or unreadable.

        Bounded (FILE_MAX) and regular files only: a FIFO would hang the read, a link to
        /dev/zero would never end; either is one warning naming the file, and reads as None.
        """
        try:
            raw = read_bounded(self.path(rel), FILE_MAX)
        except OSError as e:
            if e.errno not in _ABSENT:
                self.warn(rel, f"unreadable ({e.strerror})")
            return None
        return raw.replace(b"\x00", b"").decode("latin-1").strip()

    def head(self, rel: str, size: int = 4096) -> Optional[str]:
        """The first `size` bytes of a file that may be long (proc/cpuinfo); None if absent, not a
        regular file or unreadable (one warning, as text())."""
        try:
            fd = os.open(self.path(rel), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno not in _ABSENT:
                self.warn(rel, f"unreadable ({e.strerror})")
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self.warn(rel, "not a regular file")
                return None
            return os.read(fd, size).decode("latin-1")
        except OSError as e:
            self.warn(rel, f"unreadable ({e.strerror})")
            return None
        finally:
            os.close(fd)

    def integer(self, rel: str, base: int = 10) -> Optional[int]:
        text = self.text(rel)
        if text is None:
            return None
        try:
            return int(text, base)
        except ValueError:
            self.warn(rel, f"not an integer: {text[:40]!r}")
            return None

    def cpus(self, list_rel: Optional[str], mask_rel: Optional[str] = None) -> Optional[frozenset[int]]:
        """A CPU set from the `*_list` file, else from the hex-mask file; None if neither is usable."""
        for rel, parse in ((list_rel, parse_cpulist), (mask_rel, parse_cpumask)):
            if rel is None:
                continue
            text = self.text(rel)
            if text is None:
                continue
            try:
                return parse(text)
            except ValueError:
                self.warn(rel, f"not a cpu {'list' if parse is parse_cpulist else 'mask'}: {text[:40]!r}")
        return None

    def listdir(self, rel: str) -> Optional[frozenset[str]]:
        """Names in a directory (None if absent), listed once per reader: modules that ask for the
        same directory (a CPU's, to skip files it does not have) share one system call."""
        if rel not in self._listings:
            try:
                self._listings[rel] = frozenset(os.listdir(self.path(rel)))
            except OSError as e:
                if e.errno not in _ABSENT:
                    self.warn(rel, f"unlistable ({e.strerror})")
                self._listings[rel] = None
        return self._listings[rel]

    def has(self, rel_dir: str, name: str) -> bool:
        """Whether directory `rel_dir` holds `name` (from its cached listing)."""
        return name in (self.listdir(rel_dir) or ())

    def resolve(self, rel: str) -> Optional[str]:
        """The root-relative real path of `rel` after following its links; None if it is missing or
        leads outside the root."""
        real = os.path.realpath(self.path(rel))
        if not os.path.exists(real):
            return None
        if self.root == "/":
            return real.lstrip("/")
        if not real.startswith(self.root + os.sep):
            return None
        return real[len(self.root) + 1:]
