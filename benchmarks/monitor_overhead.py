"""What the step monitor costs a real training loop: monitor off, a bare floor hook, and the monitor on, interleaved.

A small MLP trained on CPU (one intra-op thread), batch sized so a step takes about
10 ms, runs in rounds; each round runs one 40-step block of each arm, in rotating order:
- off, off2: no hook at all (two of them: their difference is this machine's noise);
- floor: a bare step hook doing only the two kernel reads a per-step record of main needs
  (its thread CPU clock and one pread of its schedstat) and an append: what any per-step
  monitor pays on this machine;
- on: placement.attach with its default settings (binding and tuning off, so all arms
  see the same cores), attached once and marking its steps with handle.step() in the on
  blocks only, so it runs as in a long job (its probe budget settles in the first batch);
- auto: the same monitor, its steps marked by placerun's automatic hooks instead (placement/auto:
  torch's global optimizer post-step hook, the DataLoader iterator's __next__), put in for the
  auto blocks only. Every arm fetches its batches through a DataLoader (batch_size=None, no
  workers), so the hooks' work on a fetch is measured where it happens.

Printed, per arm: step time quantiles and
- auto us: the automatic hooks' cost on the training thread, inside optimizer.step() and the
  fetch, minus off's time in the same two calls; auto_vs_attach, that over on's
  overhead_us_per_step (same loop, same run).
- in hook us: the wall time of the arm's step-hook call, timed by the loop around the call
  on every step, minus the same timing around no call in the off arm. With the time
  handle.watch() adds to fetching a batch (on's next() minus off's), what the training
  thread pays directly: the headline overhead_us_per_step.
- the monitor thread's CPU per step (its own clock): the records are built there.
- added wall / added CPU: the arm's median per-round difference from `off` of the block
  medians of step wall time / of the training thread's CPU time per step, with their
  resolution: the 95% band of the same estimate for off2 - off, two arms that differ in
  nothing (this VM's other tenants move step times by more than the hook costs; these
  say whether anything beyond the hook shows).
And what each probe primitive costs warm, and how often the monitor read the counters.

    python benchmarks/monitor_overhead.py [--quick] [--metrics]

Last line: {"step_ms": ..., "overhead_us_per_step": ..., "overhead_pct": ..., ...}
(target: overhead_us_per_step <= 30 us and <= 0.3% of a 10 ms step; floor_hook_us says
what the least per-step monitor pays here).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time

import torch

import placement
from placement.auto import AutoMonitor
from placement.monitor.probes.counters import thread_cpu_clock

TARGET_MS = 10.0
ARMS = ("off", "off2", "floor", "on", "auto")


def make_job(batch: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = [(torch.randn(batch, 512), torch.randint(0, 10, (batch,))) for _ in range(8)]
    return model, opt, data


class Block:
    """Per-step wall and training-thread CPU ms of one block, and the us its next() calls took."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.next_us: list[float] = []  # fetching the batch: through handle.watch() in the on arm
        self.hook_us: list[float] = []  # the arm's end_step() call (none in off), timed by the caller
        self.opt_us: list[float] = []  # optimizer.step(): the automatic hooks' fire runs inside it


def run_block(model, opt, data, steps: int, source, end_step=None) -> Block:
    """A step = next batch + forward/backward + optimizer step (+ end_step(), the arm's hook)."""
    b = Block()
    it = iter(source)
    for _ in range(steps):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(source)
            x, y = next(it)
        b.next_us.append((time.perf_counter_ns() - t0) / 1e3)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t_opt = time.perf_counter_ns()
        opt.step()
        t1 = time.perf_counter_ns()
        b.opt_us.append((t1 - t_opt) / 1e3)  # timed in every arm: the off arms' figure is the timing's own cost
        if end_step is not None:
            end_step()
        b.hook_us.append((time.perf_counter_ns() - t1) / 1e3)
        b.wall.append((time.perf_counter_ns() - t0) / 1e6)
        b.cpu.append((time.thread_time_ns() - c0) / 1e6)
    return b


class FloorHook:
    """The least a per-step monitor does: main's thread CPU clock, one pread of its
    schedstat, an append. Its own time is kept like StepHook.self_ns (monitor/hook.py)."""

    def __init__(self):
        self.fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        self.raw: list[tuple[int, int, bytes]] = []
        self.self_ns = 0

    def __call__(self):
        t0 = time.perf_counter_ns()
        self.raw.append((t0, time.thread_time_ns(), os.pread(self.fd, 128, 0)))
        self.self_ns += time.perf_counter_ns() - t0

    def close(self) -> None:
        os.close(self.fd)


def calibrate() -> int:
    batch = 64
    for _ in range(6):
        model, opt, data = make_job(batch)
        run_block(model, opt, data, 5, data)
        ms = statistics.median(run_block(model, opt, data, 15, data).wall)
        if abs(ms - TARGET_MS) / TARGET_MS < 0.1:
            break
        batch = max(8, int(batch * TARGET_MS / ms))
    return batch


