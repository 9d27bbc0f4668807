"""Where one iteration of a program's training loop ends, from what the automatic hooks see.

What
    StepFinder turns two kinds of event on the rank's main thread into step boundaries:
    a *fire* (an optimizer finished `step()`: torch's global post-step hook, or GradScaler.step
    returned) and a *fetch* (the main thread got a batch from a DataLoader iterator). A step is
    one iteration of the loop, however many fires it holds.

Why this rule
    Fires are an event source, not a step counter (docs/monitor.md, "How a step is found"):
    Megatron's ChainedOptimizer fires once per inner optimizer, DeepSpeed once per group, a
    TorchTitan container and its inner optimizers both, a GAN's two optimizers twice; a
    GradScaler (pytorch#55585) or Megatron's found_inf iteration fires nothing at all; with
    gradient accumulation k fetches come before one fire. So:
    - fires per step (f) and fetches per step (k) are learned from the loop itself: f is the
      number of fires between two fetch boundaries, k the fetches of a step that fired;
    - a step ends at its f-th fire (on time, at the optimizer), further fires before the next
      fetch belong to it (and raise f);
    - a fetch ends the step when fires came but fewer than f (a partly skipped iteration), or
      when no fire came in k fetches (a wholly skipped iteration is still a step), except the
      fetch right after an iterator's first: loaders that prefetch one batch (Accelerate's
      DataLoaderShard, Lightning's fetcher) fetch twice at an epoch's start;
    - with no DataLoader seen, every fire of one optimizer (the lead: a GradScaler over an
      optimizer, else the first that fired) ends a step.
    Gradient accumulation counts optimizer steps, as the framework callbacks do.

Cost
    A few integer operations per event; no allocation.
"""
from __future__ import annotations

from typing import Callable, Hashable, Optional


class StepFinder:
    """Fed fire() and fetched() on the rank's main thread; at each boundary calls end_now() (a
    fire ends the step, now) or end_at(start_ns) (a fetch that started then ends it)."""

    __slots__ = ("_end_now", "_end_at", "fires_per_step", "fetches_per_step", "_fires", "_fetches", "_ended_by_fire",
                 "_extra", "_seen_fetch", "_lead", "_lead_outer", "_after_first")

    def __init__(self, end_now: Callable[[], None], end_at: Callable[[int], None]):
        self._end_now = end_now
        self._end_at = end_at
        self.fires_per_step = 0  # f, learned; 0 = not yet known
        self.fetches_per_step = 0  # k, learned from a step that fired; 0 = not yet known
        self._fires = 0  # fires since the last boundary
        self._fetches = 0  # fetches since the last boundary
        self._ended_by_fire = False  # the last boundary was a fire: fires until the next fetch are its own
        self._extra = 0  # fires after that boundary, before the next fetch
        self._seen_fetch = False
        self._lead: Optional[Hashable] = None
        self._lead_outer = False
        self._after_first = False  # the last fetch was an iterator's first

    def begin(self, key: Hashable, outer: bool = False, seen_fetch: bool = False) -> None:
        """Step 1 begins at this fire (the monitor starts at the first optimizer step: before it
        the program may not have built its process group, and an evaluation-only program never
        gets there). The fire itself counts as the end of a step 0 that is not recorded."""
        self._lead, self._lead_outer = key, outer
        self._seen_fetch = seen_fetch
        self._fires, self._fetches = 0, 0
        self._ended_by_fire, self._extra = True, 0

    def fire(self, key: Hashable, outer: bool = False) -> None:
        if outer and not self._lead_outer:  # GradScaler.step runs optimizer.step inside: it leads
            self._lead, self._lead_outer = key, True
            if not self._seen_fetch:
                return  # this iteration ended at the optimizer inside it
        if not self._seen_fetch:
            if key == self._lead:
                self._boundary_fire()
            return
        if self._ended_by_fire:
            self._extra += 1
            return
        fires = self._fires + 1
        if self.fires_per_step and fires >= self.fires_per_step:
            # _boundary_fire, inline: this is the path of every step of a loop with a fetch
            # (one frame less on the training thread right after its optimizer step)
            if self._fetches:
                self.fetches_per_step = self._fetches
            self._fires, self._fetches = 0, 0
            self._ended_by_fire, self._extra = True, 0
            self._end_now()
            return
        self._fires = fires

    def fetched(self, start_ns: int, first: bool = False) -> None:
        """A fetch on the main thread returned a batch; it started at start_ns; `first`: the
        iterator's first batch."""
        self._seen_fetch = True
        after_first, self._after_first = self._after_first, first
        if self._ended_by_fire:
            # The first fetch after the step ended at its fire: fires since then were the step's own.
            self.fires_per_step = (self.fires_per_step or 1) + self._extra
            self._ended_by_fire, self._extra = False, 0
            self._fetches = 1
            return
        if self._fires:
            # Fires came, fewer than f (or f not known yet: learn it): the step ends at this fetch.
            if not self.fires_per_step:
                self.fires_per_step = self._fires
            self._boundary_fetch(start_ns)
            return
        if self.fetches_per_step and self._fetches >= self.fetches_per_step and not after_first:
            self._boundary_fetch(start_ns)  # k fetches and no fire: an iteration that skipped its step
            return
        self._fetches += 1

    def _boundary_fire(self) -> None:
        if self._seen_fetch and self._fetches:
            self.fetches_per_step = self._fetches
        self._fires, self._fetches = 0, 0
        self._ended_by_fire, self._extra = True, 0
        self._end_now()

    def _boundary_fetch(self, start_ns: int) -> None:
        self._fires, self._fetches = 0, 1
        self._ended_by_fire, self._extra = False, 0
        self._end_at(start_ns)
