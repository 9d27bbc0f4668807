"""Where the step hook's microseconds go: the training thread's cost per kind of step, timed, and
a sampling profile (py-spy) of the hook and of the monitor thread.

What
    The same ~10 ms CPU training loop as benchmarks/monitor_overhead.py (one intra-op thread,
    batches through handle.watch()), with placement.attach() and handle.step():
    - timed: every step's handle.step() call, timed by the loop around it, and sorted by what
      the hook did at that step: `plain` (a stamp and the comm count), `handover` (a step that
      also hands the batch to the monitor thread). Per kind: how many, median and mean us; the
      monitor's own figure (StepHook.self_ns / steps_timed, what its budget judges by); and
      the monitor thread's CPU per step (its thread clock), of which reading the counters
      (probes/sampled.py).
    - profiled: the loop again in a child process under `py-spy record --rate 5000 --format raw`
      (not in the timed run: py-spy pauses the process to sample it). Of the samples inside
      StepHook.on_step, the share of each of its lines and of each callee (top entries);
      of the monitor thread's samples outside its idle wait, the share of each placement function
      (the innermost one on the stack, with what it calls).
    Without py-spy (`pip install py-spy`, in the dev extra) the profile is null and says why.

Cost
    --quick: about 40 s of CPU, plus the profiled child's.

    python benchmarks/hook_profile.py [--quick]

Last line: {"inside_on_step_us": ..., "plain_us": ..., "handover_us": ..., "probe_every": ...,
"monitor_thread_us_per_step": ..., "readings_us_per_step": ..., "hook_top": [[share_pct, "where"],
...], "monitor_top": [...]}
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

TOP = 8  # entries of each profile printed
IDLE = "StepMonitor._run"  # the monitor thread's wait for work is the line of _run it blocks on


def job(steps: int, timed: bool):
    """attach(), then `steps` steps; with `timed`, each handle.step() timed and sorted by kind."""
    import torch

    import placement
    from monitor_overhead import calibrate, make_job

    torch.set_num_threads(1)
    batch = calibrate()
    model, opt, data = make_job(batch)
    log_dir = tempfile.mkdtemp(prefix="placement-hook-profile-")
    h = placement.attach(model, policy="none", tune={"enabled": False},
                         monitor={"log_dir": log_dir, "summary_every": 0})
    mon = h.monitor
    h.step()  # handle.step takes over from the optimizer hook: from here on it is on_step itself
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    it = iter(h.watch(torch.utils.data.DataLoader(data, batch_size=None)))
    warm = steps // 5
    ns0 = steps0 = 0
    pc = time.perf_counter_ns
    for i in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(h.watch(torch.utils.data.DataLoader(data, batch_size=None)))
            x, y = next(it)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i == warm:
            ns0, steps0 = mon.hook.self_ns, mon.hook.steps_timed
            thread_ns0, read_ns0 = thread_ns(mon), mon._sampled.cost_ns
        if not timed:
            h.step()
            continue
        kind = "handover" if mon.step + 1 >= mon.hook.next_due else "plain"
        t0 = pc()
        h.step()
        t1 = pc()
        if i > warm:
            by_kind[kind].append((t1 - t0) / 1e3)
    counted = max(1, mon.hook.steps_timed - steps0)
    inside = (mon.hook.self_ns - ns0) / counted / 1e3
    by_kind["monitor_thread"] = [(thread_ns(mon) - thread_ns0) / counted / 1e3]
    by_kind["readings"] = [(mon._sampled.cost_ns - read_ns0) / counted / 1e3]
    every = mon.budget.every
    h.close()
    shutil.rmtree(log_dir, ignore_errors=True)
    return inside, every, by_kind


def thread_ns(mon) -> int:
    """The monitor thread's CPU time so far (its thread clock)."""
    from placement.monitor.probes.counters import thread_cpu_clock
    return time.clock_gettime_ns(thread_cpu_clock(mon.thread.native_id))


