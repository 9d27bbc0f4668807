"""Every metric placement exports, in one place: its name, type, unit and help, by Prometheus'
conventions (https://prometheus.io/docs/practices/naming/).

What
    Units in the name and base units (seconds, ratios 0-1); a counter's exposed name ends in
    `_total` (prometheus_client adds it to the family's name); a histogram has `_bucket`, `_sum`
    and `_count`; an info metric is a gauge of value 1 named `_info`.

Labels
    Every series of a rank: RANK_LABELS (`run`, `rank`, `local_rank`, `node`, and `gpu_uuid` for a
    rank with a GPU, empty without). Never `job` or `instance` (Prometheus' own, set by the
    scrape) and never a step number: a week's job keeps the same series. With
    placement.metrics.per_rank=false a node exports NODE_LABELS only, its ranks summed.
"""
from __future__ import annotations

import dataclasses
import enum

RANK_LABELS = ("run", "rank", "local_rank", "node", "gpu_uuid")
NODE_LABELS = ("run", "node")
FORBIDDEN_LABELS = frozenset({"job", "instance", "step"})

# Step-time histogram buckets, seconds: 1 ms to 1 min (the +Inf bucket is added).
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Kind(str, enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # as exposed, less `_total` for a counter
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()  # beyond the rank's (or node's) own

    @property
    def exposed(self) -> str:
        """The name a query uses (a counter's with `_total`, a histogram's base name)."""
        return self.name + "_total" if self.kind is Kind.COUNTER else self.name


STEPS = Family("placement_steps", Kind.COUNTER, "Training steps the rank completed (monitor step records)")
STEP_SECONDS = Family("placement_step_seconds", Kind.COUNTER,
                      "Wall time of the rank's steps; the four parts below add up to it")
DATA_WAIT = Family("placement_data_wait_seconds", Kind.COUNTER, "Part of step time blocked waiting for the next batch")
COMM_WAIT = Family("placement_comm_wait_seconds", Kind.COUNTER,
                   "Part of step time in collectives (steps whose comm time is null count none)")
CPU_STALL = Family("placement_cpu_stall_seconds", Kind.COUNTER,
                   "Part of step time the main thread waited for a CPU while runnable (runqueue wait)")
COMPUTE = Family("placement_compute_seconds", Kind.COUNTER, "The rest of step time: the rank's own work")
OWN_CPU = Family("placement_own_cpu_seconds", Kind.COUNTER,
                 "CPU placement's own threads spent in the rank (monitor, binder's watcher, peer watch, posts); "
                 "rate() of it over rate() of placement_step_seconds is placement's share of the steps")
STEP_DURATION = Family("placement_step_duration_seconds", Kind.HISTOGRAM, "Step time of the rank")
LAST_STEP_TIME = Family("placement_last_step_timestamp_seconds", Kind.GAUGE,
                        "Unix time the rank's last recorded step ended")
LAST_STEP = Family("placement_last_step", Kind.GAUGE, "Number of the rank's last recorded step")
STRAGGLERS = Family("placement_straggler_windows", Kind.COUNTER,
                    "Exchange windows in which rank 0 named this rank a straggler, by cause", ("cause",))
STRAGGLER_COST = Family("placement_straggler_cost_ratio", Kind.GAUGE,
                        "Share of the job's step time this rank cost it in the last window it was judged "
                        "(0 when not named)", ("cause",))
HANGS = Family("placement_hangs", Kind.COUNTER, "Times the rank stopped completing steps past its hang limit")
HUNG = Family("placement_hung", Kind.GAUGE, "1 while the rank is hung, else 0")
# The names before "hang" was one word (a step's CPU stall is another idea), kept for a release.
STALLS = Family("placement_stalls", Kind.COUNTER, "Deprecated: placement_hangs under its old name, for one more release")
STALLED = Family("placement_stalled", Kind.GAUGE, "Deprecated: placement_hung under its old name, for one more release")
DRIFT = Family("placement_binding_drift_repaired", Kind.COUNTER,
               "Threads found off their planned CPUs and put back")
TUNER = Family("placement_tuner_actions", Kind.COUNTER, "Tuner actions by outcome", ("outcome",))
RESIDENCE = Family("placement_memory_residence_ratio", Kind.GAUGE,
                   "Share of the rank's resident pages on its planned NUMA node(s), last look")
BINDING = Family("placement_binding_info", Kind.GAUGE, "The CPUs and NUMA nodes each role of the rank is bound to",
                 ("role", "cpus", "numa"))
LOST = Family("placement_metrics_lost", Kind.COUNTER,
              "Rank snapshots the exporter could not read (unreadable, too large, not placement's)")

FAMILIES = (STEPS, STEP_SECONDS, DATA_WAIT, COMM_WAIT, CPU_STALL, COMPUTE, OWN_CPU, STEP_DURATION, LAST_STEP_TIME,
            LAST_STEP, STRAGGLERS, STRAGGLER_COST, HANGS, HUNG, STALLS, STALLED, DRIFT, TUNER, RESIDENCE, BINDING)
# Parts of a step, each a counter; summed over ranks in a node aggregate like every counter.
PART_FAMILIES = (DATA_WAIT, COMM_WAIT, CPU_STALL, COMPUTE)


class TunerOutcome(str, enum.Enum):
    APPLIED = "applied"
    KEPT = "kept"
    ROLLED_BACK = "rolled_back"
    NOT_APPLIED = "not_applied"