def probe_costs() -> dict[str, float]:
    """Microseconds per call of each primitive the per-step path uses (10000 calls each)."""
    from placement.monitor.probes.counters import current_cpu

    tid = threading.get_native_id()
    fds = {n: os.open(f"/proc/self/task/{tid}/{n}", os.O_RDONLY) for n in ("schedstat", "stat", "status")}
    calls = {
        "pread schedstat": lambda: os.pread(fds["schedstat"], 128, 0),
        "pread stat": lambda: os.pread(fds["stat"], 2048, 0),
        "pread status": lambda: os.pread(fds["status"], 8192, 0),
        "thread CPU clock": time.thread_time_ns,
        "getrusage(THREAD)": lambda: resource.getrusage(resource.RUSAGE_THREAD),
    }
    if current_cpu is not None:
        calls["sched_getcpu"] = current_cpu
    out = {}
    for name, fn in calls.items():
        n = 10000
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter_ns() - t0) / n / 1e3
    for fd in fds.values():
        os.close(fd)
    return out


def thread_cpu_ms(thread) -> float:
    """On-CPU ms of a live thread of this process so far (its kernel CPU clock)."""
    if thread is None:
        return 0.0
    return time.clock_gettime_ns(thread_cpu_clock(thread.native_id)) / 1e6


def round_diffs_us(blocks: dict[str, list[Block]], arm: str, field: str) -> list[float]:
    """Per round: block median of `arm` minus block median of off, in us."""
    return [1e3 * (statistics.median(getattr(a, field)) - statistics.median(getattr(o, field)))
            for a, o in zip(blocks[arm], blocks["off"])]


