"""Placement for processes Ray starts: Ray Train's workers and any Ray actor, from Ray's own
worker setup hook. One line in the driver, and no placement import there:

    ray.init(runtime_env={"worker_process_setup_hook": "placement.integrations.ray.setup"})

(or `ray job submit --runtime-env-json '{"worker_process_setup_hook": "placement.integrations.ray.setup"}'`).
Only some workers (Ray Train's, an RL framework's learners): `worker_runtime_env()` below, given to
`RunConfig(worker_runtime_env=...)` or an actor's `.options(runtime_env=...)`.

Where Ray runs the hook
    In every worker process of the job, before its first task (ray/_private/workers/
    default_worker.py:314-320, load_and_execute_setup_hook; a hook that raises makes Ray drain the
    worker, so setup() never raises). From the job's runtime env only: ray.init turns the hook into
    the variable the worker reads (ray/_private/worker.py:2676,
    upload_worker_process_setup_hook_if_needed); an actor's own runtime env, and so Ray Train's
    RunConfig(worker_runtime_env=...), is passed on without that step and a hook given there never
    runs (measured with Ray 2.60.0): worker_runtime_env() takes that step for them.

When a worker is placed
    At the program's `import torch` (at once if torch is imported already), not in the hook: the
    hook runs as the process starts, before Ray leases it to a task or actor, when neither its GPUs
    nor its CPUs are known (Ray sets CUDA_VISIBLE_DEVICES per task: ray/_private/utils.py
    set_visible_accelerator_ids). By the import the worker runs its first task or actor
    constructor, and torch has started no thread. A worker that holds no Ray CPU and no GPU (Ray
    Train's controller, an actor left at num_cpus=0) is not placed: under Ray's accounting it
    holds no part of the node.

Which share of the node
    A worker with GPUs: the share of its first GPU in the plan of every GPU of the node (what
    placerun plans for --nproc-per-node gpu), found from the GPU id Ray gave it: distinct GPUs are
    distinct shares, no agreement needed. A CPU worker: the node's CPUs in N shares, N = the node's
    Ray CPUs / the worker's (each worker gets the part of the node Ray counts it as holding), and
    the worker claims the first free share: an exclusive flock on a file per share in /dev/shm
    (`SharedCpus`). Not Ray Train's local rank: Ray Train sets it after the worker started
    (ray/train/torch/config.py:175, just before the training function), plain actors never get
    one, and a worker started later (a restart, an elastic resize) must find a share free whoever
    held it: the kernel drops a dead holder's lock. Workers of different sizes on one node plan
    different N and may overlap.

Who the worker is
    Said by its program: the process group's rank, else RANK (Ray Train sets it; RL frameworks
    give their actors RANK in their env), else its share on the node. The event log is held in
    memory from the binding until the monitor starts (or the worker exits) and then written as
    <log_dir>/rank<R>.jsonl. Ray Train runs the training loop on a thread of its own
    (TrainingThread): the thread that steps the first optimizer is the rank's main thread.

Settings
    PLACEMENT_OVERRIDES (placerun's `placement.KEY=VALUE` words) and PLACEMENT_CONFIG (a YAML
    file, as --placement-config) in the worker's environment (runtime_env `env_vars`); a bad one is
    one line and the worker runs unbound: Ray's job is never stopped by placement.
"""
from __future__ import annotations

import atexit
import dataclasses
import errno
import fcntl
import hashlib
import os
import socket
import tempfile
from typing import Optional

from placement import imports
from placement.bind import session as session_mod
from placement.bind.stage1 import run_stage1, warn_rank
from placement.bootstrap import start_session
from placement.config import EnvSettings, PlacementConfig
from placement.errors import PlacementError, say
from placement.events import EventLog, UnsafePlace, check_log_dir, private_dir, rank_log_path
from placement.identity import RankIdentity
from placement.plan.model import Plan
from placement.plan.node import plan_for_node, visible_gpu_indices

HOOK = "placement.integrations.ray.setup"
EXTRA_LINE = "placement.integrations.ray needs Ray: pip install 'placement[ray]'"


