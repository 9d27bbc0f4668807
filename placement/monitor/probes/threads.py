"""Per-role figures of one rank's threads, in the sampling tiers of records/step.py.

What
    - every probe step (every step unless the monitor's budget says otherwise, see budget.py):
      the on-CPU time and runqueue wait of `main`, `backward` (torch's pt_autograd_<device>,
      which runs the GPU backward work), `nccl` and `pin_memory` threads, read by the monitor
      thread (sampled.py), or by the step hook with budget_pct = 0. The deltas and RoleSamples
      are made on the monitor thread (`samples`).
    - every span (monitor.rescan_every steps or more: step_monitor.py SPAN_FLOORS; on the
      monitor thread): everything else, as
      per-step means over the span: the hot roles' faults, involuntary switches, migrations,
      CPUs and MHz; all figures of `dataloader` and `other`. While a tuner judges windows, a
      light span at each window between: `dataloader`'s and `other`'s on-CPU and runqueue
      time alone (their schedstat), what its rules read per window.
    Which threads exist, and their roles, is looked at every span (ThreadScan): the binder's
    rescan (Binder.current_threads), or scan_threads without a binder, whenever a cheap look
    says the threads or children changed.

Why the lock
    Two threads use a sampler: `main.step_read` and `read_hot` are called by the monitor thread
    or the training thread (the hook with budget_pct = 0; an exit path), everything else by
    whoever holds the monitor's lock. The hot probes' table is swapped and their file
    descriptors closed under `_hot_lock`, which read_hot holds while it reads, so a read
    never lands on a descriptor the kernel has already given to another file.

Cost
    A probe step's reads may be on the training thread, so they are kept to raw reads;
    everything else is done on the monitor thread.
"""
from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from placement import _procfs
from placement.monitor.probes.cpufreq import CoreFreq
from placement.monitor.probes.counters import MainRead, MainThreadProbe, ThreadCounters, ThreadGone, ThreadProbe
from placement.records.step import RoleSample
from placement.monitor.warn import WarnOnce, first_line
from placement.roles import ThreadInfo, ThreadRole, scan_threads

MAIN = ThreadRole.MAIN
EVERY_STEP_ROLES = (ThreadRole.BACKWARD, ThreadRole.NCCL, ThreadRole.PIN_MEMORY)


@dataclass(slots=True)
class HotRead:
    """One every-step thread's counters at one probe step (read_hot, on the training thread)."""

    tid: int
    role: ThreadRole
    cpu_ns: Optional[int]
    runq_ns: Optional[int]


@dataclass(frozen=True, slots=True)
class _HotProbe:
    tid: int
    role: ThreadRole
    probe: ThreadProbe


def _delta(now: Optional[int], before: Optional[int]) -> Optional[int]:
    return None if now is None or before is None else now - before


def _sum(values: Iterable[Optional[int]]) -> Optional[int]:
    """Sum of the known values; None only when none is known."""
    total, known = 0, False
    for v in values:
        if v is not None:
            total += v
            known = True
    return total if known else None


def _per_step(total: Optional[float], span: int, scale: float = 1.0) -> Optional[float]:
    return None if total is None else round(total * scale / span, 3)


def _times_ms(pairs: list[tuple[tuple, Optional[tuple]]], span: int) -> tuple[Optional[float], Optional[float]]:
    """Per-step on-CPU and runqueue ms of a role's threads from (now, before) schedstat pairs
    ((on-CPU ns, runqueue ns) each; before None for a thread first read now)."""
    paired = [(n, p) for n, p in pairs if p is not None]
    return (_per_step(_sum(_delta(n[0], p[0]) for n, p in paired), span, 1e-6),
            _per_step(_sum(_delta(n[1], p[1]) for n, p in paired), span, 1e-6))


