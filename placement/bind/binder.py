"""Stage 2: bind every thread of a rank, and of its DataLoader worker processes, by role.

Threads appear late (NCCL creates its proxy threads lazily, DataLoader workers respawn every
epoch), so the binder is rescanned by a low-rate watcher thread (off the training thread;
forked DataLoader workers are re-homed at birth by placement.bind.fork). A rescan lists thread ids only; names are read and threads bound only when
that list changed, or while a thread is young (threads are named just after they start).

`main` is narrowed to its own core once NCCL has created its hot threads (NCCL gives the
threads it creates during communicator init the caller's mask, so a narrow main would squeeze
them onto main's core), at once when this rank has no GPU or its process group has no NCCL
backend, and in any case after MAIN_WAIT_S: NCCL threads may never show (NCCL_SET_THREAD_NAME=0,
a GPU rank that never calls init_process_group), and main must not stay wide for the whole run.
Before all that, main keeps the stage-1 mask while a hold is on (hold_main): placerun's stage 2
holds it until the program has imported torch, whose OpenMP runtime counts its CPUs once, from
the loading thread's mask (bind/openmp.py).

Drift check: NCCL rewrites the *calling* thread's mask during communicator init (v2.28.9-1
src/init.cc:1000-1002 saves it and narrows it to (mask & GPU-local CPUs), src/init.cc:1395
restores the saved one), so what this binder set is not what a thread keeps. Every rescan reads
the hot threads' Cpus_allowed_list back from /proc and re-applies their set where something
rewrote it, with a `bind` event naming what it found.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from placement.bind.affinity import BindResult, bind_thread, read_allowed
from placement.cpuset import format_cpulist
from placement.events import EventKind
from placement.plan.model import RankPlan
from placement import _procfs
from placement.roles import HOT_ROLES, OWN_THREADS, ThreadInfo, ThreadRole, scan_threads

log = logging.getLogger("placement")

# A thread is re-read by name for this long after it was first seen: pthread_setname_np
# (NCCL, torch's pt_data_pin) runs just after the thread starts, so a first look may see
# the inherited name.
SETTLE_S = 3.0
# A child process not (yet) named pt_data_worker is looked at again for this long: a worker
# started with the spawn method imports torch before it names itself.
CHILD_SETTLE_S = 30.0
# How long main keeps the stage-1 mask waiting for NCCL's threads before it is narrowed anyway.
MAIN_WAIT_S = 10.0
# Between full listings a settled rescan looks first (_look: the rank's thread count, its main
# thread's children and each one's thread count, 2 + children reads) and lists nothing when that
# is unchanged; the listing (a read of every thread's children file and a directory per child)
# cost the watcher ~250 us a second on the dev VM. A child forked by another thread, or a thread
# that replaced one that ended, waits for every LISTING_EVERY-th look (seconds at the watcher's pace).
LISTING_EVERY = 8


@dataclass
class ThreadRecord:
    """What the binder knows of one thread of the rank or of one of its child processes."""

    first_seen: float  # time.monotonic() when a rescan first listed it
    info: Optional[ThreadInfo] = None  # name and role at the last full rescan; None: listed, not read
    applied: Optional[frozenset[int]] = None  # the set this binder gave it
    kernel: Optional[frozenset[int]] = None  # Cpus_allowed_list the kernel reported after that
    nice: Optional[int] = None  # a DataLoader worker thread's nice as this binder last saw or set it


class RoleBinder:
    """Binds the threads of process `pid` (default: this one) to the CPU set of their role.

    The one owner of each role's current CPU set: the plan's at first, then whatever
    set_role_cpus (the tuner) moved it to."""

    def __init__(self, rank_plan: RankPlan, events, pid: Optional[int] = None, *, background_nice: int = 0):
        self.rank_plan = rank_plan
        self.events = events
        self.pid = os.getpid() if pid is None else pid
        self.background_nice = background_nice
        self._role_cpus: dict[ThreadRole, frozenset[int]] = {
            role: frozenset(a.cpus) for role, a in rank_plan.roles.items() if a.cpus}
        self._reasons: dict[ThreadRole, str] = {role: a.reason for role, a in rank_plan.roles.items()}
        self._records: dict[tuple[int, int], ThreadRecord] = {}  # by (pid, tid), in scan order
        # Workers inherit the rank's nice (the at-fork hook may raise it before we see them).
        self._own_nice = os.getpriority(os.PRIO_PROCESS, 0)
        self._nice_warned = False
        self._main_released = rank_plan.gpu is None
        self._main_deadline = time.monotonic() + MAIN_WAIT_S
        self._main_holds: dict[str, str] = {}  # what keeps main on the stage-1 mask for now -> why
        self._warned = False
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        self._watch_pace: Callable[[], float] = lambda: 1.0  # how many times interval_s the watcher waits now
        self._looked: Optional[tuple] = None  # the look taken before the last listing (_look)
        self._looks = 0

    # ---- public -----------------------------------------------------------
    def role_cpus(self, role: ThreadRole) -> frozenset[int]:
        """The CPU set threads of `role` are bound to now (empty: that role is left alone)."""
        return self._role_cpus.get(role, frozenset())

    def threads(self) -> list[ThreadInfo]:
        """The threads as of the last rescan (rescans first if none was done)."""
        with self._lock:
            if not self._scanned():
                self.rescan()
            return self._scanned()

    def record(self, pid: int, tid: int) -> Optional[ThreadRecord]:
        """What the binder knows of thread `tid` of process `pid` (None: not seen)."""
        with self._lock:
            return self._records.get((pid, tid))

    def current_threads(self) -> list[ThreadInfo]:
        """The threads after a rescan now: what the monitor's span refresh reads when its
        look says threads or children changed (monitor/probes/threads.py ThreadScan), so that a
        thread or DataLoader worker started since the watcher's last tick is sampled and
        counted as ours (the tuner's `foreign` excludes it) within monitor.rescan_every steps,
        not up to two watcher periods later; a step of a few ms makes those hundreds of steps."""
        self.rescan()
        with self._lock:
            return self._scanned()

    def rescan(self, force: bool = False) -> list[BindResult]:
        """Bind threads that are new, renamed or whose role set changed (force: whose role
        changed, as when the rank's main thread is another: placement.roles.set_main_thread).
        Never raises."""
        try:
            with self._lock:
                return self._rescan(force)
        except Exception as e:  # binding never raises into training code
            self._warn(f"rescan failed: {type(e).__name__}: {e}")
            return []

    def set_role_cpus(self, role: ThreadRole, cpus, reason: str) -> list[BindResult]:
        """Move `role` to `cpus` now (re-homes its live threads); later threads follow. Never raises."""
        try:
            with self._lock:
                self._role_cpus[role] = frozenset(cpus)
                self._reasons[role] = reason
                if role is ThreadRole.MAIN:
                    self._main_released = True
                return [r for r in self._rescan(force=True) if r.role is role]
        except Exception as e:
            self._warn(f"set_role_cpus({role}, {format_cpulist(cpus)}) failed: {type(e).__name__}: {e}")
            return []

    def hold_main(self, what: str, why: str) -> None:
        """Keep main on the stage-1 mask until release_main(what): a hold taken before main was
        first narrowed (stage 2 of placerun, before the program runs)."""
        with self._lock:
            self._main_holds[what] = why

    def release_main(self, what: str) -> list[BindResult]:
        """End a hold (hold_main); main is narrowed now if nothing else keeps it wide, its `bind`
        event saying what held it. Never raises."""
        try:
            with self._lock:
                why = self._main_holds.pop(what, None)
                if why is not None:
                    self._reasons[ThreadRole.MAIN] = f"{self._reasons.get(ThreadRole.MAIN, '')}; {why}"
                return [r for r in self._rescan(force=True) if r.role is ThreadRole.MAIN]
        except Exception as e:
            self._warn(f"release_main({what}) failed: {type(e).__name__}: {e}")
            return []

    def start_watcher(self, interval_s: float = 1.0) -> None:
        """Rescan every `interval_s` seconds on a daemon thread (and flush the event log)."""
        if self._watcher is not None and self._watcher.is_alive():
            return
        self._stop.clear()
        self._watcher = OWN_THREADS.start(self._watch, "placement_watch", (interval_s,))

    def pace_watch(self, pace: Callable[[], float]) -> None:
        """The watcher waits interval_s x pace() between rescans from now on (the monitor's
        budget: while it stretches its hand-overs, the watcher rescans half as often, and a
        thread started meanwhile is bound up to that much later)."""
        self._watch_pace = pace

    @property
    def watching(self) -> bool:
        """Whether the watcher thread rescans (so threads() stays current without a rescan call)."""
        return self._watcher is not None and self._watcher.is_alive()

    def stop_watcher(self) -> None:
        self._stop.set()
        w = self._watcher
        if w is not None and w is not threading.current_thread():
            w.join(timeout=5.0)
        self._watcher = None

    # ---- internals --------------------------------------------------------
    def _watch(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s * self._watch_pace()):
            self.rescan()
            if self.events is not None:
                self.events.flush()

    def _scanned(self) -> list[ThreadInfo]:
        return [r.info for r in self._records.values() if r.info is not None]

    def _keys(self) -> set[tuple[int, int]]:
        """(pid, tid) of this process's threads and its children's threads: directory listings only."""
        keys = {(self.pid, t) for t in _task_ids(self.pid)}
        try:
            kids = _procfs.children(self.pid)
        except (_procfs.ThreadGone, OSError, ValueError):
            kids = []
        for child in kids:
            keys.update((child, t) for t in _task_ids(child))
        return keys

    def _look(self) -> Optional[tuple]:
        """(thread count, the main thread's children, each child's thread count), None when
        unreadable: what a listing would show changed, cheaply (see LISTING_EVERY)."""
        try:
            kids = _procfs.task_children(self.pid, self.pid)
            return _procfs.stat(self.pid).num_threads, tuple((k, _procfs.stat(k).num_threads) for k in kids)
        except (_procfs.ThreadGone, OSError, ValueError):
            return None

    def _rescan(self, force: bool = False) -> list[BindResult]:
        now = time.monotonic()
        settled = not force and self._main_released and not self._main_holds
        if settled:
            look, self._looks = self._look(), self._looks + 1
            if (look is not None and look == self._looked and self._looks % LISTING_EVERY
                    and not any(self._young(k, now) for k in self._records)):
                return self._check_drift()
            self._looked = look
        else:
            self._looked = None  # the next settled rescan lists
        keys = self._keys()
        if settled and keys == set(self._records) and not any(self._young(k, now) for k in keys):
            return self._check_drift()
        # Rebuilt in scan order: the threads read now, then those listed but gone before the
        # read (kept, unread, until a listing no longer shows them); the rest have exited.
        old, self._records = self._records, {}
        for t in scan_threads(self.pid):
            key = (t.pid, t.tid)
            rec = old.pop(key, None) or ThreadRecord(first_seen=now)
            rec.info = t
            self._records[key] = rec
        for k in keys - set(self._records):
            rec = old.get(k) or ThreadRecord(first_seen=now)
            rec.info = None
            self._records[k] = rec
        if not self._main_released:
            self._release_main(now)
        results = self._check_drift()
        worker_nice = self.dataloader_nice()
        workers: dict[tuple, list[BindResult]] = {}  # a DataLoader worker's threads bound alike
        for t in self._scanned():
            worker = t.role is ThreadRole.DATALOADER
            if worker:
                self._set_nice(t, worker_nice)
            r = self._bind(t, log=not worker)
            if r is not None:
                results.append(r)
                if worker and r.ok:
                    workers.setdefault((r.pid, r.planned, r.applied), []).append(r)
                elif worker:
                    self._log(r, self._reasons.get(t.role, ""))
        for group in workers.values():
            self._log_worker(group)
        return results

    def _log_worker(self, group: list[BindResult]) -> None:
        """One `bind` event for the threads of one DataLoader worker bound alike (its first tid,
        `tids` and `threads`): workers respawn every epoch with ~10 threads each, and an event per
        thread was a quarter of a soak's log bytes (benchmarks/soak.py)."""
        if self.events is None:
            return
        first = group[0]
        self.events.event(EventKind.BIND, **first.to_dict(), reason=self._reasons.get(ThreadRole.DATALOADER, ""),
                          threads=len(group), tids=[r.tid for r in group])

    def _log(self, r: BindResult, reason: str, **extra) -> None:
        if self.events is not None:
            self.events.event(EventKind.BIND, **r.to_dict(), reason=reason, **extra)

    def _young(self, key: tuple[int, int], now: float) -> bool:
        rec = self._records[key]
        age = now - rec.first_seen
        if key[0] != self.pid and rec.info is None:
            return age < CHILD_SETTLE_S
        return age < SETTLE_S

    def _target(self, t: ThreadInfo) -> frozenset[int]:
        if t.role is ThreadRole.MAIN and (self._main_holds or not self._main_released):
            return frozenset()  # keeps stage 1's mask until NCCL has placed its threads, or while held
        cpus = self._role_cpus.get(t.role)
        if cpus is None and t.role is ThreadRole.BACKWARD:
            # A plan without a backward role (a CPU-only rank: torch starts pt_autograd_<n> only
            # for non-CPU devices) leaves such a thread with `other`.
            cpus = self._role_cpus.get(ThreadRole.OTHER)
        return cpus or frozenset()

    def _bind(self, t: ThreadInfo, log: bool = True) -> Optional[BindResult]:
        """Bind one thread to its role's set unless this binder already did; log the read-back
        (`log` False: the caller logs it)."""
        cpus = self._target(t)
        if not cpus or self._records[(t.pid, t.tid)].applied == cpus:
            return None
        return self._apply(t, cpus, self._reasons.get(t.role, ""), log=log)

    def _apply(self, t: ThreadInfo, cpus: frozenset[int], reason: str, log: bool = True, **extra) -> Optional[BindResult]:
        r = bind_thread(t.pid, t.tid, t.name, t.role, cpus)
        if r is None:  # exited meanwhile
            return None
        rec = self._records[(t.pid, t.tid)]
        rec.applied, rec.kernel = cpus, r.applied
        if log:
            self._log(r, reason, **extra)
        if not r.ok:
            self._warn(r.error or "")
        return r

    def _release_main(self, now: float) -> None:
        """Narrow main from now on: NCCL's hot threads exist, NCCL is not this rank's backend,
        or MAIN_WAIT_S passed without either (said once, in a `bind` event's reason)."""
        if self._nccl_started(self._scanned()):
            self._main_released = True
        elif now >= self._main_deadline:
            self._main_released = True
            self._reasons[ThreadRole.MAIN] = (
                f"{self._reasons.get(ThreadRole.MAIN, '')}; narrowed after waiting {MAIN_WAIT_S:g} s for "
                "NCCL's threads, none appeared (NCCL_SET_THREAD_NAME unset or 0, or no NCCL communicator yet)")

    def _check_drift(self) -> list[BindResult]:
        """Re-apply the set of every hot thread whose mask something else rewrote since this
        binder set it (NCCL's restore of its caller's saved mask, a user's taskset)."""
        results = []
        for rec in list(self._records.values()):
            t, want = rec.info, rec.applied
            if t is None or t.role not in HOT_ROLES or want is None:
                continue
            try:
                found = read_allowed(t.pid, t.tid)
            except (_procfs.ThreadGone, OSError, ValueError):  # ended since the scan: nothing to keep
                continue
            if found == rec.kernel:
                continue
            r = self._apply(t, want, f"drift: {t.role.value} thread {t.tid} ({t.name!r}) was moved to cpus "
                                     f"{format_cpulist(found)} by someone else (NCCL restores its caller's saved "
                                     f"mask at the end of communicator init); set back to {format_cpulist(want)}",
                            drift={"found": sorted(found), "set": sorted(want)})
            if r is not None:
                results.append(r)
        return results

    def dataloader_nice(self) -> int:
        """The nice value DataLoader workers get now: background_nice while their set shares a
        CPU with a hot role that has threads (main always has), so the hot thread preempts
        them; else 0 (their own), so they are not starved where they share only with foreign
        work, e.g. after the tuner moved them off a hot thread's core."""
        if self.background_nice <= 0:
            return 0
        live = {t.role for t in self._scanned()} | {ThreadRole.MAIN}
        hot = frozenset().union(*(self._role_cpus.get(r, frozenset()) for r in HOT_ROLES if r in live))
        return self.background_nice if self._role_cpus.get(ThreadRole.DATALOADER, frozenset()) & hot else 0

    def _set_nice(self, t: ThreadInfo, nice: int) -> None:
        """Raise a worker thread's nice to `nice`, or lower it back to the rank's own value
        (raising needs no privilege; lowering may need CAP_SYS_NICE: refused, it stays, once said)."""
        rec = self._records[(t.pid, t.tid)]
        try:
            now = rec.nice if rec.nice is not None else os.getpriority(os.PRIO_PROCESS, t.tid)
        except OSError:
            return  # exited, or not ours: nice is best effort
        want = max(self._own_nice, nice)
        if want != now:
            try:
                os.setpriority(os.PRIO_PROCESS, t.tid, want)
                now = want
            except PermissionError as e:
                if not self._nice_warned:
                    self._nice_warned = True
                    self._warn(f"cannot lower the nice value of DataLoader worker {t.tid} back to {want} "
                               f"({e.strerror}; needs CAP_SYS_NICE or RLIMIT_NICE): workers stay at nice {now}")
            except OSError:
                return
        rec.nice = now

    def _nccl_started(self, threads) -> bool:
        if any(t.role is ThreadRole.NCCL for t in threads):  # hot NCCL threads: init is under way
            return True
        if self.pid != os.getpid():
            return False
        dist = sys.modules.get("torch.distributed")
        try:
            return bool(dist is not None and dist.is_available() and dist.is_initialized()
                        and "nccl" not in str(dist.get_backend()).lower())
        except Exception:
            return False

    def _warn(self, message: str) -> None:
        if self.events is not None:
            self.events.event(EventKind.WARNING, message=message)
        if not self._warned:  # once on stderr; every one is in the event log
            self._warned = True
            log.warning("placement: %s", message)


def _task_ids(pid: int) -> list[int]:
    try:
        return _procfs.task_ids(pid)
    except (_procfs.ThreadGone, OSError):
        return []