def setup() -> None:
    """Ray's worker_process_setup_hook: place this worker at its program's `import torch`. Never
    raises (a hook that raises stops the worker); what it cannot do is one line on stderr."""
    try:
        if session_mod.current() is not None:
            return  # placerun's worker: its stage 1 ran already
        cfg = EnvSettings.read(os.environ).config()
    except PlacementError as e:
        _say(f"{e}; this worker runs unbound")
        return
    except Exception as e:  # a bug in placement must not stop the worker
        _say(f"the setup hook failed ({type(e).__name__}: {e}); this worker runs unbound")
        return
    imports.when_imported("torch", lambda _torch: place(cfg))


def worker_runtime_env(**runtime_env) -> dict:
    """`runtime_env` with the hook, for the workers it is given to: Ray Train's
    `RunConfig(worker_runtime_env=worker_runtime_env())` or an actor's
    `.options(runtime_env=worker_runtime_env())`, where Ray runs no `worker_process_setup_hook`
    itself. It sets the variable ray.init sets for the job's hook (ray/_private/runtime_env/
    setup_hook.py export_setup_func_module), which each worker reads as it starts
    (ray/_private/workers/default_worker.py:314), by Ray's own name for it
    (ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR)."""
    try:
        from ray._private import ray_constants
    except ImportError:
        raise ImportError(EXTRA_LINE) from None
    env_vars = dict(runtime_env.get("env_vars") or {})
    env_vars[ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR] = HOOK
    return {**runtime_env, "env_vars": env_vars}


@dataclasses.dataclass(frozen=True)
class WorkerShare:
    """The part of the node a worker is planned for: share `index` of `count`."""
    index: int
    count: int
    how: str  # how it was found, said in the start event's reason


def place(cfg: PlacementConfig) -> Optional[session_mod.Session]:
    """Plan and bind this worker as stage 1 and 2 do for placerun's, start the automatic monitor;
    the Session, or None when the worker is not placed (said in one line unless it holds no
    resources). Never raises."""
    try:
        return _place(cfg)
    except PlacementError as e:
        _say(f"{e}; this worker runs unbound")
    except Exception as e:  # binding never stops training
        _say(f"placing this worker failed ({type(e).__name__}: {e}); it runs unbound")
    return None


def _place(cfg: PlacementConfig) -> Optional[session_mod.Session]:
    if session_mod.current() is not None:
        return None
    try:
        import ray
    except ImportError:
        _say(f"{EXTRA_LINE}; this worker runs unbound")
        return None
    context = ray.get_runtime_context()
    gpu_ids = [str(i) for i in context.get_accelerator_ids().get("GPU", ())]
    ray_cpus = float(context.get_assigned_resources().get("CPU", 0.0))
    if not gpu_ids and ray_cpus <= 0:
        return None  # no part of the node under Ray's accounting: nothing to place it on
    check_log_dir(cfg.monitor.log_dir)  # LogDirError, one line
    if gpu_ids:
        plan, share = gpu_share(cfg, gpu_ids)
    else:
        count = shares_of_node(_node_cpus(ray, context.get_node_id()), ray_cpus, len(os.sched_getaffinity(0)))
        try:
            index = SharedCpus(count).claim()
        except UnsafePlace as e:
            _say(f"the CPU shares' directory is not safe to use ({e.strerror or e}); this worker runs unbound")
            return None
        if index is None:
            _say(f"all {count} CPU shares of this node are held by other Ray workers; this worker runs unbound")
            return None
        share = WorkerShare(index, count, f"CPU share {index} of {count} (the node's Ray CPUs / this worker's "
                                          f"{ray_cpus:g}), claimed on this host")
        _, plan = plan_for_node(cfg, count)
    identity = RankIdentity(share.index, share.index, 1, share.count, None, socket.gethostname())
    events = EventLog.held(share.index)
    s = run_stage1(cfg, plan, events, identity, entry="ray", keep=frozenset(os.environ),
                   detail={"share": share.how})
    s.settle = lambda session: _settle(session, share, context.get_job_id())
    atexit.register(s.close)
    start_session(s, find_main=True)  # Ray Train's loop runs on its own thread
    return s