class RoleSampler:
    def __init__(self, list_threads: Callable[[], list[ThreadInfo]], warn: WarnOnce,
                 root: str = "/", proc: str = "/proc"):
        self._list_threads = list_threads
        self._warn = warn
        self._proc = proc
        self.freq = CoreFreq(self._fail, root)
        self.main = MainThreadProbe(self._fail, proc)
        self.rebase()
        self._last_cpus: dict[ThreadRole, list[int]] = {}
        if self._main_span_prev[2] is not None:
            self._last_cpus[MAIN] = [self._main_span_prev[2]]
        self._probes: dict[int, tuple[ThreadRole, ThreadProbe]] = {}  # tid -> (role, probe)
        self._hot: tuple[_HotProbe, ...] = ()  # the EVERY_STEP_ROLES probes
        self.has_hot = False  # whether _hot holds any (an attribute: read on every probe step)
        self._hot_lock = threading.Lock()
        self._gone: set[int] = set()  # hot threads read_hot found gone; dropped at the next refresh
        self._hot_prev: dict[int, HotRead] = {}  # tid -> its last read
        self._span_prev: dict[int, tuple] = {}  # tid -> (on-CPU ns, runqueue ns) at the last span (dataloader, other)
        self._full_prev: dict[int, ThreadCounters] = {}  # tid -> its counters at the last full span
        self._last_mhz: dict[ThreadRole, Optional[float]] = {}
        self.refresh()

    def rebase(self) -> None:
        """Main's counters start again from now (at creation, and as attach() returns: the
        first step's figures cover training only, not attach()'s own set-up)."""
        self._main_prev: MainRead = self.main.step_read()
        self._main_prev.parse(self._fail)
        self._main_span_prev = self.main.span_read()

    def _fail(self, what: str, e: BaseException) -> None:
        if what == "cpufreq" and isinstance(e, FileNotFoundError):  # VMs and some kernels have no cpufreq
            self._warn("probe:cpufreq", f"no cpufreq on this machine ({e.filename} is missing): MHz figures are null")
            return
        self._warn(f"probe:{what}", f"monitor probe {what}: {first_line(e)}; its figures are null while it fails")

    # ---- thread list -----------------------------------------------------------------
    def refresh(self) -> None:
        """Open probes for threads that appeared, close those of threads that left."""
        try:
            infos = self._list_threads()
        except Exception as e:  # a broken thread list leaves the old one in use
            self._fail("thread list", e)
            return
        me, main = os.getpid(), self.main.tid
        gone = set(self._gone)
        self._gone -= gone  # each set operation is atomic: a tid read_hot adds meanwhile stays
        seen: dict[int, ThreadRole] = {}
        for t in infos:
            if not (t.pid == me and t.tid == main) and t.tid not in gone:  # main has its own probe
                seen[t.tid] = ThreadRole(t.role)
        for tid in [tid for tid, (role, _) in self._probes.items() if seen.get(tid) != role]:
            self._drop(tid)
        for t in infos:
            role = seen.get(t.tid)
            if role is None or t.tid in self._probes:
                continue
            try:
                self._probes[t.tid] = (role, ThreadProbe(t.pid, t.tid, self._fail, self._proc))
            except ThreadGone:
                continue
        hot = tuple(_HotProbe(tid, role, probe) for tid, (role, probe) in self._probes.items()
                    if role in EVERY_STEP_ROLES)
        with self._hot_lock:
            self._hot = hot
            self.has_hot = bool(hot)

    def _drop(self, tid: int) -> None:
        _, probe = self._probes.pop(tid)
        with self._hot_lock:
            self._hot = tuple(h for h in self._hot if h.tid != tid)
            self.has_hot = bool(self._hot)
            probe.close()
        self._hot_prev.pop(tid, None)
        self._span_prev.pop(tid, None)
        self._full_prev.pop(tid, None)

    # ---- probe steps, on the training thread: raw reads only ------------------------
    def read_hot(self) -> tuple[HotRead, ...]:
        out = []
        with self._hot_lock:
            for h in self._hot:
                try:
                    cpu_ns, runq_ns = h.probe.schedstat()
                except ThreadGone:
                    self._gone.add(h.tid)
                    continue
                out.append(HotRead(h.tid, h.role, cpu_ns, runq_ns))
        return tuple(out)

    # ---- on the monitor thread: raw reads -> per-step RoleSamples ---------------------
    def samples(self, main: MainRead, hot: Iterable[HotRead], steps: int = 1) -> dict[ThreadRole, RoleSample]:
        """Per-step samples from one probe step's raw reads, the counters' deltas since the
        probe step before spread over the `steps` steps between; called in step order."""
        main.parse(self._fail)
        prev, self._main_prev = self._main_prev, main
        scale = 1e6 * steps
        roles = {MAIN: RoleSample(
            threads=1, cpu_ms=None if main.cpu_ns is None or prev.cpu_ns is None else (main.cpu_ns - prev.cpu_ns) / scale,
            runq_ms=None if main.runq_ns is None or prev.runq_ns is None else (main.runq_ns - prev.runq_ns) / scale,
            mhz=self._last_mhz.get(MAIN), cpus=self._last_cpus.get(MAIN, []))}
        for h in hot:
            before = self._hot_prev.get(h.tid)
            self._hot_prev[h.tid] = h
            role = h.role
            s = roles.get(role)
            if s is None:
                s = roles[role] = RoleSample(threads=0, cpus=self._last_cpus.get(role, []), mhz=self._last_mhz.get(role))
            s.threads += 1
            if before is not None:
                s.cpu_ms = _add_ms(s.cpu_ms, _delta(h.cpu_ns, before.cpu_ns), steps)
                s.runq_ms = _add_ms(s.runq_ms, _delta(h.runq_ns, before.runq_ns), steps)
        return roles

    def unread(self) -> dict[ThreadRole, RoleSample]:
        """Samples of a step whose counters were not read (measured after the last probe
        step, at exit): main's CPUs as last seen, no figures."""
        return {MAIN: RoleSample(threads=1, mhz=self._last_mhz.get(MAIN), cpus=self._last_cpus.get(MAIN, []))}

    # ---- every span ------------------------------------------------------------------
    def read_span(self, span_steps: int, full_steps: Optional[int]) -> dict[ThreadRole, RoleSample]:
        """Read the rank's threads: per-step means. A full span (`full_steps`: the steps since
        the last full one) reads every thread in full; for main and the every-step roles only
        the span figures are set (merge them with `merge_span`), dataloader and other get whole
        samples: their on-CPU and runqueue time over the last `span_steps` steps (since the last
        span of either kind), every other figure over `full_steps`. A light span (None) reads
        only the dataloader's and other's schedstat: a tuner's window takes one between full
        spans (build.py), as its rules read those roles' time per window; the faults, switches,
        CPUs and migrations (the stat and status files, most of the reads' cost) wait for the
        next full span."""
        span = max(1, span_steps)
        if full_steps is None:
            return self._light_span(span)
        per_full = max(1, full_steps)
        now = self.main.span_read()
        minflt, nivcsw, cpu = now
        p_minflt, p_nivcsw, p_cpu = self._main_span_prev
        self._main_span_prev = now
        self._last_cpus[MAIN] = [] if cpu is None else [cpu]
        self._last_mhz[MAIN] = self.freq.mhz(cpu)
        out = {MAIN: RoleSample(threads=1, minflt=_per_step(_delta(minflt, p_minflt), per_full),
                                nivcsw=_per_step(_delta(nivcsw, p_nivcsw), per_full),
                                migrations=None if cpu is None or p_cpu is None else _per_step(int(cpu != p_cpu), per_full),
                                mhz=self._last_mhz[MAIN], cpus=self._last_cpus[MAIN], span_steps=span)}
        per_role: dict[ThreadRole, list[tuple[ThreadCounters, Optional[ThreadCounters]]]] = {}
        timed: dict[ThreadRole, list[tuple[tuple, Optional[tuple]]]] = {}
        gone = []
        for tid, (role, probe) in self._probes.items():
            try:
                now = probe.counters(schedstat=role not in EVERY_STEP_ROLES)
            except ThreadGone:
                gone.append(tid)
                continue
            per_role.setdefault(role, []).append((now, self._full_prev.get(tid)))
            self._full_prev[tid] = now
            if role not in EVERY_STEP_ROLES:
                times = (now.cpu_ns, now.runq_ns)
                timed.setdefault(role, []).append((times, self._span_prev.get(tid)))
                self._span_prev[tid] = times
        for tid in gone:
            self._drop(tid)
        for role, pairs in per_role.items():
            cpus = sorted({now.cpu for now, _ in pairs if now.cpu is not None})
            known = [m for m in (self.freq.mhz(c) for c in cpus) if m is not None]
            mhz = round(sum(known) / len(known), 1) if known else None
            self._last_cpus[role], self._last_mhz[role] = cpus, mhz
            paired = [(n, p) for n, p in pairs if p is not None]
            s = out[role] = RoleSample(
                threads=len(pairs),
                nivcsw=_per_step(_sum(_delta(n.nivcsw, p.nivcsw) for n, p in paired), per_full),
                minflt=_per_step(_sum(_delta(n.minflt, p.minflt) for n, p in paired), per_full),
                migrations=_per_step(_sum(None if n.cpu is None or p.cpu is None else int(n.cpu != p.cpu)
                                          for n, p in paired), per_full),
                mhz=mhz, cpus=cpus, span_steps=span)
            if role in timed:
                s.cpu_ms, s.runq_ms = _times_ms(timed[role], span)
        return out

    def _light_span(self, span: int) -> dict[ThreadRole, RoleSample]:
        """The dataloader's and other's on-CPU and runqueue time over the last `span` steps: one
        schedstat read a thread; their CPUs and MHz as the last full span saw them."""
        timed: dict[ThreadRole, list[tuple[tuple, Optional[tuple]]]] = {}
        gone = []
        for tid, (role, probe) in self._probes.items():
            if role in EVERY_STEP_ROLES:
                continue
            try:
                times = probe.schedstat()
            except ThreadGone:
                gone.append(tid)
                continue
            timed.setdefault(role, []).append((times, self._span_prev.get(tid)))
            self._span_prev[tid] = times
        for tid in gone:
            self._drop(tid)
        out = {}
        for role, pairs in timed.items():
            cpu_ms, runq_ms = _times_ms(pairs, span)
            out[role] = RoleSample(threads=len(pairs), cpu_ms=cpu_ms, runq_ms=runq_ms, mhz=self._last_mhz.get(role),
                                   cpus=self._last_cpus.get(role, []), span_steps=span)
        return out

    def close(self) -> None:
        for tid in list(self._probes):
            self._drop(tid)
        self.main.close()
        self.freq.close()
        close_list = getattr(self._list_threads, "close", None)
        if close_list is not None:
            close_list()


