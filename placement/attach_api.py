"""`placement.attach()`: the hook training code calls once, on every rank, after
init_process_group and after wrapping the model (DDP), before the training loop.

Under placerun it uses the Session that stage 1 created (plan, event log, binder);
without placerun it plans this rank itself (plan_for_node for LOCAL_WORLD_SIZE ranks,
this LOCAL_RANK) and runs the same stage 1 placerun's workers run (placement.bind.stage1:
process mask, memory policy, env, Session), then stage 2. NCCL reads its env once: called
before init_process_group, attach() names and places NCCL's threads as placerun does; called
after NCCL created its communicator, it says so in one warning line with the fix.
Then it starts the step monitor and returns a Handle.

    handle = placement.attach(model, optimizer, monitor={"log_dir": "runs/x"})
    for batch in handle.watch(loader):   # data wait
        ...
        optimizer.step()                 # a step ends here (post-step hook)
    handle.close()

What attach() does is said on stderr, one line each, as placerun says it: the plan's warnings
(once per rank), settings placerun already decided (its plan wins; the dropped keys are named).
Without placerun, close() puts back the CPU affinity (every thread of the process), the calling
thread's memory policy and torch's thread count that attach() found. The memory policy is per
thread: threads started while attached keep the one they inherited (the kernel sets a policy for
the calling thread only), as DataLoader worker processes keep their CPU masks.

Keyword overrides are config keys (`policy="none"`, `monitor={"flush_every": 5}`,
`**{"monitor.log_dir": "runs/x"}`); `config` may be a PlacementConfig, a dict, a YAML
path, or a list of "key=value" strings.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import sys
from typing import Any, Callable, Iterable, Optional, Union

from placement import _procfs
from placement.bind import session as session_mod
from placement.bind.affinity import apply_process_mask
from placement.bind.fork import guard_forks
from placement.bind.stage1 import run_stage1, start_stage2, warn_rank
from placement.config import EnvSettings, PlacementConfig, load_config
from placement.errors import ConfigError, PlacementError, say
from placement.events import EventKind, LogDirError, open_rank_log  # noqa: F401  (LogDirError: raised by attach(), importable here)
from placement.identity import RankIdentity, job_id, new_run_id, process_group, run_id_from_env, shared_run_id
from placement.monitor import exitflush
# The module, not its names: make_comm_timing is looked up when attach() runs, so a test can
# stand in an NCCL comm source for the whole of attach() (tests/nccl_recorder_standins.py).
from placement.monitor.comm import timing as monitor_comm
from placement.monitor.comm.base import UNSEEN
from placement.monitor.comm.groups import default_backend
from placement.monitor.crossrank.exchange import Exchange, default_store
from placement.monitor.health.peers import PeerLiveness
from placement.monitor.step_monitor import StepMonitor
from placement.monitor.stragglers.event import named_ranks
from placement.monitor.stragglers.figures import Thresholds
from placement.monitor.probes.threads import RoleSampler, ThreadScan
from placement.monitor.warn import WarnOnce
from placement.monitor.watch import WatchedIterable
from placement.metrics.rank import rank_labels, start_rank_metrics
from placement.plan.node import plan_for_node
from placement.residence import planned_nodes
from placement.plan.table import warnings_summary
from placement.tune.tuner import Tuner

log = logging.getLogger("placement")

# Keys stage 1 already acted on under placerun: an attach() override cannot change them.
BINDING_KEYS = ("policy", "memory", "reserved_cpus", "smt", "prefer_fast_cores", "strict",
                "dataloader_workers", "nccl_topo_file")

_current_handle: Optional["Handle"] = None


# ---- configuration ---------------------------------------------------------------------
def _nest(overrides: dict[str, Any]) -> dict[str, Any]:
    """{"monitor.log_dir": x, "tune": {...}} -> nested dicts; "placement." prefixes dropped."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        parts = key.removeprefix("placement.").split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]].update(value)
        else:
            node[parts[-1]] = value
    return out


