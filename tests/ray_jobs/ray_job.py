"""Ray Train and plain Ray actors under placement's setup hook (tests/integrations/test_ray.py,
benchmarks/ray_cost.py). The training code has no placement import; the driver adds one line.

    python ray_job.py trainer --out DIR [--iters N] [--workers W] [--work-ms MS]
                              [--slow-rank R --slow-pct P] [--hook job|workers|none] [--overrides WORDS]
    python ray_job.py actors --out DIR [--iters N] [--hook job|workers|none] [--attach-rank R] [--bare-actor]

--hook job: ray.init(runtime_env={"worker_process_setup_hook": ...}), every worker of the job;
workers: placement.integrations.ray.worker_runtime_env() for Ray Train's workers
(RunConfig(worker_runtime_env=...)) or the actors (.options(runtime_env=...)) only.

A local Ray cluster of 2 CPUs (ray.init(num_cpus=2)); Ray Train's TorchTrainer with 2 CPU
workers on gloo (DDP, a DataLoader with W workers), or 2 actors of num_cpus=1 stepping an
optimizer each. Every worker writes DIR/worker<R>.json: its pid, its training thread's tid, the
CPUs /proc says that thread and the process's main thread may run on, what placement planned
(share, main role) and its step times. The driver's last line is one JSON object.
"""
import argparse
import json
import os
import statistics
import sys
import threading
import time

HOOK = "placement.integrations.ray.setup"
FEATURES = 32


def allowed(tid):
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return None


def planned():
    """What placement planned for this worker, when it placed it (read, never imported first)."""
    session = sys.modules.get("placement.bind.session")
    s = None if session is None else session.current()
    if s is None:
        return None
    from placement.roles import ThreadRole

    return {"share": sorted(s.rank_plan.share()), "main": sorted(s.rank_plan.cpus(ThreadRole.MAIN)),
            "local_rank": s.identity.local_rank, "rank": s.identity.rank}


def busy(ms):
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


WARM_STEPS = 20  # steps before a slowed worker is slowed: its own step time is measured over them


def train_steps(rank, iters, work_ms, loader_workers, model, opt, out, extra=None, slow_pct=0.0):
    """slow_pct: from step WARM_STEPS on, wait this share of the median step before each step's
    forward (so the worker comes late to the backward's all-reduce): a slowdown relative to what a
    step takes on this host now, busy or quiet."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(iters * 4, FEATURES, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, num_workers=loader_workers)
    times, seen, delay_s = [], None, 0.0
    t_prev = time.perf_counter()
    for i, (xb, yb) in enumerate(data):
        if slow_pct and i == WARM_STEPS:
            delay_s = statistics.median(times[5:]) * slow_pct / 100
        if delay_s:
            time.sleep(delay_s)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        busy(work_ms)
        opt.step()
        opt.zero_grad()
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
        if i == 5:  # after the first optimizer step: the thread stepping it is the rank's main
            seen = {"thread": allowed(threading.get_native_id()), "process_main": allowed(os.getpid())}
    record = {"rank": rank, "pid": os.getpid(), "tid": threading.get_native_id(),
              "is_process_main": threading.current_thread() is threading.main_thread(),
              "allowed": seen, "planned": planned(), "median_step_s": statistics.median(times[5:]),
              "steps": len(times), "delay_ms": delay_s * 1e3, **(extra or {})}
    with open(os.path.join(out, f"worker{rank}.json"), "w") as f:
        json.dump(record, f)
    return record


def train_loop(config):
    import torch
    import torch.distributed as dist
    import ray.train.torch

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(),
                                                              torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train_steps(rank, config["iters"], config["work_ms"], config["loader_workers"], model, opt, config["out"],
                {"env_rank": os.environ.get("RANK")}, config["slow_pct"] if rank == config["slow_rank"] else 0.0)


def runtime_env(args, level):
    """The runtime env for the job (level "job") or for the training workers ("workers")."""
    env = {"env_vars": {"PLACEMENT_OVERRIDES": args.overrides}} if args.overrides else {}
    if args.hook != level:
        return env
    if level == "job":
        return {**env, "worker_process_setup_hook": HOOK}
    from placement.integrations.ray import worker_runtime_env

    return worker_runtime_env(**env)


def trainer(args):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    config = {"iters": args.iters, "work_ms": args.work_ms, "slow_rank": args.slow_rank, "slow_pct": args.slow_pct,
              "loader_workers": args.workers, "out": args.out}
    t0 = time.perf_counter()
    TorchTrainer(train_loop, train_loop_config=config,
                 scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                 run_config=RunConfig(storage_path=os.path.join(args.out, "ray_results"), name="placement",
                                      worker_runtime_env=runtime_env(args, "workers"))).fit()
    return time.perf_counter() - t0


def actors(args):
    import ray

    @ray.remote(num_cpus=1)
    class Learner:
        """An RL framework's learner as such frameworks write one: torch imported in the actor."""

        def __init__(self, rank):
            import torch

            self.rank = rank
            torch.manual_seed(0)
            self.model = torch.nn.Linear(FEATURES, 1)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)

        def train(self, iters, work_ms, out, attach):
            handle = None
            if attach:  # the framework calls placement.attach() itself: one monitor a process
                import placement

                handle = placement.attach(self.model, self.opt)
            record = train_steps(self.rank, iters, work_ms, 0, self.model, self.opt, out)
            if handle is not None:
                handle.close()
            return record

    group = [Learner.options(runtime_env=runtime_env(args, "workers")).remote(r) for r in range(2)]
    if args.bare_actor:  # one more, given no hook: Ray's own worker, untouched
        group.append(Learner.remote(2))
    t0 = time.perf_counter()
    records = ray.get([a.train.remote(args.iters, args.work_ms, args.out, r == args.attach_rank)
                       for r, a in enumerate(group)], timeout=600)
    elapsed = time.perf_counter() - t0
    # Ended as Ray ends an actor gracefully (exit handlers run: the automatic monitor writes its last
    # steps); ray.shutdown() alone may kill a worker before its handlers ran on a busy host.
    for a in group:
        a.__ray_terminate__.remote()
    deadline = time.monotonic() + 120
    for pid in (r["pid"] for r in records):
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.05)
    return elapsed


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["trainer", "actors"])
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per Ray Train worker")
    p.add_argument("--work-ms", type=float, default=2.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-pct", type=float, default=0.0, help="the slow rank's steps take this much longer")
    p.add_argument("--hook", choices=["job", "workers", "none"], default="job")
    p.add_argument("--attach-rank", type=int, default=-1, help="this actor calls placement.attach() itself")
    p.add_argument("--bare-actor", action="store_true", help="a third actor, given no hook (Ray gets 3 CPUs)")
    p.add_argument("--overrides", default="", help="PLACEMENT_OVERRIDES for the workers")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import ray

    ray.init(num_cpus=3 if args.bare_actor else 2, include_dashboard=False, log_to_driver=True,
             runtime_env=runtime_env(args, "job"))
    try:
        elapsed = trainer(args) if args.what == "trainer" else actors(args)
    finally:
        ray.shutdown()
    workers = {}
    for r in range(3):
        path = os.path.join(args.out, f"worker{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                workers[r] = json.load(f)
    print(json.dumps({"what": args.what, "hook": args.hook, "seconds": round(elapsed, 2),
                      "median_step_ms": {r: round(w["median_step_s"] * 1e3, 3) for r, w in workers.items()}}))


if __name__ == "__main__":
    main()