def merge_span(step_roles: dict[ThreadRole, RoleSample], span: dict[ThreadRole, RoleSample]) -> None:
    """Fold a span reading into the samples of the step it was taken at."""
    for role, s in span.items():
        mine = step_roles.get(role)
        if mine is None or role not in (MAIN, *EVERY_STEP_ROLES):
            step_roles[role] = s
            continue
        mine.nivcsw, mine.minflt, mine.mhz, mine.span_steps = s.nivcsw, s.minflt, s.mhz, s.span_steps
        mine.migrations, mine.cpus = s.migrations, s.cpus


def _add_ms(total: Optional[float], ns: Optional[int], steps: int) -> Optional[float]:
    if ns is None:
        return total
    return (total or 0.0) + ns / 1e6 / steps


class ThreadScan:
    """The rank's thread list from `full()` (the binder's rescan, Binder.current_threads;
    placement.roles.scan_threads for a rank without a binder), redone only when the thread
    count (field 20 of /proc/self/stat) or the main thread's children changed at this look or
    the one before (a new thread names itself just after it starts, so one more look reads the
    final name), and at every FULL_EVERY-th look (a thread that replaced another keeps the
    count; a child forked by another thread is not in the main thread's children). A look is
    two preads on kept fds; a full scan reads a file per thread (0.7 ms for 100 threads)."""

    FULL_EVERY = 8

    def __init__(self, full: Optional[Callable[[], list[ThreadInfo]]] = None, proc: str = "/proc"):
        self._pid = os.getpid()
        self._full = full if full is not None else functools.partial(scan_threads, self._pid, proc=proc)
        self._fds = {}
        for name, path in (("stat", f"{proc}/{self._pid}/stat"), ("children", f"{proc}/{self._pid}/task/{self._pid}/children")):
            try:
                self._fds[name] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
        self._key: Optional[tuple] = None
        self._settled = False
        self._looks = 0
        self._threads: list[ThreadInfo] = []

    def _look(self) -> tuple:
        """(thread count, the main thread's children file), each None when unreadable."""
        threads = children = None
        fd = self._fds.get("stat")
        if fd is not None:
            try:
                threads = _procfs.stat_at(fd, self._pid).num_threads
            except (OSError, ValueError, _procfs.ThreadGone):
                pass
        fd = self._fds.get("children")
        if fd is not None:
            try:
                children = _procfs.pread_bounded(fd, _procfs.CHILDREN_MAX, self._pid)
            except (OSError, _procfs.ThreadGone):
                pass
        return threads, children

    def __call__(self) -> list[ThreadInfo]:
        key = self._look()
        self._looks += 1
        if key == self._key and self._settled and self._looks % self.FULL_EVERY:
            return self._threads
        self._settled = key == self._key
        self._key = key
        self._threads = self._full()
        return self._threads

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