def build_config(config: Union[None, PlacementConfig, dict, str, list, tuple], overrides: dict[str, Any],
                 base: Optional[PlacementConfig] = None) -> PlacementConfig:
    """The validated config: `base` (the session's; without one, the environment's:
    PLACEMENT_CONFIG, PLACEMENT_OVERRIDES), then `config`, then keyword overrides (then `config`
    given as 'key=value' strings)."""
    if base is None:
        env = EnvSettings.read(os.environ)
        base = env.config() if env else None
    layers: list[Union[dict[str, Any], str]] = [base.to_dict()] if base is not None else []
    dotted: list[str] = []
    if isinstance(config, PlacementConfig):
        layers.append(config.to_dict())
    elif isinstance(config, dict):
        layers.append(_nest(config))
    elif isinstance(config, str):
        layers.append(config)  # a YAML file path
    elif isinstance(config, (list, tuple)):
        dotted = [str(x) for x in config]
    elif config is not None:
        raise PlacementError(f"attach(config={type(config).__name__}) is not valid; give a PlacementConfig, "
                             "a dict, a YAML file path or a list of 'key=value' strings")
    layers.append(_nest(overrides))
    return load_config(overrides=dotted, base=layers)


_run_id: Optional[str] = None  # this process's run (every attach of it is one run)
_run_id_why: Optional[str] = None  # why it is this rank's own, not its job's (said once per log)


def _find_run_id(identity: RankIdentity) -> str:
    """The run's id, the same on every rank: from torch elastic's environment, else rank 0's
    through the job's c10d store (attach() after init_process_group, without a launcher), else
    this process's own (one rank, or no store)."""
    global _run_id, _run_id_why
    if _run_id is None:
        _run_id = run_id_from_env()
        if _run_id is None and identity.world_size > 1:
            store = None
            try:
                store = default_store()
            except Exception:
                pass
            if store is not None:
                _run_id, _run_id_why = shared_run_id(store, identity.rank)
        if _run_id is None:
            _run_id = new_run_id()
    return _run_id


def _open_event_log(log_dir: str, rank: int, run: Optional[str] = None, rotate_mb: float = 0.0):
    events = open_rank_log(log_dir, rank, run, rotate_mb)  # LogDirError, one line: the same decision as placerun's
    if _run_id_why is not None and run == _run_id:
        warn_rank(events, rank, _run_id_why)
    return events


def _identity(environ=os.environ) -> RankIdentity:
    """This rank without placerun: from the process group when there is one, else torchrun's env
    (unset: rank 0 of 1 on a node of 1)."""
    return RankIdentity.find(environ, default_rank=0, default_local_world_size=1)


# ---- binding without placerun ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FoundPlacement:
    """What this process ran with before attach() bound it, for close() to put back."""
    cpus: frozenset[int]  # the calling thread's affinity
    memory: Optional[_procfs.Mempolicy]  # the calling thread's memory policy; None: unreadable here
    torch_threads: Optional[int]  # torch.get_num_threads() when torch was imported, else None

    @classmethod
    def read(cls) -> "FoundPlacement":
        torch = sys.modules.get("torch")
        threads = torch.get_num_threads() if torch is not None and hasattr(torch, "get_num_threads") else None
        return cls(frozenset(os.sched_getaffinity(0)), _procfs.get_mempolicy(), threads)

    def restore(self, events, rank: int) -> None:
        """Every thread of the process back on the CPUs found, the calling thread's memory policy
        and torch's thread count as found; one `restore` event says what the kernel reports."""
        mask = apply_process_mask(self.cpus)
        memory_errno = None if self.memory is None else _procfs.set_mempolicy(self.memory.mode, self.memory.nodes)
        torch = sys.modules.get("torch")
        if self.torch_threads is not None and torch is not None:
            torch.set_num_threads(self.torch_threads)
        events.event(EventKind.RESTORE, cpus=sorted(self.cpus), applied=sorted(mask.applied), ok=mask.ok, error=mask.error,
                     memory=None if self.memory is None else {"mode": self.memory.mode, "nodes": list(self.memory.nodes),
                                                              "errno": memory_errno},
                     torch_threads=self.torch_threads)
        if not mask.ok:
            warn_rank(events, rank, f"close() could not put back the CPU affinity attach() found: {mask.error}")


def _bind_here(cfg: PlacementConfig, events, identity: RankIdentity):
    """Plan this node in-process (no placerun, so no hand-off) and run the same stage 1 as
    placerun's workers, then stage 2. The plan's warnings: every one in the event log, one line
    on stderr."""
    _, plan = plan_for_node(cfg, identity.local_world_size)  # PlanError (one line) on a shortfall with strict
    for w in plan.warnings:
        events.event(EventKind.WARNING, source="plan", message=w)
    summary = warnings_summary(plan, f"the event log {events.path or ''}".rstrip())
    if summary:
        say(f"placement: rank {identity.rank}: plan warning: {summary}")
    s = run_stage1(cfg, plan, events, identity, entry="attach")
    start_stage2(s)
    return s


