"""Per-role figures of one rank's threads, in the three sampling tiers of record.py.

`main` every step in full; `nccl` and `pin_memory` (the other hot roles) cpu/runqueue
every step; their remaining counters and all of `dataloader` and `other` at each cold
sample (every monitor.rescan_every steps), as per-step means over the span since the
previous one. Which threads exist, and their roles, comes from the binder's thread
list (or placement.roles.scan_threads without one), re-read at each cold sample.
"""
from __future__ import annotations

import os
from typing import Callable, Iterable, Optional

from placement.monitor.cpufreq import CoreFreq
from placement.monitor.probes import MainThreadProbe, ThreadCounters, ThreadGone, ThreadProbe
from placement.monitor.record import RoleSample
from placement.monitor.warn import WarnOnce, first_line
from placement.roles import ThreadInfo, ThreadRole

MAIN = ThreadRole.MAIN.value
EVERY_STEP_ROLES = (ThreadRole.NCCL.value, ThreadRole.PIN_MEMORY.value)
COLD_ROLES = (ThreadRole.DATALOADER.value, ThreadRole.OTHER.value)


def _delta(now: Optional[int], before: Optional[int]) -> Optional[int]:
    return None if now is None or before is None else now - before


def _ms(ns: Optional[int]) -> Optional[float]:
    return None if ns is None else ns / 1e6


def _sum(values: Iterable[Optional[int]]) -> Optional[int]:
    """Sum of the known values; None only when none is known."""
    total, known = 0, False
    for v in values:
        if v is not None:
            total += v
            known = True
    return total if known else None


def _per_step(total: Optional[float], span: int, digits: int = 3) -> Optional[float]:
    return None if total is None else round(total / span, digits)


