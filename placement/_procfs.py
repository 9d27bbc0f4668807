"""The one place /proc is read and parsed (as psutil's private _pslinux.py is for psutil).

One parser per file, one plain function per fact, every read bounded:
- /proc/<pid>[/task/<tid>]/stat       parse_stat       -> TaskStat (name, state, minflt, threads, last CPU)
- /proc/<pid>/task/<tid>/schedstat    parse_schedstat  -> SchedStat (on-CPU ns, runqueue wait ns)
- /proc/<pid>[/task/<tid>]/status     status_value     -> one field (Cpus_allowed_list, Mems_allowed_list,
                                                          nonvoluntary_ctxt_switches, Uid, PPid)
- /proc/<pid>[/task/<tid>]/comm       comm
- /proc/<pid>[/task/<tid>]/wchan      wchan            -> the kernel function it sleeps in
- /proc/<pid>/task, .../children      task_ids, children, pids
- /proc/<pid>/environ                 environ          -> the environment the process was started with
- /proc/<pid>/maps                    parse_maps       -> MapEntry (address range, perms, path)
- /proc/<pid>/numa_maps               parse_numa_maps  -> NumaMapsEntry (pages per node, page size)
and the calling thread's NUMA memory policy: get_mempolicy, set_mempolicy, probe_mempolicy
(raw syscalls: glibc wraps neither; modes named once, in MEMPOLICY_NAMES), and the node each
page of a process sits on: move_pages_query (move_pages(2) with nodes = NULL moves nothing).

One "thread gone" convention: every reader about a thread or process raises ThreadGone when it
exited (ENOENT at open, ESRCH at read of a kept descriptor); callers that walk threads skip it.
Any other OSError (EACCES, ...) and ValueError (a format not understood) propagate.

read_bounded is the bounded, regular-files-only read every file read of placement goes through
(topology._sysfs too): a FIFO would block forever and /dev/zero never ends.
"""
from __future__ import annotations

import array
import ctypes
import errno
import functools
import os
import platform
import stat as _stat
import threading
from typing import NamedTuple, Optional

from placement.cpuset import parse_cpulist

GONE_ERRNOS = (errno.ESRCH, errno.ENOENT)

# Largest sizes read, per file (a bigger one is refused, never truncated into a wrong value).
STAT_MAX = 4096  # 52 numbers and a 16-byte comm
SCHEDSTAT_MAX = 128
COMM_MAX = 64
STATUS_MAX = 256 * 1024  # Cpus_allowed_list of a sparse 8192-CPU mask stays far below
CHILDREN_MAX = 1024 * 1024


class ThreadGone(Exception):
    """The thread (or its process) exited: skip it, it is not an error."""


class NotRegularFile(OSError):
    """A path that is a FIFO, a device or a directory where a file was expected."""


class FileTooLarge(OSError):
    """A file longer than the bound its reader allows."""