def _current_session():
    s = session_mod.current()
    return None if s is None or s.closed else s


# ---- steps ---------------------------------------------------------------------------
def torch_optimizer(optimizer) -> Optional[Any]:
    """The torch.optim.Optimizer inside `optimizer`: itself, or the one a wrapper holds
    (Megatron's `.optimizer`, the first of a ChainedOptimizer's `.chained_optimizers`, accelerate's
    AcceleratedOptimizer: an Optimizer subclass that never runs Optimizer.__init__, so it has no
    hooks of its own, and steps the `.optimizer` it holds)."""
    import torch

    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if isinstance(optimizer, torch.optim.Optimizer) \
                and not isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            return optimizer
        chained = getattr(optimizer, "chained_optimizers", None)
        if chained:
            optimizer = chained[0]
        else:
            optimizer = getattr(optimizer, "optimizer", None)
    return None


class Handle:
    """What attach() returns. Every method is safe to call from training code: none raises
    from the monitor's own failures."""

    def __init__(self, cfg: PlacementConfig, session, events, monitor, comm, tuner, owns_session: bool,
                 owns_events: bool, found: Optional[FoundPlacement] = None):
        self.config = cfg
        self.session = session
        self.events = events
        self.monitor = monitor
        self._comm = comm
        self._tuner = tuner
        self._owns_session = owns_session
        self._owns_events = owns_events
        self._found = found  # what attach() found, put back by close() when attach() bound this process
        self._optimizer_hook = None
        self.automatic = False  # started by placerun's automatic monitor (placement.auto), not by attach()
        self.on_close: Optional[Callable[[], None]] = None  # called once close() is done
        self.closed = False

    @property
    def rank_plan(self):
        return None if self.session is None else self.session.rank_plan

    @property
    def binder(self):
        return None if self.session is None else self.session.binder

    @property
    def tuner(self):
        """The rank's self-tuner (placement.tune.Tuner), None when tuning is off."""
        return self._tuner

    @property
    def steps(self) -> int:
        return 0 if self.monitor is None else self.monitor.step

    def hook_optimizer(self, optimizer) -> bool:
        inner = torch_optimizer(optimizer)
        if inner is None:
            log.warning("placement: %s is not (and holds no) torch.optim.Optimizer; mark steps with "
                        "handle.step()", type(optimizer).__name__)
            return False
        self._optimizer_hook = inner.register_step_post_hook(self.monitor.on_step)
        return True

    def step(self) -> None:
        """Mark the end of a training step (when no optimizer was given to attach, or its step
        is not called every iteration). The first call takes over from the optimizer hook:
        when that hook has already ended this iteration's step (the usual order, optimizer.step()
        then handle.step()), this call only removes it, so no step is counted twice. From then
        on `handle.step` is the monitor's own step hook: one frame less on the training thread
        right after each step, when every code path is cold."""
        if self.monitor is None or self.closed:
            return
        self.step = self.monitor.on_step
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
            log.info("placement: handle.step() called: steps are marked by it from now on, not by the optimizer")
            if self.monitor.step > 0:
                return
        self.monitor.on_step()

    def watch(self, iterable: Iterable):
        """Wrap a DataLoader or iterator: time blocked in it counts as data wait."""
        if self.monitor is None:
            return iterable
        return WatchedIterable(iterable, self.monitor.hook)

    @contextlib.contextmanager
    def comm(self):
        """Count the enclosed block as communication (a collective placement cannot see,
        e.g. one issued from C++): `with handle.comm(): custom_all_reduce(x)`."""
        if self._comm is None:
            yield
            return
        t0 = self._comm.clock.enter()
        try:
            yield
        finally:
            self._comm.clock.done(t0)

    def add_observer(self, fn: Callable, window_end: Optional[Callable] = None) -> None:
        """Call fn(StepRecord) for every step record (in batches, every monitor.flush_every steps;
        with window_end, step -> the last step of fn's first window ending after it, also as
        soon as such a window's comm timing is final: StepMonitor.add_observer). At short steps
        a record holds several steps (rec.steps, records/step.py; monitor.record_min_s=0: one)."""
        if self.monitor is not None:
            self.monitor.add_observer(fn, window_end)

    def close(self) -> None:
        """Write every pending record, remove the hooks, restore torch.distributed and, where
        attach() bound this process itself, the affinity, memory policy and torch thread count it
        found. Idempotent."""
        global _current_handle
        if self.closed:
            return
        self.closed = True
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        if self.monitor is not None:
            try:
                self.monitor.close()
            except Exception as e:
                log.warning("placement: monitor close failed: %s", e)
        if self._tuner is not None:
            try:
                self._tuner.close()
            except Exception as e:
                log.warning("placement: tuner close failed: %s", e)
        if self._owns_session and self.session is not None:
            self.session.binder.stop_watcher()  # before the restore: it would bind the threads again
            if self._found is not None:
                try:
                    self._found.restore(self.session.events, self.session.rank)
                except Exception as e:
                    log.warning("placement: restoring the affinity found at attach() failed: %s", e)
            self.session.close()
            if session_mod.current() is self.session:
                session_mod.set_current(None)
        elif self._owns_events:
            self.events.close()
        else:
            self.events.flush()
        if _current_handle is self:
            _current_handle = None
        if self.on_close is not None:
            self.on_close()

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def attach(model=None, optimizer=None, *, config=None, **overrides) -> Handle:
    """Bind this rank's threads by role, start the monitor, return a Handle.

    Call it on every rank (each sends its straggler figures to rank 0 through the job's c10d
    store). Errors of configuration, planning or an unwritable log directory raise a
    PlacementError with one line; nothing after that raises into training code.
    """
    global _current_handle
    steps_before = 0
    previous = _current_handle
    if previous is not None and not previous.closed:
        if previous.automatic:
            # placerun's automatic monitor ran first: this monitor takes its place and numbers on.
            steps_before = previous.steps
        else:
            log.warning("placement: attach() called again; closing the previous handle first")
        previous.close()
    # placement.auto imports this module, so it is looked up, not imported (no import circle).
    auto = sys.modules.get("placement.auto.monitor")
    if auto is not None and auto.current() is not None:
        auto.current().give_way()
    if model is not None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"attach(model={type(model).__name__}) is not valid; give the torch.nn.Module "
                              "(DDP-wrapped or not) or leave it out")
    session = _current_session()
    if session is not None:
        session.settle_identity()
    cfg = build_config(config, overrides, base=None if session is None else session.config)
    dropped: list[str] = []
    if session is not None:
        # Stage 1 bound this process before the program ran, from a plan made for the whole node:
        # one rank cannot re-plan it, so placerun's plan wins and the line names what is dropped.
        dropped = [f"placement.{k}={_as_written(getattr(cfg, k))}" for k in BINDING_KEYS
                   if getattr(cfg, k) != getattr(session.config, k)]
        cfg = dataclasses.replace(cfg, **{k: getattr(session.config, k) for k in BINDING_KEYS})
    identity = _identity() if session is None else session.identity
    rank = identity.rank
    owns_session = owns_events = False
    found = None
    if session is not None:
        if os.path.abspath(cfg.monitor.log_dir) == os.path.abspath(session.config.monitor.log_dir) \
                and session.events.path is not None:
            events = session.events
        else:
            events, owns_events = _open_event_log(cfg.monitor.log_dir, rank, session.events.run,
                                                  cfg.monitor.log_rotate_mb), True
        if dropped:
            warn_rank(events, rank, f"placerun's plan wins: attach() settings dropped: {', '.join(dropped)} "
                               "(placerun bound this rank before the program started; give them to placerun)")
        session.binder.rescan()
    else:
        events = _open_event_log(cfg.monitor.log_dir, rank, _find_run_id(identity), cfg.monitor.log_rotate_mb)
        owns_events = True
        if cfg.policy != "none":
            found = FoundPlacement.read()
            try:
                session = _bind_here(cfg, events, identity)
            except BaseException:
                events.close()
                raise
            owns_session = session is not None
    guard_forks()  # bound or not: its backend threads enter Python (the monitor's future callbacks, torch's frees)
    handle = _start_handle(cfg, session, events, identity, model, owns_session, owns_events,
                           found if owns_session else None, steps="attach", steps_before=steps_before)
    if handle.monitor is not None and optimizer is not None:
        handle.hook_optimizer(optimizer)
    if handle.monitor is not None:
        handle.monitor.start()
    _current_handle = handle
    return handle