def standard_error_of_median(xs: list[float]) -> float:
    """From the median absolute deviation (robust to this VM's bursts): 1.2533 sigma / sqrt(n)."""
    med = statistics.median(xs)
    sigma = 1.4826 * statistics.median(abs(x - med) for x in xs)
    return 1.2533 * sigma / len(xs) ** 0.5


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (< 1 minute)")
    ap.add_argument("--metrics", action="store_true",
                    help="with the live metrics on (a textfile written every second): the hook must not change")
    args = ap.parse_args(argv)
    rounds, steps = (22, 40) if args.quick else (100, 40)
    torch.set_num_threads(1)
    batch = calibrate()
    model, opt, data = make_job(batch)
    run_block(model, opt, data, 20, data)  # warm up allocator and caches
    log_dir = tempfile.mkdtemp(prefix="placement-overhead-")
    h = placement.attach(model, policy="none", tune={"enabled": False},
                         monitor={"log_dir": log_dir, "summary_every": 0},
                         metrics={"textfile_dir": log_dir} if args.metrics else {})
    loader = torch.utils.data.DataLoader(data, batch_size=None)  # every arm fetches through a DataLoader
    watched = h.watch(loader)
    floor = FloorHook()
    auto = AutoMonitor(session=None)  # placerun's automatic hooks, driving h's monitor in the auto blocks
    auto.adopt(h, id(opt))
    blocks: dict[str, list[Block]] = {a: [] for a in ARMS}
    inside_ns = {"on": 0, "auto": 0}  # the monitor's own count of its time inside on_step, for comparison
    for i in range(rounds):
        k = i % len(ARMS)
        for arm in ARMS[k:] + ARMS[:k]:  # rotate which arm goes first
            if arm in ("off", "off2"):
                blocks[arm].append(run_block(model, opt, data, steps, loader))
            elif arm == "floor":
                blocks[arm].append(run_block(model, opt, data, steps, loader, floor))
            elif arm == "on":
                ns0 = h.monitor.hook.self_ns
                blocks[arm].append(run_block(model, opt, data, steps, watched, h.step))
                inside_ns[arm] += h.monitor.hook.self_ns - ns0
            else:
                ns0 = h.monitor.hook.self_ns
                auto.hook()
                blocks[arm].append(run_block(model, opt, data, steps, loader))
                auto.unhook()
                inside_ns[arm] += h.monitor.hook.self_ns - ns0
    probe_every = h.monitor.budget.every
    monitor_cpu_ms = thread_cpu_ms(h.monitor.thread)
    h.close()
    floor.close()
    # The caller's two clock reads around the hook cost a few us themselves right after a step
    # (cold): the same reads around nothing, in the off arm, are subtracted.
    empty_us = statistics.mean(u for b in blocks["off"] for u in b.hook_us)
    hook = {a: statistics.mean(u for b in blocks[a] for u in b.hook_us) - empty_us for a in ("floor", "on")}
    inside_us = inside_ns["on"] / 1e3 / (rounds * steps)
    auto_inside_us = inside_ns["auto"] / 1e3 / (rounds * steps)
    flat = {a: [ms for b in blocks[a] for ms in b.wall] for a in ARMS}
    step_ms = statistics.median(flat["off"])
    on_steps = 2 * rounds * steps  # the on and auto blocks' steps, both monitored
    monitor_us = 1e3 * monitor_cpu_ms / on_steps  # the monitor thread's CPU per step it monitored
    # handle.watch() runs on the training thread too: its cost is on's next() minus off's.
    watch_us = statistics.mean(u for b in blocks["on"] for u in b.next_us) - \
        statistics.mean(u for b in blocks["off"] for u in b.next_us)
    training_us = hook["on"] + max(0.0, watch_us)

    def mean_us(arm: str, field: str) -> float:
        return statistics.mean(u for b in blocks[arm] for u in getattr(b, field))

    # The automatic hooks run inside optimizer.step() (the fire) and the fetch: auto's time in both
    # minus off's.
    auto_us = mean_us("auto", "opt_us") - mean_us("off", "opt_us") + mean_us("auto", "next_us") - \
        mean_us("off", "next_us") + mean_us("auto", "hook_us") - empty_us
    added_wall = {a: statistics.median(round_diffs_us(blocks, a, "wall")) for a in ARMS[1:]}
    added_cpu = {a: statistics.median(round_diffs_us(blocks, a, "cpu")) for a in ARMS[1:]}
    # Resolution: the standard error of the same estimate between two arms that differ in
    # nothing (off2 - off), two-sided 95%.
    resolution = {f: 1.96 * standard_error_of_median(round_diffs_us(blocks, "off2", f)) for f in ("wall", "cpu")}
    print(f"monitor overhead: batch {batch}, {rounds} rounds of one {steps}-step block per arm, 1 intra-op thread, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print(f"{'arm':6s} {'steps':>6s} {'p50 ms':>8s} {'p99 ms':>8s} {'in hook us':>11s} "
          f"{'added wall us':>14s} {'added CPU us':>13s}")
    for a in ARMS:
        v = sorted(flat[a])
        print(f"{a:6s} {len(v):6d} {statistics.median(v):8.3f} {v[int(0.99 * (len(v) - 1))]:8.3f} "
              f"{f'{hook[a]:.1f}' if a in hook else '':>11s} "
              f"{'' if a == 'off' else f'{added_wall[a]:.1f}':>14s} {'' if a == 'off' else f'{added_cpu[a]:.1f}':>13s}")
    print(f"\non the training thread per step: {hook['on']:.1f} us in handle.step() (of which {inside_us:.1f} us "
          f"inside on_step, as the monitor counts itself) + {watch_us:.1f} us more in handle.watch() = "
          f"{training_us:.1f} us ({100 * training_us / 1e3 / step_ms:.3f}% of the step); kernel counters read "
          f"every {probe_every} step(s) (monitor.budget_pct={h.config.monitor.budget_pct})")
    print(f"with placerun's automatic hooks instead (same monitor): {auto_us:.1f} us per step in optimizer.step() "
          f"and the fetch (of which {auto_inside_us:.1f} us inside on_step) = "
          f"{auto_us / training_us if training_us > 0 else float('nan'):.2f}x attach()'s")
    print(f"on the monitor thread (placement_mon): {monitor_us:.1f} us CPU per step (records built, encoded, "
          f"written and delivered there, on a core of the rank's `other` set)")
    print(f"added: median over rounds of the arm's block median minus off's; resolution (95%, from off2 - off): "
          f"wall +-{resolution['wall']:.0f} us, CPU +-{resolution['cpu']:.0f} us")
    print("\nprobe primitives here, warm (us per call):")
    costs = probe_costs()
    for name, us in costs.items():
        print(f"  {name:20s} {us:6.2f}")
    print(json.dumps({"metrics": args.metrics, "step_ms": round(step_ms, 3), "overhead_us_per_step": round(training_us, 1),
                      "overhead_pct": round(100 * training_us / 1e3 / step_ms, 3), "probe_every": probe_every,
                      "hook_us": round(hook["on"], 1), "watch_us": round(watch_us, 1),
                      "inside_on_step_us": round(inside_us, 1),
                      "auto_us": round(auto_us, 1), "auto_inside_on_step_us": round(auto_inside_us, 1),
                      "auto_vs_attach": round(auto_us / training_us, 2) if training_us > 0 else None,
                      "monitor_thread_us_per_step": round(monitor_us, 1),
                      "added_wall_us": round(added_wall["on"], 1), "added_cpu_us": round(added_cpu["on"], 1),
                      "resolution_wall_us": round(resolution["wall"], 1),
                      "resolution_cpu_us": round(resolution["cpu"], 1),
                      "floor_hook_us": round(hook["floor"], 1),
                      "pread_schedstat_us": round(costs["pread schedstat"], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