def gpu_share(cfg: PlacementConfig, gpu_ids: list[str], root: str = "/") -> tuple[Plan, WorkerShare]:
    """The plan of every GPU of the node (under `root`) and the share of this worker's first GPU
    (Ray's id: an index among the node's GPUs, or a UUID)."""
    environ = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}  # Ray's ids are the node's
    topo, plan = plan_for_node(cfg, "gpu", root=root, environ=environ)
    seen = visible_gpu_indices(topo, {"CUDA_VISIBLE_DEVICES": gpu_ids[0]}, strict=False).indices or []
    index = next((r.local_rank for r in plan.ranks if seen and r.gpu is not None and r.gpu.index == seen[0]), None)
    if index is None:
        raise PlacementError(f"Ray's GPU id {gpu_ids[0]!r} matches no GPU of this node's plan")
    more = f" (of its GPUs {', '.join(gpu_ids)})" if len(gpu_ids) > 1 else ""
    return plan, WorkerShare(index, len(plan.ranks), f"the share of GPU {gpu_ids[0]}{more}, as Ray assigned it")


def shares_of_node(node_cpus: float, worker_cpus: float, usable: int) -> int:
    """How many CPU shares the node is planned in: the node's Ray CPUs over the worker's, at least
    one and at most one per CPU the worker may run on. `worker_cpus` > 0 (a worker holding none
    is not placed)."""
    if node_cpus <= 0:  # the node's Ray CPUs unknown
        return max(1, usable)
    return max(1, min(usable, int(node_cpus // worker_cpus)))


def _node_cpus(ray, node_id: str) -> float:
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return float(node.get("Resources", {}).get("CPU", 0.0))
    return 0.0


class SharedCpus:
    """The CPU shares of this host, claimed by flock: a file per share of a plan in `count`
    shares, held locked by the worker on it for as long as it lives (the kernel drops the lock of a
    process that died, so a restarted worker finds its predecessor's share free)."""

    def __init__(self, count: int, root: Optional[str] = None):
        self.count = count
        base = root or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self.dir = os.path.join(base, f"placement-ray-{os.getuid()}")

    def claim(self) -> Optional[int]:
        """The first free share (now held by this process), None when every one is held;
        UnsafePlace when the directory is not this user's alone (another user made it first in
        /dev/shm, to choose where these files go or to hold every share), or a lock file is a link."""
        private_dir(self.dir)
        for index in range(self.count):
            path = os.path.join(self.dir, f"cpu-{self.count}-{index}.lock")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise UnsafePlace(errno.ELOOP, f"{path} is a symbolic link") from None
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _claims.append(fd)  # held until this process exits: never closed
            return index
        return None


_claims: list[int] = []  # the claim kept open for the process's life (a closed fd drops its lock)


def _settle(s: session_mod.Session, share: WorkerShare, job: str) -> None:
    """The rank as the program now says it, and its log opened as rank<R>.jsonl."""
    try:
        s.identity = RankIdentity.find(os.environ, local_rank=None if "LOCAL_RANK" in os.environ else share.index,
                                       default_rank=share.index, default_local_world_size=share.count)
    except PlacementError as e:  # a malformed RANK/LOCAL_RANK: the share's numbers stay
        warn_rank(s.events, s.rank, f"{e}; this worker's log is named by its share on the node")
    rank = s.identity.rank
    path = rank_log_path(s.config.monitor.log_dir, rank)
    try:
        s.events.open_at(path, rank, run_id(job))
    except OSError as e:
        _say(f"cannot open {path} ({e.strerror or e}); this worker's records are not written")


def run_id(job: str) -> str:
    """The run's id (placement/identity.py): the same on every worker of the Ray job."""
    return hashlib.sha1(f"ray|{job}".encode()).hexdigest()[:12]


def _say(line: str) -> None:
    say(f"placement: ray worker {os.getpid()}: {line}")