def attach_automatic(model=None, megatron_iteration: Optional[int] = None) -> Handle:
    """placerun's automatic monitor (placement.auto) starts the rank's monitor as attach() would,
    with the Session's config and nothing asked of the program; its steps are marked by the
    automatic hooks. `megatron_iteration`: Megatron-LM's curr_iteration at the fire that starts it
    (step s then runs iteration megatron_iteration + s), said in the monitor's start event.
    Raises PlacementError when there is no Session (not under placerun)."""
    global _current_handle
    session = _current_session()
    if session is None:
        raise PlacementError("no placerun Session in this process")
    session.settle_identity()
    session.binder.rescan()
    handle = _start_handle(session.config, session, session.events, session.identity, model, False, False, None,
                           steps="auto", megatron_iteration=megatron_iteration)
    handle.automatic = True
    if handle.monitor is not None:
        handle.monitor.start()
    _current_handle = handle
    return handle


def _start_handle(cfg: PlacementConfig, session, events, identity: RankIdentity, model, owns_session: bool,
                  owns_events: bool, found: Optional[FoundPlacement], *, steps: str, steps_before: int = 0,
                  megatron_iteration: Optional[int] = None) -> Handle:
    monitor = comm = tuner = None
    if cfg.monitor.enabled:
        monitor, comm = _start_monitor(cfg, events, session, model, identity, steps=steps, steps_before=steps_before,
                                       megatron_iteration=megatron_iteration)
        tuner = _start_tuner(cfg, session, events, monitor)
        if session is not None and monitor is not None:
            # While the monitor's budget stretches its hand-overs, the binder's watcher (a wake-up
            # and a few /proc reads a second) rescans half as often too (bind/binder.py pace_watch).
            m = monitor
            session.binder.pace_watch(lambda: 2.0 if not m.closed and m.floor_scale > 1 else 1.0)
    return Handle(cfg, session, events, monitor, comm, tuner, owns_session, owns_events, found)