def profile(steps: int) -> tuple[list, list, str]:
    """(hook top entries, monitor thread top entries, why null) from py-spy over a child run."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(spy):
        return [], [], "py-spy is not installed (pip install py-spy, or the dev extra)"
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "raw.txt")
        cmd = [spy, "record", "--rate", "5000", "--format", "raw", "--output", out, "--",
               sys.executable, __file__, "--child", str(steps)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if p.returncode != 0 or not os.path.exists(out):
            tail = (p.stderr.strip().splitlines() or ["?"])[-1]
            return [], [], f"py-spy could not sample the child (rc {p.returncode}: {tail})"
        hook: collections.Counter = collections.Counter()
        mon: collections.Counter = collections.Counter()
        with open(out) as f:
            for line in f:
                stack, _, n = line.rstrip("\n").rpartition(" ")
                frames, count = stack.split(";"), int(n)
                at = next((i for i, fr in enumerate(frames) if fr.startswith("StepHook.on_step ")), None)
                if at is not None:
                    # the hook's own line, or the first frame it called (where the time went)
                    inner = frames[at + 1:at + 3]
                    hook[" > ".join(_short(fr) for fr in inner) or _short(frames[at])] += count
                    continue
                run = next((i for i, fr in enumerate(frames) if fr.startswith(IDLE + " ")), None)
                if run is not None and run + 1 < len(frames):  # below _run: work, not the wait
                    # the innermost placement function: where the thread's time goes, with what it calls
                    own = [fr for fr in frames[run + 1:] if "placement/" in fr]
                    mon[_function(own[-1]) if own else _function(frames[-1])] += count
    return _top(hook), _top(mon), ""


def _short(frame: str) -> str:
    """'f (placement/monitor/x.py:12)' from py-spy's 'f (/path/to/placement/monitor/x.py:12)'."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    for root in (str(REPO) + "/", "site-packages/"):
        if root in where:
            where = where.split(root, 1)[1]
    return f"{name} ({where})"


def _function(frame: str) -> str:
    """_short without the line number: a function's samples added up."""
    short = _short(frame)
    return short.rsplit(":", 1)[0] + ")" if ":" in short else short


def _top(counts: collections.Counter) -> list:
    total = sum(counts.values())
    return [[round(100.0 * n / total, 1), k] for k, n in counts.most_common(TOP)] if total else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (about a minute)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        job(args.child, timed=False)
        return 0
    steps = 2000 if args.quick else 10000
    inside, every, by_kind = job(steps, timed=True)
    print(f"steps {steps}, probe every {every}; the monitor's own figure: {inside:.1f} us per step inside on_step")
    print(f"  {'kind':10s} {'steps':>6s} {'median us':>10s} {'mean us':>9s}")
    out: dict = {"inside_on_step_us": round(inside, 2)}
    for kind in ("plain", "handover"):
        v = by_kind.get(kind, [])
        med = round(statistics.median(v), 2) if v else None
        mean = round(statistics.mean(v), 2) if v else None
        print(f"  {kind:10s} {len(v):6d} {med if med is not None else '-':>10} {mean if mean is not None else '-':>9}")
        out[f"{kind}_us"] = med
        out[f"{kind}_mean_us"] = mean
    out["probe_every"] = every
    out["monitor_thread_us_per_step"] = round(by_kind["monitor_thread"][0], 2)
    out["readings_us_per_step"] = round(by_kind["readings"][0], 2)
    print(f"the monitor thread: {out['monitor_thread_us_per_step']} us of CPU per step, "
          f"{out['readings_us_per_step']} of them reading the counters")
    hook, mon, why = profile(steps)
    if why:
        print(f"profile: null ({why})")
        out.update(hook_top=None, monitor_top=None, profile_null=why)
    else:
        print("inside the step hook (share of its samples):")
        for pct, where in hook:
            print(f"  {pct:5.1f}%  {where}")
        print("the monitor thread, outside its wait (share of its samples):")
        for pct, where in mon:
            print(f"  {pct:5.1f}%  {where}")
        out.update(hook_top=hook, monitor_top=mon)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
