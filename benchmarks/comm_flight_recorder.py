"""What reading torch's flight recorder costs the training thread, measured on torch's own
recorder on CPU (gloo records into FlightRecorder<c10::Event>; the NCCL one,
FlightRecorder<at::cuda::CUDAEvent>, is the same template, FlightRecorderDetail.hpp) at the
ring size placement uses: torch's default 2000 records (TORCH_FR_BUFFER_SIZE /
TORCH_NCCL_TRACE_BUFFER_SIZE), filled, as in any long job.

For each route (`server`: torch's control-plane worker server formats the dump on its C++
thread; `binding`: _dump_fr_trace_json), a dump on a side thread (as placement_mon does) while the main thread spins
through small steps, as a training loop would, timing:
- dump_ms: the dump's own wall time;
- main_stall_ms: the main thread's longest wait during it (the GIL held by the dump);
- then the incremental read of the entries a poll finds new (`--new`, default 200: 20 steps of
  10 collectives) with the GIL: parse_ms.
The per-step figure: GIL ms per poll / steps per poll (monitor.flush_every = 20), and the
share of a `--step-ms` step it is against monitor.budget_pct (0.3%).

    python benchmarks/comm_flight_recorder.py [--quick] [--ring 2000] [--new 200] [--step-ms 100]
Last line, one JSON object.
"""
import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, socket, statistics, sys, threading, time
import torch, torch.distributed as dist
from placement.monitor.comm.flight_recorder import RingReader, dump_sources
ring, new, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
t = torch.ones(1024)
for _ in range(ring + 10):
    dist.all_reduce(t)

def stall_during(fn):
    out, gaps = {}, []
    def run():
        t0 = time.perf_counter(); out["v"] = fn(); out["ms"] = (time.perf_counter() - t0) * 1e3
    th = threading.Thread(target=run, name="placement_mon")
    last = time.perf_counter(); th.start()
    while th.is_alive():
        x = sum(range(50))  # a small step of Python work, as main does between GIL checks
        now = time.perf_counter(); gaps.append(now - last); last = now
    th.join()
    return out["v"], out["ms"], max(gaps) * 1e3

result = {}
for source in dump_sources():
    if source.recorder != "generic":
        continue
    dumps, stalls, parses = [], [], []
    source.dump()  # warm: the first dump and parse of a process pay for memory it gets once
    for _ in range(reps):
        reader = RingReader(prefix="gloo:")
        text, ms, stall = stall_during(source.dump)
        reader.read(text)  # everything before this poll was read by earlier polls
        for _ in range(new):
            dist.all_reduce(t)
        text, ms, stall = stall_during(source.dump)
        t0 = time.perf_counter(); got = reader.read(text); parse = (time.perf_counter() - t0) * 1e3
        assert len(got.entries) == new, (len(got.entries), new)
        dumps.append(ms); stalls.append(stall); parses.append(parse)
    source.close()
    result[source.route] = {"dump_ms": round(statistics.median(dumps), 2),
                            "main_stall_ms": round(statistics.median(stalls), 2),
                            "parse_ms": round(statistics.median(parses), 2)}
print(json.dumps(result))
dist.destroy_process_group()
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 repetitions (under a minute)")
    p.add_argument("--ring", type=int, default=2000, help="flight-recorder ring size (torch's default 2000)")
    p.add_argument("--new", type=int, default=200, help="records new at each poll (default 200)")
    p.add_argument("--step-ms", type=float, default=100.0, help="step time the per-step share is given for")
    p.add_argument("--flush-every", type=int, default=20, help="steps between polls (monitor.flush_every)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 7, --quick 3)")
    args = p.parse_args()
    reps = args.reps or (3 if args.quick else 7)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE=str(args.ring),
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHILD, str(args.ring), str(args.new), str(reps)], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return 1
    routes = json.loads(out.stdout.strip().splitlines()[-1])
    budget_ms = 0.3 / 100 * args.step_ms
    print(f"flight recorder, ring {args.ring}, {args.new} new records per poll, a poll every {args.flush_every} steps")
    print(f"{'route':<8} {'dump ms':>8} {'main stall ms':>14} {'parse ms':>9} {'GIL ms/poll':>12} {'us/step':>8} "
          f"{'% of ' + str(args.step_ms) + ' ms':>10}")
    summary = {"ring": args.ring, "new_per_poll": args.new, "steps_per_poll": args.flush_every,
               "step_ms": args.step_ms}
    for route, r in routes.items():
        gil = (r["main_stall_ms"] if route == "server" else r["dump_ms"]) + r["parse_ms"]
        per_step_us = gil / args.flush_every * 1e3
        pct = per_step_us / 1e3 / args.step_ms * 100
        print(f"{route:<8} {r['dump_ms']:>8.2f} {r['main_stall_ms']:>14.2f} {r['parse_ms']:>9.2f} {gil:>12.2f} "
              f"{per_step_us:>8.1f} {pct:>9.3f}%")
        summary[route] = dict(r, gil_ms_per_poll=round(gil, 2), us_per_step=round(per_step_us, 1),
                              pct_of_step=round(pct, 3), within_budget=gil / args.flush_every <= budget_ms)
    summary["settle"] = settle_cases(args.quick)
    for case, r in summary["settle"].items():
        print(f"against the stand-in's truth, {case}: short {r['short_pct']}%, null {r['null_pct']}% "
              f"(steady state, the last steps at exit left out), dump {r['dump_ms']} ms")
    summary["settle_met"] = all(r["short_pct"] == 0 and r["null_pct"] <= 1 for r in summary["settle"].values())
    print(json.dumps(summary))
    return 0


# (step ms, steps, GPU queue steps behind the CPU): --quick, full
SETTLE_CASES = {"2ms": (2.0, (500, 2000), 0), "20ms": (20.0, (100, 300), 0), "500ms": (500.0, (8, 20), 0),
                "20ms-gpu-3-behind": (20.0, (100, 300), 3)}


def settle_cases(quick: bool) -> dict:
    """Comm time through the real monitor against the truth of tests/nccl_recorder_standins.StandInRecorder
    (upstream's cadence: durations written by a watchdog every 100 ms, dumps of copies showing
    completed before that, a GPU queue behind the CPU). short_pct: steps whose comm time is below
    the truth; null_pct: null steps, leaving out those the exit cut (the GPU's lag and one
    watchdog period plus EXIT_SETTLE_S); dump_ms: the stand-in's dump per poll."""
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from nccl_recorder_standins import run_standin_job

    out = {}
    for case, (step_ms, (quick_steps, full_steps), lag) in SETTLE_CASES.items():
        steps = quick_steps if quick else full_steps
        with tempfile.TemporaryDirectory() as d:
            job = run_standin_job(d, step_ms=step_ms, steps=steps, gpu_lag_steps=lag)
        steady = steps - (lag + 1 + int(100 / step_ms) + 1)
        out[case] = {"steps": steps, "short_pct": round(100 * len(job.short()) / steps, 2),
                     "wrong_pct": round(100 * len(job.wrong()) / steps, 2),
                     "null_pct": round(100 * len(job.nulls(last=steady)) / max(1, steady), 2),
                     "null_at_exit": len(job.nulls()) - len(job.nulls(last=steady)),
                     "dump_ms": job.stats.get("dump_ms_per_poll"), "polls": job.stats.get("polls")}
    return out


if __name__ == "__main__":
    sys.exit(main())