def _as_written(value: Any) -> str:
    """A setting as the user wrote it: a vocabulary member by its value ('none', not <Policy.NONE>)."""
    return repr(value.value if isinstance(value, enum.Enum) else value)


def _start_monitor(cfg: PlacementConfig, events, session, model, identity: RankIdentity, *, steps: str,
                   steps_before: int = 0, megatron_iteration: Optional[int] = None):
    """The rank's StepMonitor and comm source. `steps`: how steps are marked ("attach": the
    optimizer attach() was given or handle.step(); "auto": placerun's automatic hooks), said in the
    monitor's start event; `steps_before`: steps an automatic monitor this one replaces recorded."""
    rank, world_size = identity.rank, identity.world_size
    warn = WarnOnce(events)
    # The thread list, looked at each span (on the monitor thread) and re-read when the
    # threads or children changed: through the binder's rescan when its watcher keeps binding
    # (so a new DataLoader worker is bound and counted as ours at once, not at the next tick).
    binder = None if session is None else session.binder
    full = binder.current_threads if binder is not None and binder.watching else None
    sampler = RoleSampler(ThreadScan(full), warn)
    dist = process_group()
    # From the group's backend config: get_backend() says "undefined" or "cpu:gloo,cuda:nccl" as given.
    backend = None if dist is None else default_backend()
    comm = monitor_comm.make_comm_timing(cfg.monitor.comm_timing, backend, warn, window=cfg.monitor.exchange_every,
                            budget_pct=cfg.monitor.budget_pct)
    original = None
    if dist is not None or cfg.monitor.comm_timing != "off":
        try:
            original = monitor_comm.OriginalCollectives()
            comm.install(original)
        except ImportError:
            original = None
    ddp_timed, route = False, None
    if model is not None and original is not None and cfg.monitor.comm_timing != "off":
        route = monitor_comm.ddp_bucket_route(cfg.monitor.comm_timing, comm, world_size, model)
        if route is monitor_comm.DdpBuckets.HOOK:
            ddp_timed = monitor_comm.install_ddp_hook(model, comm.clock, original, warn)
        elif route is monitor_comm.DdpBuckets.RECORDER:
            comm.no_collective = UNSEEN
        elif route is monitor_comm.DdpBuckets.UNMEASURED:
            comm.clock.timed, comm.no_collective = False, UNSEEN
            events.event(EventKind.MONITOR, source="monitor", message=monitor_comm.ONE_RANK_LINE, comm_ms=None)
    exchange = None
    if dist is not None and world_size > 1:
        store = None
        try:
            store = default_store()
        except Exception as e:
            warn("exchange", f"no c10d store to exchange straggler figures through ({type(e).__name__}: {e}); "
                             "straggler naming is off")
        if store is not None:
            exchange = Exchange(rank, world_size, store, warn, slots=cfg.monitor.exchange_every,
                                thresholds=Thresholds.from_monitor(cfg.monitor), node_rank=identity.node_rank,
                                liveness=PeerLiveness(world_size) if rank == 0 else None)
    # The NUMA node(s) the rank's memory is planned on: the residence watch looks where its pages are.
    planned = () if session is None else planned_nodes(session.rank_plan.memory.mode, session.rank_plan.memory.nodes)
    monitor = StepMonitor(cfg, events, rank=rank, local_rank=identity.local_rank, world_size=world_size,
                          sampler=sampler, comm=comm, warn=warn, exchange=exchange, planned_nodes=planned,
                          first_step=steps_before + 1)
    _start_metrics(cfg, events, session, identity, monitor, warn)
    sigterm = exitflush.register(monitor)
    # host and node_rank (torch elastic's GROUP_RANK: two agents on one host are two nodes) tell
    # `placement report` which node each rank ran on.
    events.event(EventKind.START, source="monitor", pid=os.getpid(), host=identity.host, job=job_id(),
                 node_rank=identity.node_rank, backend=backend, comm_timing=comm.name,
                 ddp_hook=ddp_timed, ddp_buckets=None if route is None else route.value,
                 exchange=exchange is not None, sigterm_flush=sigterm, steps=steps,
                 every={"flush": cfg.monitor.flush_every, "rescan": cfg.monitor.rescan_every,
                        "exchange": cfg.monitor.exchange_every, "summary": cfg.monitor.summary_every},
                 **({} if megatron_iteration is None else {"megatron_iteration": megatron_iteration}))
    events.flush()
    return monitor, comm


