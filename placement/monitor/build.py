"""Step records from the raw steps the hook measured, on the monitor thread (or whoever holds
the monitor's lock: an exit path).

What
    The hook keeps each step as a tuple (RawStep's fields: its end stamp, data wait and comm
    counters); at a hand-over they become RawSteps here and wait, pending, until their comm
    figures are settled (comm.settled_through: NCCL durations arrive after the step) or have
    waited comm.settle_max_s. build() then cuts the pending steps at a step with a reading of
    main's counters (a probe step: every step built has its counters), spreads each reading's
    counter deltas over its steps, works out each step's comm wait where calls block
    (records/parts.py), and keeps each step's figures as a tuple until its record's last step
    is built too. A record holds a group of steps (RecordBuilder.pace: one at long steps, the
    fewest dividing monitor.exchange_every that cover monitor.record_min_s at short ones,
    ending at an observer's window end too): its figures per-step means, each step's time kept
    (records/step.py). Each record is split into its parts, judged (records/verdict.py) and the
    batch handed to the delivery (sinks/). A hand-over due for a span reading (every
    thread read in full, the thread list refreshed) takes it here, at least `span_floor_s`
    apart; while an observer judges windows, a light one (the dataloader's and other's time)
    at each hand-over between.

Clocks
    Step boundaries are perf_counter_ns stamps; their wall time is derived when records are
    built, from an anchor pair re-taken then (one clock read per step on the training thread,
    not two), so that a drift between the two clocks cannot build up.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import time
from typing import Callable, Iterable, NamedTuple, Optional

from placement.monitor.clock import wall as wall_clock
from placement.monitor.comm.base import CommStep, CommTiming, comm_step
from placement.monitor.probes.counters import MainRead
from placement.monitor.probes.sampled import SampledReads
from placement.monitor.probes.threads import MAIN, HotRead, RoleSampler, merge_span
from placement.monitor.sinks.base import Delivery
from placement.records.parts import comm_wait_ms, split_step
from placement.records.step import SPAN_FIELDS, RoleSample, StepRecord, step_times
from placement.records.verdict import step_verdict
from placement.roles import OWN_THREADS


@dataclasses.dataclass(slots=True)
class RawStep:
    """One step as the hook measured it (its number is its place in the hand-over)."""

    end_ns: int  # perf_counter_ns at the end of the step
    data_ns: int  # time blocked waiting for data
    comm: CommStep  # (the hook keeps the clock's take_raw() tuple; raw_steps makes it this)
    main: Optional[MainRead] = None  # main's counters; None on the steps between readings
    hot: Optional[tuple[HotRead, ...]] = None  # the backward/nccl/pin_memory threads' counters (same steps)
    span: Optional[dict] = None  # every thread's span reading, set by the monitor thread


def raw_steps(kept: list[tuple]) -> list[RawStep]:
    """The steps as the hook kept them (tuples of RawStep's fields, each comm as the clock gave
    it: most often a shared CommStep already)."""
    # one pass: a step's comm made a CommStep as its RawStep is (the union of the intervals taken)
    return [RawStep(f[0], f[1], f[2] if f[2].__class__ is CommStep else comm_step(f[2]), *f[3:]) for f in kept]


@dataclasses.dataclass(frozen=True)
class RecordTags:
    """What every record of the rank carries beside its figures, and the tuner's thresholds its
    verdict is judged by (tune config: runq_wait_pct, comm_share_pct, data_share_pct)."""

    rank: int
    local_rank: int
    run: Callable[[], Optional[str]]  # the event log's run id, read as records are built
    verdict_pcts: tuple[float, float, float]


class Grouping(NamedTuple):
    """How steps are grouped into records (RecordBuilder.pace)."""

    every: int  # the exchange window's steps (monitor.exchange_every): a group's size divides it
    record_min_ms: float  # least time a record covers (monitor.record_min_s; 0: a record a step)
    window_due: Callable[[int], int]  # the first observer's window end after a step (hook.py window_due)


class RecordBuilder:
    """The pending steps of one rank, built into records and delivered."""

    def __init__(self, tags: RecordTags, sampler: RoleSampler, sampled: Optional[SampledReads], comm: CommTiming,
                 delivery: Delivery, on_built: Callable[[Iterable[float]], None], first_step: int,
                 span_floor_s: float, grouping: Grouping):
        self._tags = tags
        self._sampler = sampler
        self._sampled = sampled  # None: the hook read each step's counters itself (budget 0)
        self._comm = comm
        self._delivery = delivery
        self._on_built = on_built  # called with the built steps' times (the hang watch's median)
        self._pending: list[RawStep] = []  # raw steps handed over, not yet built into records
        self.first_pending = first_step  # step number of the first pending step
        # the last span step; the last full span's step and end (ns); the floor between full spans (ns)
        self._span = (first_step - 1, first_step - 1, -math.inf, span_floor_s * 1e9)
        self.last_end_ns = 0  # perf_counter_ns at the end of the last step built
        self._clock = (0, 0.0, 0.0)  # the anchor pair, and the wall time of the last built step's end
        self._own_ns = 0  # placement's threads' CPU (OWN_THREADS) at the last build
        # Steps built, as tuples (see build), whose record's group has steps still to come
        self._open: list[tuple] = []
        self._every, self._record_min_ms, self._window_due = grouping
        self._group = 1  # steps a record holds (pace())
        self.built_through = first_step - 1  # the last step in a record delivered
        self.start()

    def start(self) -> int:
        """Step 1 (of this builder) begins now: the anchor, re-taken; returns it (perf_counter_ns)."""
        anchor_ns, anchor_wall = time.perf_counter_ns(), wall_clock()
        self._clock = (anchor_ns, anchor_wall, anchor_wall)
        self.last_end_ns = anchor_ns
        self._own_ns = OWN_THREADS.cpu_ns()
        return anchor_ns

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def add(self, step: int, kept: list[tuple], span_due: bool, windowed: bool) -> list[RawStep]:
        """A hand-over's steps (through `step`), pending from now; `span_due`: a span reading is
        due at `step`, taken unless the last full one is less than the floor ago. While an
        observer judges windows (`windowed`: its rules read the dataloader's and other's time
        per window) a light span is taken at each hand-over between the full ones: those roles'
        schedstat only, no thread list (probes/threads.py read_span)."""
        raw = raw_steps(kept)
        last_span, last_full, full_ns, floor_ns = self._span
        full = raw[-1].end_ns - full_ns >= floor_ns
        if span_due and (windowed or full):
            raw[-1].span = self._sampler.read_span(step - last_span, step - last_full if full else None)
            if full:
                self._span = (step, step, raw[-1].end_ns, floor_ns)
                self._sampler.refresh()
            else:
                self._span = (step, last_full, full_ns, floor_ns)
        self._pending.extend(raw)
        return raw

    def add_at_exit(self, kept: list[tuple]) -> None:
        """At exit: the steps the hook has not handed over, pending too; the last read now if it
        has no reading (the reading includes the moments since the last step ended); all built."""
        pending = self._pending
        pending.extend(raw_steps(kept))
        if self._sampled is not None:
            self._sampled.attach(pending, self.first_pending)
        if pending and pending[-1].main is None:
            sampler = self._sampler
            pending[-1].main, pending[-1].hot = sampler.main.step_read(), sampler.read_hot()
        self.build(final=True)

    def build(self, final: bool) -> None:
        """Build, write and deliver the records of the pending steps whose comm figures are
        settled (comm.settled_through: NCCL durations arrive after the step, when the source
        has seen them), or that waited comm.settle_max_s for them (their comm time is then
        null, and counted); with `final` (exit), every step. The cut is made at a step with a
        reading of the counters (a probe step) so that every step built has its counters."""
        comm = self._comm
        comm.poll_if_due(final)
        raw = self._pending
        if not raw:
            if final and self._open:  # the last group's steps, built before, whole or not
                self._deliver(self._records(final))
            return
        if self._sampled is not None:
            self._sampled.attach(raw, self.first_pending)
        anchor_ns, anchor_wall, wall_last = self._clock
        cut = len(raw)
        if not final:
            through = max(comm.settled_through(), wall_clock() - comm.settle_max_s)
            if through != math.inf:
                through_ns = anchor_ns + int((through - anchor_wall) * 1e9)
                cut = bisect.bisect_right([r.end_ns for r in raw], through_ns)
            while cut > 0 and raw[cut - 1].main is None:
                cut -= 1
        if cut <= 0:
            return
        ready, self._pending = raw[:cut], raw[cut:]
        first_step = self.first_pending
        self.first_pending += cut
        ends = [anchor_wall + (r.end_ns - anchor_ns) / 1e9 for r in ready]
        starts = [wall_last] + ends[:-1]
        pending = [i for i, r in enumerate(ready) if r.comm.comm_ms is None]
        late_comm = dict(zip(pending, comm.resolve_steps([(starts[i], ends[i]) for i in pending],
                                                         [ready[i].comm for i in pending]))) if pending else {}
        roles_of, probe_steps = self._role_samples(ready)
        # placement's threads' CPU since the last build, spread over this batch's steps: the
        # monitor thread processed the last hand-over while these steps ran
        own_ns, self._own_ns = self._own_ns, OWN_THREADS.cpu_ns()
        own_ms = max(0, self._own_ns - own_ns) / 1e6 / cut
        # Calls that block (gloo) leave main off-CPU while it waits: its schedstat tells the
        # wait from the time in flight (records/parts.py). NCCL's return at enqueue: the
        # GPU-side time is all there is.
        comms = [late_comm.get(i, r.comm) for i, r in enumerate(ready)] if late_comm else [r.comm for r in ready]
        waits = self._comm_waits(ready, comms, roles_of, probe_steps) if comm.timed_calls else None
        # Each step's figures, as a tuple (a step waits here, in `_open`, until its record's
        # last step is built too): the records are made per group (_records).
        steps = self._open
        append = steps.append
        t_last = self.last_end_ns
        for i, r in enumerate(ready):
            c_step = comms[i]
            end_ns = r.end_ns
            roles = roles_of[i]
            if r.span is not None:  # its own copy: the other steps of its reading share theirs
                roles = {name: dataclasses.replace(s) for name, s in roles.items()}
                merge_span(roles, r.span)
            inflight = c_step.comm_ms
            append((first_step + i, ends[i], (end_ns - t_last) / 1e6, r.data_ns / 1e6,
                    inflight if waits is None else waits[i], inflight, c_step.count, c_step.enter_t, roles,
                    probe_steps[i], own_ms))
            t_last = end_ns
        self.last_end_ns = t_last
        self._clock = (time.perf_counter_ns(), wall_clock(), ends[-1])
        self._deliver(self._records(final))

    def _deliver(self, batch: list[StepRecord]) -> None:
        if batch:
            self._on_built(t for rec in batch for t in step_times(rec))
            self._delivery.write(batch)

    def pace(self, step_ms: Optional[float], scale: int = 1) -> None:
        """The steps a record holds from its next group on (`step_ms`: the median step time
        handed over): the fewest, a divisor of the exchange window's steps, that cover
        record_min_s x `scale` (the paced floor's, which the budget stretches: PacedFloor) (each
        record costs the monitor thread the same Python whatever it holds: the build, its line,
        the tuner's and the exchange's figures and the digest)."""
        if not step_ms or step_ms <= 0:
            return
        every, need = self._every, self._record_min_ms * scale / step_ms
        self._group = next((d for d in range(1, every + 1) if every % d == 0 and d >= need), every)

    @property
    def group(self) -> int:
        """The steps a record holds now (at most: a record ends at an observer's window end too)."""
        return self._group

    def _records(self, final: bool) -> list[StepRecord]:
        """The records of the whole groups among the built steps (with `final`, the last part
        of one too). A group ends at a multiple of `group` (so never across an exchange window:
        group divides exchange_every) or at an observer's window end, whichever comes first."""
        steps, g, window_due = self._open, self._group, self._window_due
        tags = self._tags
        runq_pct, comm_pct, data_pct = tags.verdict_pcts
        rank, local_rank, run = tags.rank, tags.local_rank, tags.run()
        batch = []
        i, n = 0, len(steps)
        while i < n:
            first = steps[i][0]
            # (an observer's window end is after first - 1; max() keeps a wrong one from stalling this)
            last = max(first, min(first + (g - 1 - (first - 1) % g), window_due(first - 1)))
            j = i + (last - first) + 1
            if j > n:
                if not final:
                    break
                j = n
            batch.append(_record(steps[i:j], rank, local_rank, run, runq_pct, comm_pct, data_pct) if j - i > 1
                         else _one(steps[i], rank, local_rank, run, runq_pct, comm_pct, data_pct))
            i = j
        del steps[:i]
        if batch:
            self.built_through = batch[-1].step
        return batch

    def _comm_waits(self, ready: list[RawStep], comms: list[CommStep], roles_of: list[dict],
                    probe_steps: list[int]) -> list[Optional[float]]:
        """Each step's comm wait where calls block (gloo): main is off-CPU while it waits, and its
        schedstat tells the wait from the time in flight, a reading of its counters at a time
        (records/parts.py comm_wait_ms; the steps of one reading are the probe_steps before its
        probe step). NCCL's calls return at enqueue: there the GPU-side time is all there is."""
        waits: list[Optional[float]] = []
        t_last, i = self.last_end_ns, 0
        ends = [r.end_ns for r in ready]
        while i < len(ready):
            n = max(1, probe_steps[i])
            main = roles_of[i].get(MAIN) if probe_steps[i] else None
            step_ms = [(e - s) / 1e6 for s, e in zip([t_last] + ends[i:i + n - 1], ends[i:i + n])]
            waits.extend(comm_wait_ms(step_ms, [r.data_ns / 1e6 for r in ready[i:i + n]],
                                      [c.comm_ms for c in comms[i:i + n]],
                                      None if main is None else main.cpu_ms, None if main is None else main.runq_ms))
            t_last, i = ends[i + n - 1], i + n
        return waits

    def _role_samples(self, ready: list[RawStep]) -> tuple[list[dict], list[int]]:
        """Per-step role samples: a probe step's counter deltas are spread evenly over it and
        the steps since the probe step before it, which share its samples (records are not
        changed once built; a step with a span reading, which need not be a probe step, gets
        its own copy in build). Steps after the last probe step, only at exit, have none."""
        roles_of: list[dict] = []
        probe_steps: list[int] = []
        run = 0  # steps waiting for the next probe step
        sampler = self._sampler
        for r in ready:
            run += 1
            if r.main is None:
                continue
            roles_of.extend([sampler.samples(r.main, r.hot, run)] * run)
            probe_steps.extend([run] * run)
            run = 0
        for _ in range(run):
            roles_of.append(sampler.unread())
            probe_steps.append(0)
        return roles_of, probe_steps


# ---- a group of built steps into its record ---------------------------------------------
# A built step, as build() keeps it: (step, t, step_ms, data_ms, comm wait, comm in flight,
# collectives, comm_enter_t, roles, probe_steps, placement_cpu_ms).

def _one(e: tuple, rank: int, local_rank: int, run: Optional[str], runq_pct: float, comm_pct: float,
         data_pct: float) -> StepRecord:
    """The record of one step."""
    step, t, step_ms, data_ms, c, inflight, count, enter_t, roles, probe_steps, own_ms = e
    main = roles.get(MAIN)
    # split once here and kept on the record: the digest, summary and metrics read them too
    parts = split_step(step_ms, data_ms, c, None if main is None else main.runq_ms)
    return StepRecord(rank, step, t, step_ms, data_ms, c, count, roles,
                      step_verdict(step_ms, data_ms, c, parts.cpu_stall_ms, runq_pct, comm_pct, data_pct),
                      local_rank, enter_t, probe_steps, run, inflight, own_ms, parts=parts)


def _mean_known(values: tuple) -> Optional[float]:
    """The mean, None when any is None (a part not measured at one step is not measured)."""
    return None if None in values else sum(values) / len(values)


def _record(group: list[tuple], rank: int, local_rank: int, run: Optional[str], runq_pct: float, comm_pct: float,
            data_pct: float) -> StepRecord:
    """The record of several steps: per-step means, each step's time kept (records/step.py)."""
    n = len(group)
    # the group's columns, in one transposition (a list a field was a fifth of a record's build)
    _, _, each, data, waits, inflights, counts, _, roles_of, probes, own = zip(*group)
    step_ms = sum(each) / n
    data_ms = sum(data) / n
    c, inflight = _mean_known(waits), _mean_known(inflights)
    last = group[-1]
    roles = last[8]
    if any(r is not roles for r in roles_of):
        roles = _merge_roles(group)
    main = roles.get(MAIN)
    parts = split_step(step_ms, data_ms, c, None if main is None else main.runq_ms)
    return StepRecord(rank, last[0], last[1], step_ms, data_ms, c, sum(counts), roles,
                      step_verdict(step_ms, data_ms, c, parts.cpu_stall_ms, runq_pct, comm_pct, data_pct),
                      local_rank, last[7], max(probes), run, inflight, _mean_known(own),
                      n, each, tuple([w if k else None for w, k in zip(waits, counts)]), parts=parts)


def _merge_roles(group: list[tuple]) -> dict:
    """The roles of steps of several readings, as per-step means over the group: each role's
    cpu_ms and runq_ms weighted by the steps that carry it (a role read at a span alone, as
    the DataLoader's is, keeps that reading's per-step means), the span counters, threads and
    CPUs the last said."""
    shared: list[list] = []  # [roles, steps], in order
    for e in group:
        if shared and shared[-1][0] is e[8]:
            shared[-1][1] += 1
        else:
            shared.append([e[8], 1])
    out = {}
    names = list(dict.fromkeys(name for roles, _ in shared for name in roles))
    for name in names:
        samples = [(roles[name], k) for roles, k in shared if name in roles]
        steps = sum(k for _, k in samples)
        cpu = [s.cpu_ms for s, _ in samples]
        runq = [s.runq_ms for s, _ in samples]
        last = samples[-1][0]
        merged = RoleSample(last.threads, None if None in cpu else sum(v * k for v, (_, k) in zip(cpu, samples)) / steps,
                            None if None in runq else sum(v * k for v, (_, k) in zip(runq, samples)) / steps,
                            cpus=list(last.cpus), span_steps=max(s.span_steps for s, _ in samples))
        for field in SPAN_FIELDS:
            said = [getattr(s, field) for s, _ in samples if getattr(s, field) is not None]
            if said:
                setattr(merged, field, said[-1])
        out[name] = merged
    return out