# ---- bounded reads ----------------------------------------------------------------------
def read_bounded(path: str, limit: int) -> bytes:
    """At most `limit` bytes of a regular file (procfs and sysfs attributes are regular).

    Opened non-blocking so a FIFO cannot hang the open; refused (NotRegularFile) unless
    fstat says regular; FileTooLarge when the file holds more than `limit` bytes.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not _stat.S_ISREG(mode):
            kind = ("a FIFO" if _stat.S_ISFIFO(mode) else "a character device" if _stat.S_ISCHR(mode)
                    else "a block device" if _stat.S_ISBLK(mode) else "a directory" if _stat.S_ISDIR(mode)
                    else "a socket" if _stat.S_ISSOCK(mode) else "not a regular file")
            raise NotRegularFile(errno.EINVAL, f"is {kind}, not a regular file", path)
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise FileTooLarge(errno.EFBIG, f"larger than {limit} bytes", path)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _task_path(pid, tid: Optional[int], name: str, proc: str) -> str:
    return f"{proc}/{pid}/{name}" if tid is None else f"{proc}/{pid}/task/{tid}/{name}"


def _read_task(pid, tid: Optional[int], name: str, limit: int, proc: str) -> bytes:
    try:
        return read_bounded(_task_path(pid, tid, name, proc), limit)
    except OSError as e:
        if e.errno in GONE_ERRNOS:
            raise ThreadGone(tid if tid is not None else pid) from None
        raise


def pread_bounded(fd: int, limit: int, tid: int = 0) -> bytes:
    """One pread of a kept /proc descriptor; ThreadGone once its thread exited."""
    try:
        return os.pread(fd, limit, 0)
    except OSError as e:
        if e.errno in GONE_ERRNOS:
            raise ThreadGone(tid) from None
        raise


# ---- stat ---------------------------------------------------------------------------------
class TaskStat(NamedTuple):
    name: str  # field 2, comm
    state: str  # field 3: R, S, D, Z, ...
    minflt: int  # field 10
    num_threads: int  # field 20
    last_cpu: int  # field 39: the CPU it last ran on


def parse_stat(raw: bytes) -> TaskStat:
    """A stat line. The comm field may hold spaces and ')': fields are counted after the last ')'."""
    close = raw.rfind(b")")
    if close < 0:
        raise ValueError(f"not a /proc stat line: {raw[:40]!r}")
    fields = raw[close + 2:].split()
    try:
        return TaskStat(raw[raw.find(b"(") + 1:close].decode(errors="replace"), fields[0].decode(errors="replace"),
                        int(fields[7]), int(fields[17]), int(fields[36]))
    except (IndexError, ValueError):
        raise ValueError(f"not a /proc stat line: {raw[:40]!r}") from None


def stat(pid, tid: Optional[int] = None, proc: str = "/proc") -> TaskStat:
    return parse_stat(_read_task(pid, tid, "stat", STAT_MAX, proc))


def stat_at(fd: int, tid: int = 0) -> TaskStat:
    return parse_stat(pread_bounded(fd, STAT_MAX, tid))


# ---- schedstat ------------------------------------------------------------------------------
class SchedStat(NamedTuple):
    cpu_ns: int  # field 1: time on CPU
    runq_ns: int  # field 2: time runnable, waiting in the runqueue


def parse_schedstat(raw: bytes) -> SchedStat:
    fields = raw.split()
    return SchedStat(int(fields[0]), int(fields[1]))


def schedstat(pid, tid: int, proc: str = "/proc") -> SchedStat:
    return parse_schedstat(_read_task(pid, tid, "schedstat", SCHEDSTAT_MAX, proc))


def schedstat_at(fd: int, tid: int = 0) -> SchedStat:
    try:
        return parse_schedstat(pread_bounded(fd, SCHEDSTAT_MAX, tid))
    except IndexError:
        raise ValueError("schedstat holds fewer than 2 fields") from None


# ---- status ---------------------------------------------------------------------------------
CPUS_ALLOWED_LIST = b"Cpus_allowed_list:"
MEMS_ALLOWED_LIST = b"Mems_allowed_list:"
NONVOLUNTARY_SWITCHES = b"nonvoluntary_ctxt_switches:"
UID = b"Uid:"  # real, effective, saved, filesystem
PPID = b"PPid:"


def status_value(raw: bytes, key: bytes) -> str:
    """The value of one `Key:\\tvalue` line of a status file; ValueError when absent."""
    at = raw.find(b"\n" + key)
    if at < 0:
        if not raw.startswith(key):
            raise ValueError(f"no {key.decode()} line in status")
        at = 0
    else:
        at += 1
    end = raw.find(b"\n", at)
    return raw[at + len(key): end if end >= 0 else len(raw)].strip().decode(errors="replace")


def status(pid, tid: Optional[int] = None, proc: str = "/proc") -> bytes:
    return _read_task(pid, tid, "status", STATUS_MAX, proc)


def cpus_allowed(pid, tid: Optional[int] = None, proc: str = "/proc") -> frozenset[int]:
    """Cpus_allowed_list: the CPUs the kernel lets the thread run on (after cgroup narrowing)."""
    return parse_cpulist(status_value(status(pid, tid, proc), CPUS_ALLOWED_LIST))


def mems_allowed(pid="self", proc: str = "/proc") -> frozenset[int]:
    """Mems_allowed_list: the NUMA nodes the cgroup cpuset lets the process allocate on."""
    return parse_cpulist(status_value(status(pid, None, proc), MEMS_ALLOWED_LIST))


def owner_and_parent(pid, proc: str = "/proc") -> tuple[int, int]:
    """(real uid, parent pid) of a process, from one read of its status."""
    raw = status(pid, None, proc)
    try:
        return int(status_value(raw, UID).split()[0]), int(status_value(raw, PPID))
    except IndexError:
        raise ValueError("an empty Uid line in status") from None


def nonvoluntary_switches_at(fd: int, tid: int = 0) -> int:
    return int(status_value(pread_bounded(fd, STATUS_MAX, tid), NONVOLUNTARY_SWITCHES))


# ---- comm, task lists, children ----------------------------------------------------------------
WCHAN_MAX = 256  # one kernel symbol name


def wchan(pid, tid: Optional[int] = None, proc: str = "/proc") -> Optional[str]:
    """The kernel function the thread sleeps in (e.g. futex_do_wait), None when it is running
    or the kernel hides it ("0")."""
    name = _read_task(pid, tid, "wchan", WCHAN_MAX, proc).decode(errors="replace").strip()
    return None if name in ("", "0") else name


def comm(pid, tid: Optional[int] = None, proc: str = "/proc") -> str:
    return _read_task(pid, tid, "comm", COMM_MAX, proc).decode(errors="replace").strip()


def task_ids(pid, proc: str = "/proc") -> list[int]:
    """Thread ids of a process, sorted."""
    try:
        names = os.listdir(f"{proc}/{pid}/task")
    except OSError as e:
        if e.errno in GONE_ERRNOS:
            raise ThreadGone(pid) from None
        raise
    return sorted(int(t) for t in names if t.isdigit())


def task_children(pid, tid: int, proc: str = "/proc") -> list[int]:
    """The child processes thread `tid` of `pid` forked (its /proc children file)."""
    return [int(x) for x in _read_task(pid, tid, "children", CHILDREN_MAX, proc).split()]


def children(pid, proc: str = "/proc") -> list[int]:
    """Direct child processes, from /proc/<pid>/task/*/children (threads that exit meanwhile skipped)."""
    kids: list[int] = []
    for tid in task_ids(pid, proc):
        try:
            kids.extend(task_children(pid, tid, proc))
        except ThreadGone:
            continue
    return kids


def pids(proc: str = "/proc") -> list[int]:
    return sorted(int(p) for p in os.listdir(proc) if p.isdigit())


# ---- NUMA memory policy of the calling thread ------------------------------------------------
# include/uapi/linux/mempolicy.h modes, in placement's vocabulary ("none" = the kernel default).
MEMPOLICY_NAMES = {0: "none", 1: "preferred", 2: "bind", 3: "interleave", 4: "local",
                   5: "preferred_many", 6: "weighted_interleave"}
MEMPOLICY_MODES = {name: mode for mode, name in MEMPOLICY_NAMES.items()}
_MODE_FLAGS = 0x7 << 13  # MPOL_F_NUMA_BALANCING | MPOL_F_RELATIVE_NODES | MPOL_F_STATIC_NODES
# (set_mempolicy, get_mempolicy) syscall numbers; glibc wraps neither (libnuma does, but is optional).
_SYSCALLS = {"x86_64": (238, 239), "aarch64": (237, 236), "arm64": (237, 236), "riscv64": (237, 236),
             "loongarch64": (237, 236), "ppc64le": (261, 260), "ppc64": (261, 260), "s390x": (270, 269)}
MAX_NUMNODES = 1024  # the kernel's ceiling on node ids (CONFIG_NODES_SHIFT <= 10)
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8
_NodeMask = ctypes.c_ulong * (MAX_NUMNODES // _ULONG_BITS)


class Mempolicy(NamedTuple):
    mode: str  # a MEMPOLICY_NAMES value
    nodes: tuple[int, ...]  # empty for none/local


@functools.lru_cache(maxsize=None)
def _libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _syscall(number: int, *args) -> int:
    """syscall(2) with every argument widened to a full register (the call is variadic)."""
    return _libc().syscall(ctypes.c_long(number), *args)


def mempolicy_supported() -> bool:
    return platform.machine() in _SYSCALLS and _libc() is not None


def get_mempolicy() -> Optional[Mempolicy]:
    """The calling thread's policy; None where it cannot be read (unknown arch, syscall refused)."""
    if not mempolicy_supported():
        return None
    mode = ctypes.c_int(0)
    mask = _NodeMask()
    if _syscall(_SYSCALLS[platform.machine()][1], ctypes.byref(mode), mask, ctypes.c_ulong(MAX_NUMNODES),
                None, ctypes.c_ulong(0)) != 0:
        return None
    kernel_mode = mode.value & ~_MODE_FLAGS
    name = MEMPOLICY_NAMES.get(kernel_mode, f"mode{kernel_mode}")
    if name in ("none", "local"):
        return Mempolicy(name, ())
    return Mempolicy(name, tuple(n for n in range(MAX_NUMNODES) if mask[n // _ULONG_BITS] >> (n % _ULONG_BITS) & 1))


def set_mempolicy(mode: str, nodes) -> int:
    """Set the calling thread's policy; the errno it gives (0 = set). EINVAL for a node beyond
    MAX_NUMNODES, as the kernel answers; ENOSYS where the syscall is not known here."""
    if not mempolicy_supported():
        return errno.ENOSYS
    if any(not 0 <= n < MAX_NUMNODES for n in nodes):
        return errno.EINVAL
    mask = _NodeMask()
    for n in nodes:
        mask[n // _ULONG_BITS] |= 1 << (n % _ULONG_BITS)
    if _syscall(_SYSCALLS[platform.machine()][0], ctypes.c_long(MEMPOLICY_MODES[mode]), mask,
                ctypes.c_ulong(MAX_NUMNODES + 1)) != 0:
        return ctypes.get_errno() or errno.EINVAL
    return 0


def probe_mempolicy(mode: str, nodes) -> Optional[int]:
    """The errno set_mempolicy(mode, nodes) gives, tried in a throwaway thread (the policy is per
    thread and dies with it, so the caller's never changes; no fork, safe in a threaded process).
    0 = permitted; None = cannot be tried here."""
    if not mempolicy_supported():
        return None
    result: list[Optional[int]] = [None]

    def attempt() -> None:
        result[0] = set_mempolicy(mode, nodes)

    t = threading.Thread(target=attempt, name="placement_probe", daemon=True)
    t.start()
    t.join()
    return result[0]


# ---- maps, numa_maps, move_pages: where a process's pages are ------------------------------
MAPS_MAX = 16 * 1024 * 1024  # ~100 bytes a mapping: 160k mappings (torch+CUDA have a few thousand)
NUMA_MAPS_MAX = 64 * 1024 * 1024  # ~200 bytes a mapping
# Anonymous mappings the kernel makes itself: no pages of the process's data.
_SPECIAL_MAPPINGS = ("[vvar]", "[vdso]", "[vsyscall]", "[uprobes]", "[vvar_vclock]")


class MapEntry(NamedTuple):
    start: int
    end: int
    perms: str  # "rw-p"
    inode: int
    path: str  # "" for an anonymous mapping, "[heap]", "[stack]", "[anon:name]", or a file

    @property
    def anon_data(self) -> bool:
        """Private, readable and writable, not backed by a file, not the kernel's own: where
        the process's data (heap, malloc arenas, tensors' storage, stacks) lives."""
        return (self.inode == 0 and self.perms.startswith("rw") and self.perms.endswith("p")
                and (self.path == "" or self.path.startswith("[")) and self.path not in _SPECIAL_MAPPINGS)


def parse_maps(raw: bytes) -> list[MapEntry]:
    """/proc/<pid>/maps: `start-end perms offset dev inode [path]` per line (proc(5))."""
    out = []
    for line in raw.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        try:
            lo, hi = parts[0].split(b"-")
            out.append(MapEntry(int(lo, 16), int(hi, 16), parts[1].decode(), int(parts[4]),
                                parts[5].strip().decode(errors="replace") if len(parts) > 5 else ""))
        except ValueError:
            raise ValueError(f"not a /proc maps line: {line[:60]!r}") from None
    return out


def _read_listing(pid, name: str, limit: int, proc: str) -> bytes:
    """A /proc listing that may be megabytes, read in LISTING_CHUNK pieces (read_bounded asks
    for its whole limit at once: a 16 MiB buffer per read of a 10 KiB file)."""
    path = _task_path(pid, None, name, proc)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in GONE_ERRNOS:
            raise ThreadGone(pid) from None
        raise
    try:
        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", path)
        chunks, size = [], 0
        while chunk := os.read(fd, LISTING_CHUNK):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise FileTooLarge(errno.EFBIG, f"larger than {limit} bytes", path)
        return b"".join(chunks)
    except OSError as e:
        if e.errno in GONE_ERRNOS:
            raise ThreadGone(pid) from None
        raise
    finally:
        os.close(fd)


LISTING_CHUNK = 256 * 1024
ENVIRON_MAX = 4 * 1024 * 1024  # the kernel caps argv + envp at a quarter of the stack limit (2 MiB by default)


def environ(pid, proc: str = "/proc") -> dict[str, str]:
    """The environment the process was exec'd with (NAME=value, NUL separated; what it set later
    with putenv is not there). Reading another process's needs PTRACE_MODE_READ on it: EACCES
    otherwise, raised."""
    out = {}
    for item in _read_listing(pid, "environ", ENVIRON_MAX, proc).split(b"\0"):
        name, eq, value = item.partition(b"=")
        if eq and name:
            out[name.decode(errors="replace")] = value.decode(errors="replace")
    return out


def maps(pid="self", proc: str = "/proc") -> list[MapEntry]:
    """The process's mappings. Reading maps takes the mmap lock briefly but walks no page table."""
    return parse_maps(_read_listing(pid, "maps", MAPS_MAX, proc))


class NumaMapsEntry(NamedTuple):
    start: int
    policy: str  # "default", "bind:0", "interleave:0-1", "prefer:1", ...
    pages: dict  # node -> pages of this mapping resident there (N<node>=<pages>)
    page_kb: int  # kernelpagesize_kB: 4, or 2048 / 1048576 for huge pages
    file: Optional[str]  # file=..., None for anonymous memory
    kind: Optional[str]  # "heap", "stack" or None

    @property
    def anon_data(self) -> bool:
        return self.file is None


def parse_numa_maps(raw: bytes) -> list[NumaMapsEntry]:
    """/proc/<pid>/numa_maps (Documentation/admin-guide/mm/numa_memory_policy.rst; format
    written by show_numa_map() in fs/proc/task_mmu.c): `addr policy key=value ... N<n>=<pages>`."""
    out = []
    for line in raw.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        try:
            start = int(parts[0], 16)
        except ValueError:
            raise ValueError(f"not a /proc numa_maps line: {line[:60]!r}") from None
        pages: dict[int, int] = {}
        page_kb, file, kind = 4, None, None
        for word in parts[2:]:
            key, eq, value = word.partition(b"=")
            if not eq:
                if key in (b"heap", b"stack"):
                    kind = key.decode()
                continue
            try:
                if key[:1] == b"N" and key[1:].isdigit():
                    pages[int(key[1:])] = int(value)
                elif key == b"kernelpagesize_kB":
                    page_kb = int(value)
                elif key == b"file":
                    file = value.decode(errors="replace")
            except ValueError:
                raise ValueError(f"not a /proc numa_maps field: {word[:40]!r}") from None
        out.append(NumaMapsEntry(start, parts[1].decode(errors="replace"), pages, page_kb, file, kind))
    return out


def numa_maps(pid="self", proc: str = "/proc") -> list[NumaMapsEntry]:
    """Every mapping's pages per node. The kernel walks every page table of the process for
    this, under its mmap lock: costly on a big process (benchmarks/residence.py measures it)."""
    return parse_numa_maps(_read_listing(pid, "numa_maps", NUMA_MAPS_MAX, proc))


# move_pages syscall numbers (glibc does not wrap it; libnuma does, but is optional).
_MOVE_PAGES = {"x86_64": 279, "aarch64": 239, "arm64": 239, "riscv64": 239, "loongarch64": 239,
               "ppc64le": 301, "ppc64": 301, "s390x": 310}
MOVE_PAGES_BATCH = 4096  # addresses per call: the kernel takes the mmap lock per call, not per page


def move_pages_supported() -> bool:
    return platform.machine() in _MOVE_PAGES and _libc() is not None


def move_pages_query(addresses, pid: int = 0) -> list[int]:
    """The node each address's page sits on, or a negative errno (-ENOENT: no page there yet,
    -EFAULT: not mapped): move_pages(2) with nodes = NULL, which moves nothing, only reports
    (mm/migrate.c, do_pages_stat). pid 0 = the calling process; another process needs
    PTRACE_MODE_READ on it (same user). OSError when the call itself fails (ESRCH: gone ->
    ThreadGone; EPERM, ENOSYS)."""
    if not move_pages_supported():
        raise OSError(errno.ENOSYS, f"move_pages is not known on {platform.machine()}")
    out: list[int] = []
    number = _MOVE_PAGES[platform.machine()]
    for at in range(0, len(addresses), MOVE_PAGES_BATCH):
        pages = array.array("Q", addresses[at:at + MOVE_PAGES_BATCH])  # one C array, no per-item ctypes
        status = array.array("i", bytes(4 * len(pages)))
        if _syscall(number, ctypes.c_int(pid), ctypes.c_ulong(len(pages)), ctypes.c_void_p(pages.buffer_info()[0]),
                    None, ctypes.c_void_p(status.buffer_info()[0]), ctypes.c_int(0)) != 0:
            code = ctypes.get_errno() or errno.EINVAL
            if code in GONE_ERRNOS and pid:
                raise ThreadGone(pid)
            raise OSError(code, f"move_pages: {os.strerror(code)}")
        out.extend(status.tolist())
    return out