def _start_metrics(cfg: PlacementConfig, events, session, identity: RankIdentity, monitor: StepMonitor, warn) -> None:
    """The rank's live metrics (placement/metrics/), fed by the monitor's batches, the rank's events
    and, on rank 0, every judged window; nothing when placement.metrics is off."""
    rank_plan = None if session is None else session.rank_plan
    publisher = start_rank_metrics(cfg.metrics, rank_labels(events.run, identity.rank, identity.local_rank,
                                                            _gpu_uuid(rank_plan)),
                                   identity.rank, identity.local_rank, warn)
    if publisher is None:
        return
    if rank_plan is not None and rank_plan.roles:
        publisher.set_binding({role.value: a.cpus for role, a in rank_plan.roles.items()}, rank_plan.numa)
    monitor.delivery.add_sink(publisher)
    publisher.on_close = events.add_tap(publisher.on_event)
    if monitor.crossrank.exchange is not None and identity.rank == 0:
        monitor.crossrank.on_judged(lambda verdict: publisher.judged(named_ranks(verdict)))


def _gpu_uuid(rank_plan) -> Optional[str]:
    """The rank's GPU's UUID (DCGM's `UUID` label) from NVML, when it has a GPU and NVML answers."""
    if rank_plan is None or rank_plan.gpu is None:
        return None
    from placement.topology.gpus import nvml_gpus

    return next((g.uuid for g in nvml_gpus() or () if g.pci == rank_plan.gpu.pci), None)


def _start_tuner(cfg: PlacementConfig, session, events, monitor):
    if not cfg.tune.enabled or session is None or monitor is None or not session.rank_plan.roles:
        return None
    try:
        # The step in progress when a move is applied ran partly before it: the move is in
        # force from the step after (monitor.step counts finished steps). The tuner works from
        # the plan's cores and the binder's role sets: no topology in a worker.
        # Its windows paced on the monitor's floor, as the budget stretches it (PacedFloor).
        tuner = Tuner(session.binder, cfg.tune, events, next_step=lambda: monitor.step + 2,
                      floor_scale=lambda: monitor.floor_scale)
    except Exception as e:  # the tuner is an extra: training and the static plan go on without it
        events.event(EventKind.WARNING, source="tune", message=f"tuner not started ({type(e).__name__}: {e}); the static plan stays")
        return None
    monitor.add_observer(tuner.observe_batch, tuner.window_end, batch=True)
    return tuner
