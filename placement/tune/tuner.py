"""The per-rank self-tuner: windows of StepRecords -> rules -> one judged action at a time.

    Tuner(binder, cfg, events, next_step=...).observe(record)  # never raises
    Tuner.close()

The binder owns each role's current CPU set (RoleBinder.role_cpus) and its plan (the share's
cores and their perf_rank, RankPlan.cores): the tuner reads both, proposes moves, and has the
binder apply and record them; it keeps no copy of where a role is.

Windows are cut by step number, not by counting arrivals: records reach the tuner in
batches at the monitor's flush steps, held back by the comm timing's lag (NCCL durations
are known `lag_steps` later), so when a window closes training is already further on.
A window is the steps [start, end]: cfg.window steps, or at short steps a longer window on a
grid paced in time (paced_window: cfg.window x the fewest power of two k that lasts
cfg.window_min_s at the last window's median step, the windows ending at multiples of
k x cfg.window, the first after a change at least cfg.window steps long), so that its
judgement and the counter reading at its end cost the same share of a short step as of a long
one; a record of an earlier step is not part of any window. The monitor hands a window over
as soon as its comm timing is final (window_end), not only at flush steps. An action is
applied while training runs: it carries the first step it was in force for the whole step
(`next_step()` when it was applied), the next window starts there, and the records of the
steps measured before it (still arriving) are dropped. The action is judged on that first whole window after it, against the
quiet baseline (judge.py), then `cfg.cooldown_windows` windows pass before the next.
Otherwise the rules are asked in priority order and the first proposed move is applied
by binder.set_role_cpus: at most one action in flight, never outside the rank's
share. Windows where no rule sees anything are quiet: they feed the baseline and the
noise band. With cfg.dry_run the would-be actions are logged only. The tuner's states
are one enum (TunerState), as the elastic agent's WorkerState is.
"""
from __future__ import annotations

import bisect
import enum
import logging
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable, Optional, Sequence

from placement.config import TuneConfig
from placement.cpuset import format_cpulist
from placement.events import EventKind
from placement.pacing import doubling
from placement.records.step import StepRecord, record_steps
from placement.roles import ThreadRole
from placement.tune.facts import HostFacts, LiveFacts, WindowFacts
from placement.tune.judge import Backoff, NoiseBand, judge
from placement.tune.layout import CoreMap, RoleLayout
from placement.tune.rules import Proposal, RuleContext, make_rules
from placement.tune.window import WindowStats, summarize

log = logging.getLogger("placement")
_step = attrgetter("step")

# Hysteresis across rules: for this many windows after a change was kept, no rule may put
# that role back on the set it left (e.g. runqueue evicting the workers dataloader_size
# just lent main's core to).
KEPT_HOLD_WINDOWS = 8
# Windows skipped at the start: warm-up steps (allocations, worker start, caches) are not
# evidence, and a step time still falling as warm-up ends would pass for an action's gain.
WARMUP_WINDOWS = 2
# The most windows' steps (cfg.window each) a window paced in time holds: at 0.1 ms steps
# and the defaults, a window of 0.128 s.
MAX_PACE = 64


def paced_window(window: int, min_s: float, step_ms: float) -> int:
    """The steps of a window paced in time: `window` x the fewest power of two (at most
    MAX_PACE) that lasts `min_s` at `step_ms`; `window` when min_s is 0 or the step unknown. A
    power of two, as the monitor's hand-overs are paced (monitor.handover_min_s, hook.py
    StepHook.pace): with window_min_s no less than it and tune.window = monitor.flush_every,
    every window ends at a hand-over and takes no wake-up of the monitor thread of its own."""
    return window * doubling(window, step_ms, min_s, MAX_PACE)


class TunerState(enum.Enum):
    WARMUP = "warmup"  # the first WARMUP_WINDOWS windows: not evidence
    WATCHING = "watching"  # asking the rules every window
    IN_FLIGHT = "in_flight"  # an action applied, waiting for its first whole window
    COOLDOWN = "cooldown"  # cfg.cooldown_windows after a verdict (or a dry-run action)
    STOPPED = "stopped"  # closed, disabled, or stopped by an internal error


@dataclass
class InFlight:
    proposal: Proposal
    previous: frozenset[int]
    trigger: WindowStats  # the window whose evidence proposed it (reported, not judged against)
    first_step: int  # the first step it was in force for the whole step
    also_previous: tuple[tuple[ThreadRole, frozenset[int]], ...] = ()  # where the `also` roles were


