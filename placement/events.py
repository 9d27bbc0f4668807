"""The per-rank JSONL stream: step records and events (bind, tune, rollback, straggler, warning).

One file per rank, `<log_dir>/rank<R>.jsonl`. Writes are buffered and flushed every
N records by the caller and at close; a write error is never raised into training code:
it is said once, the lines lost are counted, and the count is said at exit and written
as a `lost` event that `placement report` shows.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import gzip
import json
import os
import re
import stat
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Optional, Sequence

from placement.errors import PlacementError
from placement.roles import OWN_THREADS
from placement.vocab import Vocabulary


class EventKind(Vocabulary):
    """The `type` of every line of a rank's JSONL log: a step record or an event. Readers
    (placement report) compare it with these values."""

    STEP = "step"  # one step's record (records/step.py)
    DIGEST = "digest"  # a rank's steps of one digest window, summed (records/digest.py)
    START = "start"  # stage 1 bound the process (source absent) / the monitor started (source "monitor")
    END = "end"  # the session or the monitor ended
    BIND = "bind"  # a mask applied to the process or a thread
    RESTORE = "restore"  # attach() put back the mask the process had before it
    MEMORY = "memory"  # the memory policy planned, applied and read back
    WARNING = "warning"
    MONITOR = "monitor"  # what the monitor says of itself (budget, comm source figures)
    TUNE = "tune"  # a tuner action: dry run, applied, kept
    ROLLBACK = "rollback"  # a tuner action not applied or rolled back
    STRAGGLER = "straggler"  # rank 0's verdict on an exchange window
    STALL = "stall"  # a rank stopped stepping, or resumed
    RESIDENCE = "residence"  # where a rank's resident pages sit (residence.py), at a low rate
    LOST = "lost"  # records this log could not write (a full disk)


def rank_log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank}.jsonl")


def index_path(log_path: str) -> str:
    """The log's event index: every line of `rank<R>.jsonl` (and of its rotated pieces) that is
    not a step line, in `rank<R>.events` beside it, so that `placement report --read digests`
    reads kilobytes per rank, not the whole log. Not `*.jsonl`: a glob of logs never takes it."""
    stem = log_path[:-len(".jsonl")] if log_path.endswith(".jsonl") else log_path
    return stem + ".events"


class LogDirError(PlacementError):
    """monitor.log_dir cannot be created or written: one line, exit 2, before any worker starts
    (placerun) or from attach() (without placerun): the same decision for both."""


def _log_dir_error(log_dir: str, why: str) -> LogDirError:
    return LogDirError(f"placement.monitor.log_dir={log_dir!r} is not writable ({why}); give a directory "
                       "this process can create and write, e.g. placement.monitor.log_dir=placement_logs")


def check_log_dir(log_dir: str) -> None:
    """Raise LogDirError unless files can be created in `log_dir`, or in its nearest existing
    ancestor when it does not exist yet (nothing is created but a probe file, removed at once)."""
    path = os.path.abspath(log_dir)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    if not os.path.isdir(path):
        raise _log_dir_error(log_dir, f"{path} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".placement-probe-", dir=path)
    except OSError as e:
        raise _log_dir_error(log_dir, e.strerror or str(e)) from None
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError:
        pass


def open_rank_log(log_dir: str, rank: int, run: Optional[str] = None, rotate_mb: float = 0.0) -> "EventLog":
    """The rank's event log in `log_dir`, its records marked with `run`, rotated and compressed
    every `rotate_mb` (0: never); LogDirError (one line) when it cannot be opened."""
    try:
        return EventLog(rank_log_path(log_dir, rank), rank, run, int(rotate_mb * (1 << 20)))
    except LogRefused as e:
        _say(f"placement: rank {rank}: no log written in placement.monitor.log_dir={log_dir!r}: "
             f"{e.strerror or e}; the job runs on without it")
        return EventLog(None, rank, run)
    except OSError as e:
        raise _log_dir_error(log_dir, e.strerror or str(e)) from None


_open_logs: "weakref.WeakSet[EventLog]" = weakref.WeakSet()
HELD_MAX = 10_000  # records a held log keeps before its file is known (a rank's start is ~30)
BUFFER_BYTES = 1 << 16  # lines are written when this much is buffered, at flush() and at close()
CLOSE_WAIT_S = 5.0  # close() waits this long for another thread's write, never for its own
# Called after a log's lock is released (on_release): placement.monitor.exitflush registers the
# one that delivers a signal whose flush waited for the thread the signal interrupted.
_release_hooks: tuple[Callable[[], None], ...] = ()


def on_release(hook: Callable[[], None]) -> None:
    """Call `hook` (no arguments, never raising) each time a thread lets go of an event log's
    lock, and when a wait for it gives up. Registering the same hook twice keeps one."""
    global _release_hooks
    if hook not in _release_hooks:
        _release_hooks = _release_hooks + (hook,)


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker) inherits the rank's unwritten lines; if it ever
    # wrote them, the rank's records would be written twice. Forget them and the file; the
    # lock may have been held by a thread that does not exist in the child: a new one.
    for ev in list(_open_logs):
        ev._lock = threading.Lock()
        ev._inside = threading.local()
        ev._buf, ev._buf_bytes = [], 0
        ev._fd = None
        ev._index_buf, ev._index_fd = [], None
        ev._reported = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def _say(text: str) -> None:
    """One line on stderr with a raw write: safe inside a signal handler that may have
    interrupted a write to sys.stderr itself."""
    try:
        os.write(2, (text.rstrip("\n") + "\n").encode(errors="replace"))
    except OSError:
        pass


class EventLog:
    """Append-only JSONL writer shared by binder, monitor and tuner of one rank.

    Never waits on its own lock: a signal handler running on the thread that holds it (it
    interrupted that thread's write) gets False from flush() and the caller defers. Lines that
    cannot be written (a full disk) are counted in `dropped`: said once on stderr when it
    happens, written as a `lost` event as soon as a write succeeds again, and said again at
    close/exit with the total.
    """

    def __init__(self, path: Optional[str], rank: int = 0, run: Optional[str] = None, rotate_bytes: int = 0):
        self.path = path
        self.rank = rank
        self.run = run  # the run's id (identity.py), in every record written; None: not known
        self.rotate_bytes = rotate_bytes  # rotate the file past this size (0: never): _rotate
        self._size = 0
        self._lock = threading.Lock()
        self._inside = threading.local()  # .here: this thread holds (or is taking/releasing) _lock
        self._fd: Optional[int] = None
        self._buf: list[str] = []
        self._buf_bytes = 0
        self._index_fd: Optional[int] = None  # index_path(path): the events again, never rotated
        self._index_buf: list[str] = []
        self.dropped = 0  # records that could not be written
        self.error: Optional[str] = None  # the first write error, one line
        self._dropped_logged = 0  # the count the last `lost` event written carries
        self._torn = False  # the file ends inside a line (a partial write)
        self._reported = False  # the total was said on stderr
        # Called with every event written (not step lines), after it is buffered: the live
        # metrics count stalls, drift, tuner actions from here (placement/metrics/rank.py).
        self._taps: list = []
        self._held: Optional[list[dict[str, Any]]] = None  # records kept until open_at() (held())
        if path:
            self._open(path)

    def _open(self, path: str) -> None:
        """Open the rank's log for this writer alone: in a directory of ours that no other user can
        write (LogRefused otherwise), never through a link (O_NOFOLLOW), mode 0600, with an
        exclusive lock; a file another job's writer holds (two jobs started in one directory) is
        left to it and this one writes rank<R>-<n>.jsonl beside it, said once."""
        own_log_dir(os.path.dirname(os.path.abspath(path)))
        stem = path[:-len(".jsonl")] if path.endswith(".jsonl") else path
        for n in range(1, WRITERS_MAX + 1):
            candidate = path if n == 1 else f"{stem}-{n}.jsonl"
            fd = _open_nofollow(candidate, os.O_RDWR | os.O_APPEND | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue  # another writer's
                raise
            break
        else:
            raise LogRefused(f"{WRITERS_MAX} writers already hold {path} and its siblings")
        if candidate != path:
            _say(f"placement: rank {self.rank}: {path} is being written by another job (started in the same "
                 f"directory); this one writes {candidate} (`placement report` reads them as separate runs)")
        self.path = path = candidate
        self._fd = fd
        self._size = os.fstat(self._fd).st_size
        try:
            if self._size == 0 or os.path.lexists(index_path(path)):  # an index of the whole log, or none
                self._index_fd = _open_nofollow(index_path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except OSError as e:
            _say(f"placement: rank {self.rank}: no event index beside {path} ({e.strerror or e}); "
                 "`placement report --read digests` reads the log itself")
        _open_logs.add(self)

    # ---- a log whose rank is not known yet -------------------------------------------------
    @classmethod
    def held(cls, rank: int) -> "EventLog":
        """A log that keeps its records (at most HELD_MAX) until open_at() names its file: a Ray
        worker is bound before its program says which rank it is (placement/integrations/ray.py)."""
        log = cls(None, rank)
        log._held = []
        return log

    def open_at(self, path: str, rank: int, run: Optional[str]) -> None:
        """Write to `path` from now on, as `rank` of `run`, beginning with the records held so far.
        OSError when the file cannot be opened (the records stay held)."""
        self.path, self.rank, self.run = path, rank, run
        self._open(path)
        held, self._held = self._held or [], None
        for rec in held:
            rec["rank"] = rank
            if run is not None:
                rec["run"] = run
            self.write(rec)

    # ---- the lock: never waited on by the thread that holds it ----------------------------
    # `_inside.here` is set by a thread BEFORE it takes the lock and cleared AFTER it lets go, so
    # a signal handler (which runs on the main thread, between two bytecodes of whatever that
    # thread was doing) sees it at every point where the lock may be this thread's, including
    # the instants between the acquire and the bookkeeping. Per thread: another thread's
    # holding never makes the main thread's handler give up, only wait (bounded where it asks).
    def held_here(self) -> bool:
        """Whether the calling thread holds the lock, or is taking or releasing it (a signal
        handler that interrupted this thread's own write must not wait for it)."""
        return getattr(self._inside, "here", False)

    def _acquire(self, timeout: float = -1) -> bool:
        inside = self._inside
        if getattr(inside, "here", False):
            return False
        inside.here = True
        if not self._lock.acquire(timeout=timeout):
            inside.here = False
            self._run_hook()  # a signal that arrived while we waited is delivered now
            return False
        return True

    def _release(self) -> None:
        self._lock.release()
        self._inside.here = False
        self._run_hook()

    @staticmethod
    def _run_hook() -> None:
        for hook in _release_hooks:
            hook()

    # ---- writing --------------------------------------------------------------------------
    def write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            if self._held is not None:
                if len(self._held) < HELD_MAX:
                    self._held.append(record)
                else:
                    self._count_lost(1, f"more than {HELD_MAX} records before the log's rank was known")
            return
        self._append((json.dumps(record, separators=(",", ":"), default=_jsonable),), index=True)

    def write_lines(self, lines: Sequence[str]) -> None:
        """Append already-encoded JSONL lines (the monitor's batched step records)."""
        self._append(lines, index=False)

    def _append(self, lines: Sequence[str], index: bool) -> None:
        """Buffer `lines` for the log (and its event index, for `index`)."""
        if self._fd is None or not lines:
            return
        blob = "\n".join(lines) + "\n"
        if not self._acquire():
            # Called from a signal handler that interrupted this thread's own write: the
            # buffer may be half-swapped, so these lines are counted, not risked.
            self._count_lost(len(lines), "the log was busy in the interrupted thread")
            return
        try:
            self._buf.append(blob)
            self._buf_bytes += len(blob)
            if index and self._index_fd is not None:
                self._index_buf.append(blob)
            if self._buf_bytes >= BUFFER_BYTES:
                self._write_buffer()
        finally:
            self._release()

    def add_tap(self, tap: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Call tap(record) with every event written from now on (not step lines); returns what
        takes it off again."""
        self._taps.append(tap)
        return lambda: self._taps.remove(tap) if tap in self._taps else None

    def event(self, kind: EventKind, **fields: Any) -> dict[str, Any]:
        """Write one event record and return it."""
        rec = {"type": kind, "t": time.time(), "rank": self.rank, **fields}
        if self.run is not None:
            rec["run"] = self.run
        self.write(rec)
        for tap in list(self._taps):
            try:
                tap(rec)
            except Exception as e:  # a tap never breaks the log it listens to: said once, then dropped
                self._taps.remove(tap)
                _say(f"placement: rank {self.rank}: an event listener failed and is dropped "
                     f"({type(e).__name__}: {e})")
        return rec

    def flush(self, timeout: float = -1) -> bool:
        """Write the buffered lines. False (nothing done) when the calling thread holds the lock
        (a signal handler that interrupted its write) or another held it beyond `timeout`."""
        if self._fd is None:
            return True
        if not self._acquire(timeout):
            return False
        try:
            self._write_buffer()
        finally:
            self._release()
        return True

    def close(self) -> None:
        if self._fd is None:
            return
        if not self._acquire(CLOSE_WAIT_S):
            # Another thread held the log past CLOSE_WAIT_S: the lines buffered are not written
            # by this close, and are counted (read without the lock: at close, a best count).
            self._count_lost(sum(b.count("\n") for b in list(self._buf)),
                             f"the log was busy for {CLOSE_WAIT_S:.0f} s at close")
            self.report_losses()
            return
        try:
            self._write_buffer()
            fd, self._fd = self._fd, None
            index_fd, self._index_fd = self._index_fd, None
            for f in (fd, index_fd):
                try:
                    if f is not None:
                        os.close(f)
                except OSError:
                    pass
        finally:
            self._release()
        _open_logs.discard(self)
        self.report_losses()

    def report_losses(self) -> None:
        """Say the total of dropped records on stderr, once (at close or exit)."""
        if self.dropped and not self._reported:
            self._reported = True
            _say(f"placement: rank {self.rank}: {self.dropped} record(s) could not be written to {self.path} "
                 f"({self.error}); they are lost")

    # ---- the one place bytes reach the file (the caller holds the lock) -------------------
    def _write_buffer(self) -> None:
        blob = "".join(self._buf)
        records = blob.count("\n")
        prefix = "\n" if self._torn else ""  # a torn last line stays alone (a reader skips it)
        if self.dropped > self._dropped_logged:
            lost = {"type": EventKind.LOST, "t": time.time(), "rank": self.rank, "records": self.dropped,
                    "error": self.error}
            if self.run is not None:
                lost["run"] = self.run
            prefix += json.dumps(lost, separators=(",", ":")) + "\n"
        if not blob and not prefix:
            return
        self._buf, self._buf_bytes = [], 0
        self._write_index(prefix.lstrip("\n") + "".join(self._index_buf))
        data = (prefix + blob).encode()
        written = 0
        try:
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except OSError as e:
            if written:
                self._torn = data[written - 1:written] != b"\n"
            whole = max(0, data[:written].count(b"\n") - prefix.count("\n"))
            self._count_lost(records - whole, f"{errno.errorcode.get(e.errno or 0, e.errno)} {e.strerror}")
            return
        self._torn = False
        if f'"{EventKind.LOST}"' in prefix:
            self._dropped_logged = self.dropped
        self._size += written
        if self.rotate_bytes and self._size >= self.rotate_bytes:
            self._rotate()

    def _write_index(self, text: str) -> None:
        """The event index's share of a write (the caller holds the lock). An index that cannot be
        written whole is removed, said once: a reader then reads the log itself, never a partial index."""
        self._index_buf = []
        if self._index_fd is None or not text:
            return
        data = text.encode()
        try:
            written = 0
            while written < len(data):
                written += os.write(self._index_fd, data[written:])
        except OSError as e:
            fd, self._index_fd = self._index_fd, None
            os.close(fd)
            try:
                os.unlink(index_path(self.path))
            except OSError:
                pass
            _say(f"placement: rank {self.rank}: the event index beside {self.path} is removed, a write to it "
                 f"failed ({errno.errorcode.get(e.errno or 0, e.errno)} {e.strerror}); `placement report --read "
                 "digests` reads the log itself")

    def _rotate(self) -> None:
        """The file so far becomes rank<R>.<NNNN>.jsonl (the next free number) and a thread of its
        own compresses it to .jsonl.gz (~10x smaller: docs/monitor.md, log size); writing goes on in
        a new rank<R>.jsonl at once. A rotation that fails leaves the file growing and says so once."""
        stem = self.path[:-len(".jsonl")] if self.path.endswith(".jsonl") else self.path
        try:
            if not _same_file(self._fd, self.path):
                raise OSError(errno.ESTALE, "the file at its path is no longer the one this writer holds")
            taken = {int(m.group(2)) for m in (_ROTATED.match(name) for name in os.listdir(os.path.dirname(
                os.path.abspath(self.path)) or ".")) if m and m.group(1) == os.path.basename(stem)}
            rotated = f"{stem}.{max(taken, default=0) + 1:04d}.jsonl"
            os.fsync(self._fd)  # the lines written are on disk before the name changes
            os.rename(self.path, rotated)
            fd = _open_nofollow(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self.rotate_bytes = 0
            _say(f"placement: rank {self.rank}: cannot rotate {self.path} ({e.strerror or e}); it keeps growing")
            return
        old, self._fd, self._size = self._fd, fd, 0
        OWN_THREADS.start(compress_rotated, "placement_gzip", (old, rotated, self.rank))

    def _count_lost(self, n: int, why: str) -> None:
        if n <= 0:
            return
        self.dropped += n
        if self.error is None:
            self.error = why
            _say(f"placement: rank {self.rank}: cannot write {self.path} ({why}): {n} record(s) dropped; "
                 "further losses are counted and the total is said at exit and in `placement report`")


_ROTATED = re.compile(r"^(rank\d+(?:-\d+)?)\.(\d+)\.jsonl(\.gz)?$")
WRITERS_MAX = 64  # jobs writing one rank's log in one directory at once, each its own file
_compressing: set[str] = set()  # temporaries being written (removed at exit if a thread left one)


class UnsafePlace(OSError):
    """A file or directory in a shared place (a log dir, /tmp, /dev/shm) that another user could
    have planted or can write: not used, one line says why."""


class LogRefused(UnsafePlace):
    """The log dir or file is not one this process may write safely (not ours, writable by
    others, a link, not a regular file): the rank runs on without a log, said once."""


def private_dir(path: str) -> str:
    """`path` as a directory only this user can enter: created mode 0700, or taken as found when
    lstat says it is a directory (not a link) of this user's with no group or other bits;
    UnsafePlace otherwise (another user made it first, or can write it). `path`, checked."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePlace(errno.ENOTDIR, f"{path} is not a directory of ours (a link or another file)")
    if st.st_uid != os.geteuid():
        raise UnsafePlace(errno.EPERM, f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise UnsafePlace(errno.EPERM, f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}, "
                                       "not 700)")
    return path


def own_log_dir(path: str) -> None:
    """Create `path` (mode 0700 for what is created) or take it as found when it is a directory
    owned by this user (or by root) that no other user can write (no world-write bit); LogRefused
    otherwise. A link to such a directory is followed: its target is what is checked."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise LogRefused(errno.ENOTDIR, f"{path} is not a directory")
    if st.st_uid not in (os.geteuid(), 0):
        raise LogRefused(errno.EPERM, f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
    if st.st_mode & stat.S_IWOTH:
        raise LogRefused(errno.EPERM, f"{path} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}): "
                                      "another user could plant its files; give a directory of your own")


def _open_nofollow(path: str, flags: int) -> int:
    """Open a log file never through a link, mode 0600 when created; LogRefused for a link or
    anything but a regular file (a FIFO, a device)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LogRefused(errno.ELOOP, f"{path} is a symbolic link; a log is never written through one") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LogRefused(errno.EINVAL, f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def _same_file(fd: int, path: str) -> bool:
    """Whether `path` (not followed) is the file `fd` holds."""
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def compress_rotated(fd: int, path: str, rank: int) -> Optional[str]:
    """Compress a rotated log, read from the descriptor its writer held (`fd`, closed here), to
    path + '.gz': written aside to a temporary made with O_EXCL (never through a planted link),
    synced, renamed, then the original removed when the file at its path is still that one; a
    reader never sees a half file, and one that lists both reads the original (logs.expand). On
    failure the original stays, said once. The .gz path, or None."""
    tmp, done = path + ".gz.tmp", path + ".gz"
    out = None
    try:
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(tmp)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(tmp)  # a temporary of ours left by a process that died mid-compression
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        _compressing.add(tmp)
        with os.fdopen(out, "wb") as raw, gzip.GzipFile(filename=os.path.basename(path), mode="wb",
                                                         compresslevel=6, fileobj=raw) as dst:
            out = None  # closed by the with
            offset = 0
            while True:
                chunk = os.pread(fd, 1 << 20, offset)
                if not chunk:
                    break
                dst.write(chunk)
                offset += len(chunk)
            dst.flush()
            raw.flush()
            os.fsync(raw.fileno())
        os.rename(tmp, done)
        _compressing.discard(tmp)
        if _same_file(fd, path):
            os.unlink(path)
        return done
    except OSError as e:
        if out is not None:
            os.close(out)
        if tmp in _compressing:
            _compressing.discard(tmp)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        _say(f"placement: rank {rank}: cannot compress {path} ({e.strerror or e}); it stays uncompressed")
        return None
    finally:
        os.close(fd)


def _remove_temporaries() -> None:
    """At exit: the temporaries of a compression a daemon thread had not finished."""
    for tmp in list(_compressing):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    _compressing.clear()


def report_all_losses() -> None:
    """Every open log says its dropped total (at exit, on SIGTERM)."""
    for ev in list(_open_logs):
        ev.report_losses()


atexit.register(report_all_losses)
atexit.register(_remove_temporaries)


def _jsonable(o: Any) -> Any:
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "value"):
        return o.value
    return str(o)
