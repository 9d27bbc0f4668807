"""Where the monitor thread's CPU goes, part by part, and what a wake-up costs on this machine.

What
    The ~10 ms CPU loop of benchmarks/monitor_overhead.py with placement.attach() (policy none,
    tuner off) and handle.step(), every step monitored. The monitor thread's own CPU clock is
    read around each of its parts (the hand-over's record building, the span reading of every
    thread, the thread-list look, the budget's judgement, a counter reading, the stall watch):
    us of that thread's CPU per training step, and per call. What no part holds is the loop
    itself: waking up, waiting for work.
    Then this machine's primitives, timed on a second thread while the first spins in Python
    (as a training loop keeps a core busy): a pread of main's schedstat and a read of main's CPU
    clock, warm (back to back) and cold (after a 10 ms sleep), and the CPU one timed sleep and
    wake-up costs the sleeping thread. On a nested-virtualised VM the cold reads and the
    wake-ups, not the Python, set the floor of a thread that wakes every few steps.

Cost
    --quick: 1,500 steps (~20 s) and ~5 s of primitives.

    python benchmarks/monitor_thread.py [--quick] [--handover-min-s S]

Last line: {"monitor_thread_us_per_step": ..., "parts_us_per_step": {...}, "wake_us": ..., ...}
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MONITOR_THREAD = "placement_mon"
# The parts timed, in this order (indented: inside the one above).
LABELS = ("hand-over (all of it)", "  records built and written", "    of which the sinks",
          "      the log (JSONL)", "      observers", "      digest", "  span reading of every thread",
          "  thread list", "  budget", "counter readings", "hang watch", "held steps")


def timed_parts() -> tuple:
    """(owner, attribute) of each part LABELS names, in its order: where that work lives now
    (tests/test_benchmarks.py checks that each still exists)."""
    from placement.monitor import build, step_monitor
    from placement.monitor.health import rank as rank_health
    from placement.monitor.probes import cost, sampled, threads
    from placement.monitor.sinks import base as sinks
    return ((step_monitor.StepMonitor, "_process"), (build.RecordBuilder, "build"),
            (sinks, "write_to_sinks"), (sinks.JsonlSink, "write"), (sinks.ObserverSink, "write"),
            (sinks.DigestSink, "write"), (threads.RoleSampler, "read_span"), (threads.RoleSampler, "refresh"),
            (cost.CostKeeper, "judge_batch"), (sampled.SampledReads, "take"),
            (rank_health.RankHealth, "_watch_hang"), (step_monitor.StepMonitor, "_build_held"))


def parts_run(steps: int, handover_min_s: float | None = None) -> dict:
    import torch

    import placement
    from monitor_overhead import calibrate, make_job, run_block, thread_cpu_ms
    from placement.config import MonitorConfig

    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def timed(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if threading.current_thread().name != MONITOR_THREAD:
                return original(*args, **kwargs)
            c0 = time.thread_time_ns()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] += time.thread_time_ns() - c0
                calls[label] += 1
        setattr(owner, name, wrapper)

    for (owner, name), label in zip(timed_parts(), LABELS):
        timed(owner, name, label)
    torch.set_num_threads(1)
    batch = calibrate()
    model, opt, data = make_job(batch)
    run_block(model, opt, data, 20, data)
    with tempfile.TemporaryDirectory() as d:
        monitor = {"log_dir": d, "summary_every": 0}
        if handover_min_s is not None:
            monitor["handover_min_s"] = handover_min_s
        h = placement.attach(model, policy="none", tune={"enabled": False}, monitor=monitor)
        block = run_block(model, opt, data, steps, h.watch(torch.utils.data.DataLoader(data, batch_size=None)), h.step)
        total_us = thread_cpu_ms(h.monitor.thread) * 1e3
        every, stride = h.monitor.budget.every, h.monitor.hook.stride
        h.close()
    parts = {label.strip(): round(spent[label] / 1e3 / steps, 2) for label in LABELS if label in spent}
    top_level = sum(ns for label, ns in spent.items() if not label.startswith(" "))
    parts["the loop: waking, waiting"] = round((total_us * 1e3 - top_level) / 1e3 / steps, 2)
    per_call = {label.strip(): round(ns / 1e3 / calls[label], 1) for label, ns in spent.items() if calls[label]}
    return {"step_ms": round(statistics.median(block.wall), 3), "probe_every": every,
            "handover_min_s": handover_min_s if handover_min_s is not None else MonitorConfig().handover_min_s, "handover_stride": stride,
            "monitor_thread_us_per_step": round(total_us / steps, 1), "parts_us_per_step": parts,
            "us_per_call": per_call}


def primitives() -> dict:
    """Costs on a second thread while the main thread spins in Python (us of that thread's CPU)."""
    fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
    clock = time.pthread_getcpuclockid(threading.main_thread().ident)
    out: dict = {}

    def median_us(fn, n: int, sleep_s: float = 0.0) -> float:
        xs = []
        for _ in range(n):
            if sleep_s:
                time.sleep(sleep_s)
            c0 = time.thread_time_ns()
            fn()
            xs.append(time.thread_time_ns() - c0)
        return round(statistics.median(xs) / 1e3, 2)

    def measure():
        out["pread_warm_us"] = median_us(lambda: os.pread(fd, 128, 0), 2000)
        out["pread_cold_us"] = median_us(lambda: os.pread(fd, 128, 0), 100, 0.01)
        out["clock_warm_us"] = median_us(lambda: time.clock_gettime_ns(clock), 2000)
        out["clock_cold_us"] = median_us(lambda: time.clock_gettime_ns(clock), 100, 0.01)
        c0 = time.thread_time_ns()
        for _ in range(200):
            time.sleep(0.005)
        out["wake_us"] = round((time.thread_time_ns() - c0) / 200 / 1e3, 2)

    t = threading.Thread(target=measure)
    t.start()
    spins = 0
    while t.is_alive():
        spins += 1
    os.close(fd)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,500 steps")
    ap.add_argument("--handover-min-s", type=float, default=None,
                    help="monitor.handover_min_s for the run (default: the config's; 0: a hand-over at every due step)")
    args = ap.parse_args(argv)
    if args.handover_min_s is not None:
        from placement.config import load_config
        from placement.errors import ConfigError
        try:  # the config's own range, before the minutes of calibration and steps
            load_config([f"monitor.handover_min_s={args.handover_min_s}"])
        except ConfigError as e:
            print(f"monitor_thread: --handover-min-s: {e}", file=sys.stderr)
            return 2
    result = parts_run(1500 if args.quick else 6000, args.handover_min_s)
    print(f"monitor thread: {result['monitor_thread_us_per_step']} us of CPU per ~{result['step_ms']} ms step "
          f"(counters read every {result['probe_every']} steps, a hand-over every "
          f"{result['handover_stride']} flush strides)")
    for label in LABELS + ("the loop: waking, waiting",):
        name = label.strip()
        if name in result["parts_us_per_step"]:
            indent = " " * (len(label) - len(name))
            print(f"  {indent + name:36s} {result['parts_us_per_step'][name]:7.2f} us/step  "
                  f"{result['us_per_call'].get(name, '')!s:>8} us/call")
    prims = primitives()
    print("this machine, on a second thread while main spins (us of its CPU): " +
          ", ".join(f"{k} {v}" for k, v in prims.items()))
    print(json.dumps({**result, **prims}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