class Tuner:
    def __init__(self, binder, cfg: TuneConfig, events, *, facts: Optional[HostFacts] = None,
                 next_step: Optional[Callable[[], int]] = None, floor_scale: Callable[[], int] = lambda: 1):
        """`binder`: the RoleBinder of this rank (its `rank_plan`, `role_cpus`, `set_role_cpus`,
        `threads`). `next_step()`: the first step that starts after now on the training thread
        (the monitor's step counter + 2: the step in progress ran partly before any change).
        Without it, the step after the last record seen (records arrive as steps end).
        `floor_scale()`: how many times cfg.window_min_s windows last now (the monitor's paced
        floor, stretched by its budget: monitor/probes/budget.py PacedFloor)."""
        self.cfg = cfg
        self.binder = binder
        self.events = events
        self.cores = CoreMap.from_plan(binder.rank_plan)
        self.memory_mode = binder.rank_plan.memory.mode
        self.rules = make_rules(cfg.rules)
        self.facts: HostFacts = facts if facts is not None else LiveFacts(self._own_pids)
        self._next_step = next_step if next_step is not None else self._after_last_record
        self._floor_scale = floor_scale
        self.state = TunerState.WARMUP if cfg.enabled else TunerState.STOPPED
        self.windows = 0  # windows seen
        self._records: list[StepRecord] = []  # of the current window, in step order
        self._window_start: Optional[int] = None  # first step of the current window
        self._window_last = 0  # its last step (set with _window_start)
        self._pace = cfg.window  # the steps of a window on the current grid (paced_window)
        self._last_step = 0
        self._in_flight: Optional[InFlight] = None
        self._cooldown = 0
        self._noise = NoiseBand()
        self._backoff = Backoff(cfg.max_backoff_windows)
        self._disabled: set[str] = set()
        self._dry_run_logged: set[tuple[str, str, frozenset[int]]] = set()
        self._held: dict[ThreadRole, tuple[frozenset[int], int]] = {}  # role -> (set it left, until window)

    # ---- the two calls training code makes ---------------------------------
    def observe(self, record: StepRecord) -> None:
        """Feed one step record. Never raises: a failure stops the tuner (plan stays as it is)."""
        self.observe_batch((record,))

    def observe_batch(self, records: Sequence[StepRecord]) -> None:
        """Feed step records in step order, as observe() one at a time would, for a batch's
        cost: the monitor hands over a window's records at once, and a Python call per record
        was a twelfth of the monitor thread's CPU in the job (benchmarks/job_cost.py). Never
        raises: a failure stops the tuner (plan stays as it is)."""
        i, n = 0, len(records)
        try:
            while i < n and self.state is not TunerState.STOPPED:
                if self._window_start is None:
                    self._start_window(record_steps(records[i]).start)
                # The records through the first one at or past the current window's last step: a
                # window can end (and an action move the window's start) only at that one.
                last = self._window_last
                j = min(bisect.bisect_left(records, last, i, n, key=_step) + 1, n)
                self._take(records[i:j])
                i = j
        except Exception as e:  # the tuner must never break training
            self.state = TunerState.STOPPED
            msg = f"placement tuner stopped after an internal error ({e!r}); placement stays as it is"
            log.warning("%s", msg)
            self._event(EventKind.WARNING, source="tune", message=msg)

    def _take(self, chunk: Sequence[StepRecord]) -> None:
        """Records up to the current window's end, its last step at most at the chunk's end:
        those measured before the window (before the action in flight took force) are left out."""
        self._last_step = max(self._last_step, chunk[-1].step)
        start = self._window_start
        # (a record of several steps, records/step.py, counts from its first: one begun before
        # the window is left out whole)
        self._records.extend(chunk if record_steps(chunk[0]).start >= start
                             else [r for r in chunk if record_steps(r).start >= start])
        while self._records and self._records[-1].step >= self._window_last:
            end = self._window_last + 1
            whole = [r for r in self._records if r.step < end]
            self._records = [r for r in self._records if r.step >= end]
            stats = summarize(whole) if whole else None
            if stats is not None:
                self._pace = paced_window(self.cfg.window, self.cfg.window_min_s * self._floor_scale(),
                                          stats.median_ms)
            self._start_window(end)
            if stats is not None:
                self._on_window(stats)

    def _start_window(self, start: int) -> None:
        """The window from step `start` on: cfg.window steps, or on the paced grid its first
        multiple of the pace at least cfg.window steps on (the pace read from the last window)."""
        window, pace = self.cfg.window, self._pace
        last = start + window - 1
        if pace > window:
            last = -(-last // pace) * pace
        self._window_start, self._window_last = start, last

    def window_end(self, after: int) -> Optional[int]:
        """The last step of this tuner's first window that ends after step `after`, on its
        current grid (from the first record's step, re-started at each action's in-force
        step); None when stopped. The monitor hands a window's records over as soon as their
        comm timing is final (StepMonitor.add_observer), so that trouble is seen, and a move
        judged, one window after the steps, not at the next flush. Read on the training
        thread: never raises."""
        if self.state is TunerState.STOPPED:
            return None
        w = self._pace
        # (set one after the other on the monitor thread: a window end predicted from a torn
        # read is caught at the next hand-over, as one an action moves)
        end = self._window_last if self._window_start is not None else w
        if after >= end:
            end += ((after - end) // w + 1) * w
        return end

    def close(self) -> None:
        self._records = []
        self.state = TunerState.STOPPED

    @property
    def layout(self) -> RoleLayout:
        """Where each role is now, as the binder has it, on the plan's cores."""
        return RoleLayout.of({role: self.binder.role_cpus(role) for role in ThreadRole}, self.cores)

    def _after_last_record(self) -> int:
        return self._last_step + 1

    # ---- one window -----------------------------------------------------------
    def _on_window(self, stats: WindowStats) -> None:
        self.windows += 1
        if self.state is TunerState.IN_FLIGHT:
            self._judge(stats)
            self._cool_down()
            return
        if self.state is TunerState.WARMUP:
            if self.windows >= WARMUP_WINDOWS:
                self.state = TunerState.WATCHING
            return
        if self.state is TunerState.COOLDOWN:
            self._cooldown -= 1
            if self._cooldown <= 0:
                self.state = TunerState.WATCHING
            return
        proposals = self._ask_rules(stats)
        for p in proposals:
            if not p.is_move:
                log.warning("placement: %s", p.reason)
                self._event(EventKind.WARNING, source="tune", rule=p.rule, message=p.reason, evidence=p.evidence)
        if not proposals:
            self._noise.add_quiet(stats)
            return
        for p in proposals:
            if p.is_move and not self._undoes_a_held_change(p) \
                    and not self._backoff.blocked((p.rule, p.role.value), self.windows):
                self._apply(p, stats)
                return

    def _cool_down(self) -> None:
        self._cooldown = self.cfg.cooldown_windows
        self.state = TunerState.COOLDOWN if self._cooldown > 0 else TunerState.WATCHING

    def _ask_rules(self, stats: WindowStats) -> list[Proposal]:
        layout = self.layout
        ctx = RuleContext(stats=stats, layout=layout, cfg=self.cfg, facts=WindowFacts(self.facts, layout.bounds),
                          memory_mode=self.memory_mode, background_niced=self.cfg.background_nice > 0)
        out = []
        for rule in self.rules:
            if rule.name in self._disabled:
                continue
            try:
                p = rule.propose(ctx)
            except Exception as e:  # one bad rule must not stop the others, nor training
                self._disabled.add(rule.name)
                msg = f"tune rule {rule.name} raised {e!r}; it is disabled for the rest of the run"
                log.warning("placement: %s", msg)
                self._event(EventKind.WARNING, source="tune", rule=rule.name, message=msg)
                continue
            if p is None:
                continue
            if p.is_move and (not p.cpus or not p.cpus <= layout.bounds or p.cpus == layout.cpus(p.role)
                              or any(not c or not c <= layout.bounds for _, c in p.also)):
                continue  # never leave the share; an empty or same set is no action
            out.append(p)
        return out

    def _undoes_a_held_change(self, p: Proposal) -> bool:
        left, until = self._held.get(p.role, (None, 0))
        return self.windows < until and p.cpus == left

    # ---- side effects -----------------------------------------------------------
    def _apply(self, p: Proposal, stats: WindowStats) -> None:
        layout = self.layout
        previous = layout.cpus(p.role)
        change = {"from": sorted(previous), "to": sorted(p.cpus)}
        also_previous = tuple((role, layout.cpus(role)) for role, _ in p.also)
        also = _also_changes(also_previous, p.also)
        if self.cfg.dry_run:
            sig = (p.rule, p.role.value, p.cpus)
            if sig not in self._dry_run_logged:
                self._dry_run_logged.add(sig)
                self._event(EventKind.TUNE, message=f"{p.rule} (dry run, not applied): {p.reason}", phase="dry_run",
                            rule=p.rule, role=p.role.value, change=change, also=also, reason=p.reason,
                            evidence=p.evidence, effect=None)
            self._cool_down()
            return
        results = self.binder.set_role_cpus(p.role, p.cpus, f"tune {p.rule}: {p.reason}")
        failed = [r for r in results if not r.ok]
        if results and len(failed) == len(results):
            self.binder.set_role_cpus(p.role, previous, f"rollback of tune {p.rule}: binder refused")
            wait = self._backoff.on_revert((p.rule, p.role.value), self.windows)
            why = f"binding refused: {failed[0].error}"
            self._event(EventKind.ROLLBACK, message=f"{p.rule} not applied: {why}", rule=p.rule, role=p.role.value,
                        change={"from": change["to"], "to": change["from"]}, evidence=p.evidence, effect=None,
                        backoff_windows=wait, why=why)
            return
        for role, cpus in p.also:
            results += self.binder.set_role_cpus(role, cpus, f"tune {p.rule}: {p.reason}")
        failed = [r for r in results if not r.ok]
        # Judged on whole windows from the first step it is in force for; the records of the
        # steps before it (measured before the move, still on their way) are not evidence.
        first_step = max(self._next_step(), self._last_step + 1)
        self._in_flight = InFlight(p, previous, stats, first_step, also_previous)
        self.state = TunerState.IN_FLIGHT
        self._start_window(first_step)
        self._records = [r for r in self._records if record_steps(r).start >= first_step]
        self._event(EventKind.TUNE, message=f"{p.rule}: {p.reason}", phase="applied", rule=p.rule, role=p.role.value,
                    change=change, also=also, reason=p.reason, in_force_step=first_step,
                    evidence=p.evidence, effect=None, threads=len(results) - len(failed),
                    failed=[{"tid": r.tid, "error": r.error} for r in failed])
        log.info("placement: tune %s: %s", p.rule, p.reason)

    def _judge(self, after: WindowStats) -> None:
        f, self._in_flight = self._in_flight, None
        p = f.proposal
        key = (p.rule, p.role.value)
        v = judge(self._noise.baseline_ms(), f.trigger, after, self._noise.pct(), self.cfg.min_gain_pct)
        judged = {"in_force_step": f.first_step, "judged_steps": [after.first_step, after.last_step]}
        if v.keep:
            self._backoff.on_keep(key)
            self._held[p.role] = (f.previous, self.windows + KEPT_HOLD_WINDOWS + 1)
            for role, prev in f.also_previous:
                self._held[role] = (prev, self.windows + KEPT_HOLD_WINDOWS + 1)
            self._event(EventKind.TUNE, message=f"{p.rule} kept: {p.role} {_moved(f.previous, p.cpus)}, {v.why}",
                        phase="kept", rule=p.rule, role=p.role.value,
                        change={"from": sorted(f.previous), "to": sorted(p.cpus)},
                        also=_also_changes(f.also_previous, p.also), reason=p.reason,
                        evidence=p.evidence, effect=v.effect(), why=v.why, **judged)
            log.info("placement: tune %s kept: %s", p.rule, v.why)
            return
        results = self.binder.set_role_cpus(p.role, f.previous, f"rollback of tune {p.rule}: {v.why}")
        for role, prev in f.also_previous:
            results += self.binder.set_role_cpus(role, prev, f"rollback of tune {p.rule}: {v.why}")
        wait = self._backoff.on_revert(key, self.windows)
        self._event(EventKind.ROLLBACK, message=f"{p.rule} rolled back: {p.role} {_moved(p.cpus, f.previous)}, {v.why}; "
                                        f"back off {wait} windows",
                    rule=p.rule, role=p.role.value,
                    change={"from": sorted(p.cpus), "to": sorted(f.previous)},
                    also=_also_changes(p.also, f.also_previous), evidence=p.evidence,
                    effect=v.effect(), why=v.why, backoff_windows=wait, **judged,
                    failed=[{"tid": r.tid, "error": r.error} for r in results if not r.ok])
        log.info("placement: tune %s rolled back (%s); back off %d windows", p.rule, v.why, wait)

    def _own_pids(self) -> set[int]:
        return {t.pid for t in self.binder.threads()}

    def _event(self, kind: EventKind, **fields: Any) -> None:
        try:
            self.events.event(kind, **fields)
        except Exception as e:  # a broken log must not stop tuning, nor training
            log.warning("placement: cannot log %s event: %r", kind, e)

    # ---- read-only view --------------------------------------------------------
    def role_cpus(self, role: ThreadRole) -> frozenset[int]:
        """Where `role` is now within the share: the binder's set (the plan's until a move)."""
        return self.layout.cpus(role)


def _also_changes(before, after) -> list[dict[str, Any]]:
    """The `also` moves of an action as event fields: [{"role", "from", "to"}, ...]."""
    return [{"role": role.value, "from": sorted(b), "to": sorted(a)} for (role, b), (_, a) in zip(before, after)]


def _moved(before: frozenset[int], after: frozenset[int]) -> str:
    return f"cpus {format_cpulist(before)} -> {format_cpulist(after)}"