class RoleSampler:
    def __init__(self, list_threads: Callable[[], list[ThreadInfo]], warn: WarnOnce,
                 root: str = "/", proc: str = "/proc"):
        self._list_threads = list_threads
        self._warn = warn
        self._proc = proc
        self.freq = CoreFreq(self._fail, root)
        self.main = MainThreadProbe(self._fail, proc)
        self._main_prev = self.main.counters()
        self._probes: dict[int, tuple[str, ThreadProbe]] = {}  # tid -> (role, probe)
        self._hot: dict[int, tuple[str, ThreadProbe]] = {}  # the EVERY_STEP_ROLES part of _probes
        self._hot_prev: dict[int, tuple[Optional[int], Optional[int]]] = {}  # tid -> (cpu_ns, runq_ns)
        self._cold_prev: dict[int, ThreadCounters] = {}
        self._last_cpus: dict[str, list[int]] = {}
        self._last_mhz: dict[str, Optional[float]] = {}
        self.refresh()

    def _fail(self, what: str, e: BaseException) -> None:
        self._warn(f"probe:{what}", f"monitor probe {what} failed ({first_line(e)}); that figure is null from now on")

    # ---- thread list -----------------------------------------------------------------
    def refresh(self) -> None:
        """Open probes for threads that appeared, close those of threads that left."""
        try:
            infos = self._list_threads()
        except Exception as e:  # a broken thread list leaves the old one in use
            self._fail("thread list", e)
            return
        me = os.getpid()
        seen: dict[int, str] = {}
        for t in infos:
            if t.pid == me and t.tid == me:
                continue  # main has its own probe
            seen[t.tid] = t.role.value if isinstance(t.role, ThreadRole) else str(t.role)
        for tid in list(self._probes):
            role, probe = self._probes[tid]
            if seen.get(tid) != role:
                self._drop(tid)
        for t in infos:
            role = seen.get(t.tid)
            if role is None or t.tid in self._probes:
                continue
            try:
                self._probes[t.tid] = (role, ThreadProbe(t.pid, t.tid, self._fail, self._proc))
            except ThreadGone:
                continue
            if role in EVERY_STEP_ROLES:
                self._hot[t.tid] = self._probes[t.tid]

    def _drop(self, tid: int) -> None:
        _, probe = self._probes.pop(tid)
        self._hot.pop(tid, None)
        probe.close()
        self._hot_prev.pop(tid, None)
        self._cold_prev.pop(tid, None)

    def threads_of(self, role: str) -> list[int]:
        return [tid for tid, (r, _) in self._probes.items() if r == role]

    # ---- every step ------------------------------------------------------------------
    def main_step(self) -> RoleSample:
        now = self.main.counters()
        prev, self._main_prev = self._main_prev, now
        cpu = now[4]
        return RoleSample(1, _ms(_delta(now[0], prev[0])), _ms(_delta(now[1], prev[1])),
                          _delta(now[3], prev[3]), None if cpu is None or prev[4] is None else int(cpu != prev[4]),
                          _delta(now[2], prev[2]), self.freq.mhz(cpu), [] if cpu is None else [cpu])

    def hot_step(self) -> dict[str, RoleSample]:
        """cpu/runqueue of the nccl and pin_memory threads over this step."""
        if not self._hot:
            return {}
        out: dict[str, RoleSample] = {}
        gone = []
        for tid, (role, probe) in self._hot.items():
            try:
                now = probe.schedstat()
            except ThreadGone:
                gone.append(tid)
                continue
            prev = self._hot_prev.get(tid)
            self._hot_prev[tid] = now
            s = out.get(role)
            if s is None:
                s = out[role] = RoleSample(threads=0, cpus=self._last_cpus.get(role, []),
                                           mhz=self._last_mhz.get(role))
            s.threads += 1
            if prev is not None:
                s.cpu_ms = _add_ms(s.cpu_ms, _delta(now[0], prev[0]))
                s.runq_ms = _add_ms(s.runq_ms, _delta(now[1], prev[1]))
        for tid in gone:
            self._drop(tid)
        return out

    # ---- every rescan_every steps ----------------------------------------------------
    def cold_sample(self, span_steps: int, hot: dict[str, RoleSample]) -> dict[str, RoleSample]:
        """Read every non-main thread in full; fold the span's per-step means into `hot`
        (this step's nccl/pin_memory samples) and return the dataloader/other samples."""
        span = max(1, span_steps)
        per_role: dict[str, list[tuple[ThreadCounters, Optional[ThreadCounters]]]] = {}
        gone = []
        for tid, (role, probe) in self._probes.items():
            try:
                now = probe.counters(schedstat=role not in EVERY_STEP_ROLES)
            except ThreadGone:
                gone.append(tid)
                continue
            per_role.setdefault(role, []).append((now, self._cold_prev.get(tid)))
            self._cold_prev[tid] = now
        for tid in gone:
            self._drop(tid)
        cold: dict[str, RoleSample] = {}
        for role, pairs in per_role.items():
            cpus = sorted({now.cpu for now, _ in pairs if now.cpu is not None})
            mhz_values = [m for m in (self.freq.mhz(c) for c in cpus) if m is not None]
            mhz = round(sum(mhz_values) / len(mhz_values), 1) if mhz_values else None
            self._last_cpus[role], self._last_mhz[role] = cpus, mhz
            paired = [(n, p) for n, p in pairs if p is not None]
            counts = dict(
                nivcsw=_per_step(_sum(_delta(n.nivcsw, p.nivcsw) for n, p in paired), span, 2),
                minflt=_per_step(_sum(_delta(n.minflt, p.minflt) for n, p in paired), span, 2),
                migrations=_per_step(_sum(None if n.cpu is None or p.cpu is None else int(n.cpu != p.cpu)
                                          for n, p in paired), span, 2),
            )
            if role in EVERY_STEP_ROLES:
                s = hot.get(role) or RoleSample(threads=len(pairs))
                hot[role] = s
            else:
                s = cold[role] = RoleSample(
                    threads=len(pairs),
                    cpu_ms=_per_step(_ms(_sum(_delta(n.cpu_ns, p.cpu_ns) for n, p in paired)), span),
                    runq_ms=_per_step(_ms(_sum(_delta(n.runq_ns, p.runq_ns) for n, p in paired)), span))
            s.nivcsw, s.minflt, s.migrations = counts["nivcsw"], counts["minflt"], counts["migrations"]
            s.cpus, s.mhz, s.span_steps = cpus, mhz, span
        return cold

    def close(self) -> None:
        for tid in list(self._probes):
            self._drop(tid)
        self.main.close()
        self.freq.close()


def _add_ms(total: Optional[float], ns: Optional[int]) -> Optional[float]:
    if ns is None:
        return total
    return (total or 0.0) + ns / 1e6
