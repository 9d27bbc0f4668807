"""One command that checks placement on a GPU node in about six minutes, and writes its evidence.

Sections (each bounded; one that fails or runs out of time is recorded with its reason and the
rest run on):
  machine     `placement topo|plan|doctor --json`: the GPU's NUMA node and CPUs, NICs, perf ranks,
              what doctor flags.
  selftest    `placement selftest --json` on the real GPU (skipped, with its reason, without one).
  comm        a one-rank job under placerun (benchmarks/gpu_check_job.py comm: all-reduces of 4 KB
              to 256 MB between compute kernels, 2-50 ms steps) with NCCL timing `auto`, with
              TORCH_NCCL_ENABLE_TIMING=0 and with CUDA_DEVICE_MAX_CONNECTIONS=1; placement's comm_ms
              of each step against the job's own CUDA events around each collective (the truth):
              short_pct, over_pct, null_pct, median error, and the line that says why where null.
  throughput  a launch-bound loop with CPU-heavy DataLoader workers under `torchrun`, `torchrun
              --numa-binding=node` and `placerun`, alternated (ABC ABC ...), with background
              spinners on most cores and without: steps/s each, placerun's ratios.
  cost        a ~10 ms GPU step under placerun: monitor off, attach(), the automatic monitor,
              alternated; us per step against monitor off, and the monitor's own figure.

`--cpu` runs the same on gloo and CPU tensors (comm: one variant, wall-time truth), so the suite
runs `--cpu --quick` and the script cannot rot between GPU days. Evidence goes to $OUT when set,
else to a directory it prints: gpu_check.json (all of it), summary.txt, logs.tar.gz (rank logs,
each command's output). docs/benchmarks.md lists the keys and targets; docs/development.md says how
to run it on a GPU node without network.

    python benchmarks/gpu_check.py                  # a GPU node, ~6 minutes
    python benchmarks/gpu_check.py --cpu --quick    # anywhere, ~1 minute
Last line: one JSON object (the headline figures).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
JOB = str(REPO / "benchmarks" / "gpu_check_job.py")
PLACERUN = [sys.executable, "-m", "placement.launcher"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
CLI = [sys.executable, "-m", "placement.cli"]
# What a caller's shell may carry that would change what is measured.
CLEAN = ("PLACEMENT_", "OMP_NUM_THREADS", "TORCH_NCCL_ENABLE_TIMING", "NCCL_ENABLE_TIMING",
         "CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
WARMUP_STEPS = 5  # steps left out of the comm comparison (communicator set-up, first kernels)
SHORT_FRACTION = 0.20  # placement's comm_ms is short when below the truth by more than this share ...
SHORT_FLOOR_MS = 0.025  # ... or this much per collective, whichever is larger (event gaps on 4 KB ops)


class Run:
    """One gpu_check run: its evidence directory, its clock, the commands it ran."""

    def __init__(self, out: Path, budget_s: float, cpu: bool, quick: bool, ablation=None, rounds: int = 0):
        self.out, self.cpu, self.quick = out, cpu, quick
        self.ablation = tuple(ablation or ABLATION_DEFAULT)  # the ablation section's rows
        self.rounds = rounds  # rounds of the throughput, ablation and cost sections (0: their default)
        # Logs and job outputs live beside, not in, the evidence directory: $OUT brings back only a
        # few files, so they travel as logs.tar.gz.
        self.logs = Path(tempfile.mkdtemp(prefix="gpu_check-logs-"))
        self.t0 = time.monotonic()
        self.budget_s = budget_s
        self.result: dict = {"benchmark": "gpu_check", "schema": "placement.gpu_check/1", "cpu": cpu,
                             "quick": quick, "sections": {}}
        self.n = 0

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def env(self, **extra: str) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN)}
        root = str(REPO)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra)
        return env

    def run(self, name: str, argv: list[str], timeout_s: float, env: Optional[dict] = None) -> dict:
        """Run one command in its own session (a timeout kills the launcher and its workers);
        its output goes to logs/<n>-<name>.txt."""
        self.n += 1
        timeout_s = max(5.0, min(timeout_s, self.left_s()))
        t0 = time.monotonic()
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO),
                             env=env if env is not None else self.env(), start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout_s)
            rc: Optional[int] = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            rc = None
        wall = time.monotonic() - t0
        with open(self.logs / f"{self.n:02d}-{name}.txt", "w") as f:
            f.write(f"$ {' '.join(argv)}\n# rc {rc}, {wall:.1f} s\n--- stdout\n{out}\n--- stderr\n{err}\n")
        return {"rc": rc, "stdout": out, "stderr": err, "wall_s": round(wall, 1),
                "why": None if rc == 0 else f"timed out after {timeout_s:.0f} s" if rc is None
                else f"exit {rc}: {last_line(err)}"}

    def save(self) -> None:
        self.result["wall_s"] = round(time.monotonic() - self.t0, 1)
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.out / "gpu_check.json")
        (self.out / "summary.txt").write_text(summary(self.result))


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return (errors or lines or ["(no output)"])[-1][:300]


def json_of(res: dict) -> Optional[dict]:
    text = (res.get("stdout") or "").strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def read_log(path: Path) -> tuple[dict, list[dict], dict]:
    """A rank log's monitor start event, step records (by step) and end event."""
    start, steps, end = {}, [], {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            kind, source = rec.get("type"), rec.get("source")
            if kind == "step":
                steps.append(rec)
            elif kind == "start" and source == "monitor":
                start = rec
            elif kind == "end" and source == "monitor":
                end = rec
    return start, sorted(steps, key=lambda r: r["step"]), end


# --- machine ---------------------------------------------------------------------------------

def machine(c: Run) -> dict:
    got: dict = {}
    for what, argv in (("topo", ["topo", "--json"]), ("plan", ["plan", "--nproc-per-node", "1", "--json"]),
                       ("doctor", ["doctor", "--json"])):
        res = c.run(what, CLI + argv, 60)
        doc = json_of(res)  # doctor exits 1 when a check warns: its JSON is still the evidence
        got[what] = doc if doc is not None else {"error": res["why"] or "no JSON on stdout"}
        (c.logs / f"{what}.json").write_text(json.dumps(got[what], indent=1))
    topo, plan, doctor = got["topo"], got["plan"], got["doctor"]
    out: dict = {"errors": {k: v["error"] for k, v in got.items() if "error" in v}}
    if "error" not in topo:
        out["cpus"] = len(topo["cpus"])
        out["numa_nodes"] = [{"id": n["id"], "cpus": n["cpus"], "kind": n.get("kind")} for n in topo["numa_nodes"]]
        out["gpus"] = [{k: g.get(k) for k in ("pci", "name", "numa", "local_cpus", "source")} for g in topo["gpus"]]
        out["nics"] = [{k: n.get(k) for k in ("name", "pci", "numa", "kind")} for n in topo["nics"]]
        ranks = sorted({cpu["perf_rank"] for cpu in topo["cpus"] if cpu.get("perf_rank") is not None})
        out["perf_ranks"] = ranks
        out["kernel"] = topo.get("kernel")
        out["topology_warnings"] = topo.get("warnings")
    if "error" not in plan:
        r0 = plan["ranks"][0] if plan.get("ranks") else {}
        out["plan_rank0"] = {"gpu": r0.get("gpu"), "numa": r0.get("numa"), "env": r0.get("env"),
                             "roles": {k: v.get("cpus") for k, v in (r0.get("roles") or {}).items()}}
        out["plan_warnings"] = plan.get("warnings")
    if "error" not in doctor:
        out["doctor_counts"] = doctor.get("counts")
        out["doctor_flags"] = [f"{ch['name']}: {ch['status']}: {ch['summary']}" for ch in doctor.get("checks", [])
                               if ch.get("status") in ("warn", "fail")]
    return out


# --- selftest --------------------------------------------------------------------------------

def selftest(c: Run) -> dict:
    res = c.run("selftest", CLI + ["selftest", "--json"], 150)
    doc = json_of(res)
    if doc is None:
        return {"passed": False, "error": res["why"] or "no JSON on stdout"}
    failed = [{"name": ch["name"], "rank": ch.get("rank"), "why": ch.get("why")} for ch in doc.get("checks", [])
              if ch.get("passed") is not True]
    return {"skipped": doc.get("skipped"), "reason": doc.get("reason"), "passed": doc.get("passed"),
            "checks": len(doc.get("checks", [])), "failed": failed}


# --- comm ------------------------------------------------------------------------------------

COMM_VARIANTS = {"auto": {}, "timing_off": {"TORCH_NCCL_ENABLE_TIMING": "0"},
                 "max_connections_1": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}}


def compare_comm(truth: list[float], per_step: list[int], records: list[dict]) -> dict:
    """placement's comm time in flight of each step (comm_inflight_ms; a log from before comm
    wait has only comm_ms, which was it) against the job's own timing of the same iteration's
    collectives: what the job times is their time in flight, not the step's wait (on NCCL the
    two are one figure, records/parts.py). The automatic monitor's step k runs from iteration
    k-1's optimizer step to iteration k's, so it holds iteration k's collectives."""
    pairs = [(r["step"], r.get("comm_inflight_ms", r.get("comm_ms"))) for r in records
             if WARMUP_STEPS <= r["step"] < len(truth)]
    if not pairs:
        return {"compared": 0, "why": "no step record matches an iteration of the job"}
    null = [s for s, v in pairs if v is None]
    timed = [(truth[s], v, per_step[s]) for s, v in pairs if v is not None]

    def margin(t: float, n: int) -> float:
        return max(SHORT_FRACTION * t, SHORT_FLOOR_MS * n)

    short = [1 for t, v, n in timed if v < t - margin(t, n)]
    over = [1 for t, v, n in timed if v > t + margin(t, n)]
    errors = [v - t for t, v, _ in timed]
    rel = [(v - t) / t for t, v, _ in timed if t > 0]
    return {"compared": len(pairs), "null_pct": round(100 * len(null) / len(pairs), 2),
            "short_pct": round(100 * len(short) / len(pairs), 2), "over_pct": round(100 * len(over) / len(pairs), 2),
            "median_error_ms": round(statistics.median(errors), 4) if errors else None,
            "median_error_pct": round(100 * statistics.median(rel), 2) if rel else None,
            "truth_median_ms": round(statistics.median(truth[WARMUP_STEPS:]), 4) if len(truth) > WARMUP_STEPS else None,
            "worst_short_ms": round(min(errors), 4) if errors else None}


def comm(c: Run) -> dict:
    steps = 60 if c.quick else 200
    variants = {"auto": {}} if c.cpu else COMM_VARIANTS
    out: dict = {"steps": steps, "variants": {}}
    if c.cpu:
        out["variants_left_out"] = "gloo has no NCCL timing variables: only `auto` runs"
    for name, extra in variants.items():
        d = c.logs / f"comm_{name}"
        d.mkdir(parents=True, exist_ok=True)
        job_out = d / "job.json"
        # a record a step: each step's comm is compared with the job's own timing of it
        argv = PLACERUN + ["--standalone", "--nproc-per-node", "1", f"placement.monitor.log_dir={d}",
                           "placement.monitor.record_min_s=0", JOB, "comm",
                           "--out", str(job_out), "--device", "cpu" if c.cpu else "cuda", "--steps", str(steps)]
        res = c.run(f"comm_{name}", argv, 120, c.env(**extra))
        if res["rc"] != 0 or not job_out.exists():
            out["variants"][name] = {"error": res["why"] or "the job wrote no result"}
            continue
        job = json.loads(job_out.read_text())
        start, records, end = read_log(d / "rank0.jsonl")
        v = compare_comm(job["truth_ms"], job["collectives_per_step"], records)
        v["records"] = len(records)
        v["comm_timing"] = start.get("comm_timing")
        v["job_env"] = job.get("env")
        v["comm_unsettled"] = (end.get("flight_recorder") or {}).get("comm_unsettled") if isinstance(
            end.get("flight_recorder"), dict) else None
        # The line that says why comm time is null, as the user sees it (stderr of placerun).
        v["null_line"] = next((ln.strip() for ln in res["stderr"].splitlines()
                               if "comm" in ln.lower() and ("null" in ln.lower() or "timing" in ln.lower())), None)
        v["monitor_us_per_step"] = end.get("monitor_us_per_step")
        out["variants"][name] = v
    return out


# --- throughput ------------------------------------------------------------------------------

def spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"], start_new_session=True) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def loop_job(c: Run, seconds: float, warm: float, workers: int) -> list[str]:
    """The launch-bound loop of gpu_check_job.py (fewer layers on CPU, where each is slower)."""
    return [JOB, "throughput", "--device", "cpu" if c.cpu else "cuda", "--seconds", str(seconds), "--warmup-s",
            str(warm), "--workers", str(workers), "--layers", "16" if c.cpu else "48", "--sample-work", "1000"]


def throughput(c: Run) -> dict:
    ncpu = len(os.sched_getaffinity(0))
    rounds = c.rounds or (1 if c.quick else 3)
    seconds, warm = (1.5, 0.5) if c.quick else (3.0, 1.0)
    load = max(1, ncpu - 4) if ncpu > 4 else 1  # background spinners: most cores busy
    workers = 2 if c.quick or ncpu <= 4 else 4
    job = loop_job(c, seconds, warm, workers)
    launchers = {"torchrun": TORCHRUN + ["--standalone", "--nproc-per-node", "1"],
                 "torchrun_numa_node": TORCHRUN + ["--standalone", "--nproc-per-node", "1", "--numa-binding", "node"],
                 "placerun": PLACERUN + ["--standalone", "--nproc-per-node", "1"]}
    out: dict = {"rounds": rounds, "seconds": seconds, "dataloader_workers": workers, "spinners": load,
                 "cpus": ncpu, "phases": {}}
    phases = ("loaded", "quiet")
    runs: dict = {ph: {k: [] for k in launchers} for ph in phases}
    errors: dict = {ph: {} for ph in phases}
    # Rounds outermost, so a cut for time leaves both phases with the same rounds.
    for r in range(rounds):
        for phase in phases:
            if c.left_s() < 15 * len(launchers):
                out.setdefault("rounds_left_out", f"from round {r + 1} of {phase}: the section's time was spent")
                continue
            hogs = spinners(load) if phase == "loaded" else []
            try:
                for name, launch in launchers.items():
                    if name in errors[phase]:
                        continue
                    d = c.logs / f"tp_{phase}_{name}_{r}"
                    d.mkdir(parents=True, exist_ok=True)
                    extra = [f"placement.monitor.log_dir={d}"] if name == "placerun" else []
                    res = c.run(f"tp_{phase}_{name}", launch + extra + job + ["--out", str(d / "job.json")], 90)
                    if res["rc"] != 0 or not (d / "job.json").exists():
                        errors[phase][name] = res["why"] or "the job wrote no result"
                        continue
                    runs[phase][name].append(json.loads((d / "job.json").read_text()))
            finally:
                stop(hogs)
    for phase in phases:
        ph: dict = {"errors": errors[phase]}
        for name, js in runs[phase].items():
            if js:
                ph[name] = {"steps_per_s": [round(j["steps_per_s"], 1) for j in js],
                            "median": round(statistics.median(j["steps_per_s"] for j in js), 1),
                            "main_cpus": js[-1]["main_cpus"], "omp_num_threads": js[-1]["omp_num_threads"]}
        for base in ("torchrun", "torchrun_numa_node"):
            if "placerun" in ph and base in ph:
                ph[f"placerun_vs_{base}"] = round(ph["placerun"]["median"] / ph[base]["median"], 3)
            else:
                ph[f"placerun_vs_{base}"] = None
                ph[f"placerun_vs_{base}_why"] = errors[phase].get(base) or errors[phase].get("placerun") or "no run"
        out["phases"][phase] = ph
    return out


# --- ablation --------------------------------------------------------------------------------

# placerun with one of its parts changed at a time (its overrides), against torchrun, on a quiet
# node: where placerun is slower than torchrun, which part costs. Not in the default run. Each row:
# (launcher, placerun overrides, job flags); the `_ddp` rows run the loop under DDP, so comm timing
# (placement.monitor.comm_timing, its DDP comm hook on NCCL) has collectives to time.
ABLATION = {"torchrun": ("torchrun", [], []), "placerun": ("placerun", [], []),
            "policy_node": ("placerun", ["placement.policy=node"], []),
            "monitor_off": ("placerun", ["placement.monitor.enabled=false"], []),
            "main_off_cpu0": ("placerun", ["placement.reserved_cpus=0"], []),
            "torchrun_ddp": ("torchrun", [], ["--ddp"]), "placerun_ddp": ("placerun", [], ["--ddp"]),
            "comm_timing_off_ddp": ("placerun", ["placement.monitor.comm_timing=off"], ["--ddp"])}
ABLATION_DEFAULT = ("torchrun", "placerun", "monitor_off", "torchrun_ddp", "placerun_ddp", "comm_timing_off_ddp")


def ablation(c: Run) -> dict:
    rounds = c.rounds or (1 if c.quick else 3)
    seconds, warm = (1.5, 0.5) if c.quick else (3.0, 1.0)
    ncpu = len(os.sched_getaffinity(0))
    workers = 2 if c.quick or ncpu <= 4 else 4
    job = loop_job(c, seconds, warm, workers)
    rows = {k: ABLATION[k] for k in c.ablation}
    runs: dict = {k: [] for k in rows}
    comm: dict = {k: [] for k in rows}
    errors: dict = {}
    out: dict = {"rounds": rounds, "seconds": seconds, "rows": list(rows)}
    for r in range(rounds):
        if c.left_s() < 15 * len(rows):
            out["rounds_left_out"] = f"from round {r + 1}: the section's time was spent"
            break
        for name, (launcher, keys, flags) in rows.items():
            if name in errors:
                continue
            d = c.logs / f"ab_{name}_{r}"
            d.mkdir(parents=True, exist_ok=True)
            launch = TORCHRUN if launcher == "torchrun" else PLACERUN
            own = [] if launcher == "torchrun" else [f"placement.monitor.log_dir={d}", *keys]
            argv = launch + ["--standalone", "--nproc-per-node", "1", *own] + job + flags + ["--out", str(d / "job.json")]
            res = c.run(f"ab_{name}", argv, 90)
            if res["rc"] != 0 or not (d / "job.json").exists():
                errors[name] = res["why"] or "the job wrote no result"
                continue
            runs[name].append(json.loads((d / "job.json").read_text()))
            start, steps, _ = read_log(d / "rank0.jsonl")
            if steps:  # what placerun's monitor recorded of the job's collectives
                comm[name].append({"ddp_hook": start.get("ddp_hook"), "comm_timing": start.get("comm_timing"),
                                   "comm_null_pct": round(100 * sum(s.get("comm_ms") is None for s in steps) / len(steps), 1),
                                   # per step (a record of several steps counts all of theirs)
                                   "comm_count": statistics.median(s.get("comm_count", 0) / s.get("steps", 1)
                                                                   for s in steps),
                                   "comm_ms_median": statistics.median(s["comm_ms"] for s in steps if s.get("comm_ms") is not None)
                                   if any(s.get("comm_ms") is not None for s in steps) else None})
    out["errors"] = errors
    for name, js in runs.items():
        if not js:
            continue
        # Each row against torchrun running the same job (with or without DDP).
        base_rows = runs.get("torchrun_ddp" if "--ddp" in rows[name][2] else "torchrun") or []
        base = statistics.median(j["steps_per_s"] for j in base_rows) if base_rows else None
        med = statistics.median(j["steps_per_s"] for j in js)
        out[name] = {"steps_per_s": [round(j["steps_per_s"], 1) for j in js], "median": round(med, 1),
                     "vs_torchrun": round(med / base, 3) if base else None, "main_cpus": js[-1]["main_cpus"],
                     "monitor_comm": comm[name]}
    return out


# --- cost ------------------------------------------------------------------------------------

COST_MODES = {"off": (["placement.monitor.enabled=false"], []),
              "attach": (["placement.monitor.auto=false"], ["--attach"]),
              "auto": ([], [])}


def cost(c: Run) -> dict:
    rounds = c.rounds or (1 if c.quick else 3)
    steps = 100 if c.quick else 400
    device = "cpu" if c.cpu else "cuda"
    runs: dict = {m: [] for m in COST_MODES}
    monitor_us: dict = {m: [] for m in COST_MODES}
    thread_us: dict = {m: [] for m in COST_MODES}  # the monitor thread's CPU per step (its end event)
    errors: dict = {}
    out_left = None
    reps = 0  # the first run sizes the step (~10 ms of matrix products); every run after uses its count
    for r in range(rounds):
        for mode, (keys, flags) in COST_MODES.items():
            if mode in errors:
                continue
            if c.left_s() < 20:
                out_left = f"from round {r + 1}: the section's time was spent"
                continue
            d = c.logs / f"cost_{mode}_{r}"
            d.mkdir(parents=True, exist_ok=True)
            argv = PLACERUN + ["--standalone", "--nproc-per-node", "1", f"placement.monitor.log_dir={d}", *keys,
                               JOB, "cost", "--device", device, "--steps", str(steps), "--out", str(d / "job.json"),
                               "--reps", str(reps), *flags]
            res = c.run(f"cost_{mode}", argv, 90)
            if res["rc"] != 0 or not (d / "job.json").exists():
                errors[mode] = res["why"] or "the job wrote no result"
                continue
            runs[mode].append(json.loads((d / "job.json").read_text()))
            reps = reps or runs[mode][-1]["matmuls_per_step"]
            _, _, end = read_log(d / "rank0.jsonl")
            if end.get("monitor_us_per_step") is not None:
                monitor_us[mode].append(end["monitor_us_per_step"])
            if end.get("monitor_thread_us_per_step") is not None:
                thread_us[mode].append(end["monitor_thread_us_per_step"])
    out: dict = {"rounds": rounds, "steps": steps, "matmuls_per_step": reps, "errors": errors}
    if out_left:
        out["rounds_left_out"] = out_left
    for mode, js in runs.items():
        if js:
            out[mode] = {"step_ms_mean": round(statistics.median(j["step_ms_mean"] for j in js), 4),
                         "step_ms_median": round(statistics.median(j["step_ms_median"] for j in js), 4),
                         "monitor_us_per_step": round(statistics.median(monitor_us[mode]), 2) if monitor_us[mode]
                         else None,
                         "monitor_thread_us_per_step": round(statistics.median(thread_us[mode]), 2)
                         if thread_us[mode] else None}
    if "off" in out:
        base = out["off"]["step_ms_mean"]
        for mode in ("attach", "auto"):
            if mode in out:
                extra_us = (out[mode]["step_ms_mean"] - base) * 1e3
                out[mode]["us_per_step_vs_off"] = round(extra_us, 1)
                out[mode]["pct_of_step"] = round(100 * extra_us / (base * 1e3), 3)
                m = out[mode]["monitor_us_per_step"]
                out[mode]["monitor_pct_of_step"] = None if m is None else round(100 * m / (base * 1e3), 3)
    return out


# --- report ----------------------------------------------------------------------------------

SECTIONS = {"machine": machine, "selftest": selftest, "comm": comm, "throughput": throughput, "cost": cost,
            "ablation": ablation}
DEFAULT = ("machine", "selftest", "comm", "throughput", "cost")
# Share of the time budget each section may use at most (the rest is left to later sections).
SHARE = {"machine": 0.1, "selftest": 0.3, "comm": 0.3, "throughput": 0.75, "cost": 1.0, "ablation": 1.0}


def headline(result: dict) -> dict:
    s = result["sections"]
    h: dict = {"benchmark": "gpu_check", "cpu": result["cpu"], "quick": result["quick"],
               "wall_s": result.get("wall_s")}
    m = s.get("machine") or {}
    h["gpus"] = [(g.get("name"), g.get("numa")) for g in m.get("gpus", [])]
    st = s.get("selftest") or {}
    h["selftest_passed"] = None if st.get("skipped") else st.get("passed")
    h["selftest_failed"] = [f["name"] for f in st.get("failed", [])]
    for name, v in ((s.get("comm") or {}).get("variants") or {}).items():
        for k in ("short_pct", "null_pct", "median_error_ms", "error"):
            if k in v:
                h[f"comm_{name}_{k}"] = v[k]
    for phase, ph in ((s.get("throughput") or {}).get("phases") or {}).items():
        for base in ("torchrun", "torchrun_numa_node"):
            h[f"{phase}_placerun_vs_{base}"] = ph.get(f"placerun_vs_{base}")
    co = s.get("cost") or {}
    for mode in ("attach", "auto"):
        if mode in co:
            h[f"cost_{mode}_pct_of_step"] = co[mode].get("pct_of_step")
            h[f"cost_{mode}_monitor_pct_of_step"] = co[mode].get("monitor_pct_of_step")
            h[f"cost_{mode}_monitor_thread_us_per_step"] = co[mode].get("monitor_thread_us_per_step")
    ab = s.get("ablation") or {}
    for name in ABLATION:
        if isinstance(ab.get(name), dict):
            h[f"ablation_{name}_vs_torchrun"] = ab[name].get("vs_torchrun")
    h["section_errors"] = {k: v["section_error"] for k, v in s.items() if isinstance(v, dict) and "section_error" in v}
    return h


def summary(result: dict) -> str:
    """A few lines per section, for a person; gpu_check.json has everything."""
    s = result["sections"]
    lines = [f"gpu_check ({'cpu' if result['cpu'] else 'gpu'}{', quick' if result['quick'] else ''}), "
             f"{result.get('wall_s')} s"]
    for name, sec in s.items():
        lines.append(f"[{name}] {sec.get('section_s')} s" + (f": {sec['section_error']}" if "section_error" in sec else ""))
    m = s.get("machine") or {}
    if "cpus" in m:
        lines.append(f"  {m['cpus']} CPUs, NUMA nodes {[n['id'] for n in m['numa_nodes']]}, GPUs "
                     f"{[(g['pci'], g['numa']) for g in m.get('gpus', [])]}, NICs {len(m.get('nics', []))}, "
                     f"perf ranks {m.get('perf_ranks')}")
        lines.append(f"  plan rank 0: {(m.get('plan_rank0') or {}).get('roles')}")
        lines.append(f"  doctor: {m.get('doctor_counts')} {m.get('doctor_flags')}")
    st = s.get("selftest") or {}
    if st.get("skipped"):
        lines.append(f"  selftest: skipped: {st.get('reason')}")
    elif st:
        lines.append(f"  selftest: passed {st.get('passed')} ({st.get('checks')} checks; failed "
                     f"{[(f['name'], f['why']) for f in st.get('failed', [])]}) {st.get('reason') or ''}")
    for vname, v in ((s.get("comm") or {}).get("variants") or {}).items():
        lines.append(f"  comm {vname}: " + (v["error"] if "error" in v else
                     f"{v['compared']} steps, short {v['short_pct']}%, null {v['null_pct']}%, median error "
                     f"{v['median_error_ms']} ms of {v['truth_median_ms']} ms ({v['comm_timing']})"
                     + (f"; says: {v['null_line']}" if v.get("null_line") else "")))
    for phase, ph in ((s.get("throughput") or {}).get("phases") or {}).items():
        med = {k: ph[k]["median"] for k in ("torchrun", "torchrun_numa_node", "placerun") if k in ph}
        lines.append(f"  throughput {phase}: steps/s {med}, placerun/torchrun {ph.get('placerun_vs_torchrun')}, "
                     f"placerun/numa-node {ph.get('placerun_vs_torchrun_numa_node')} {ph.get('errors') or ''}")
    co = s.get("cost") or {}
    for mode in ("off", "attach", "auto"):
        if mode in co:
            lines.append(f"  cost {mode}: {co[mode]}")
    ab = s.get("ablation") or {}
    for name in ABLATION:
        if isinstance(ab.get(name), dict):
            lines.append(f"  ablation {name}: {ab[name]['median']} steps/s ({ab[name]['vs_torchrun']}x torchrun)"
                         + (f" comm {ab[name]['monitor_comm'][-1]}" if ab[name].get("monitor_comm") else ""))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="gloo and CPU tensors (no GPU needed)")
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    p.add_argument("--only", default=",".join(DEFAULT),
                   help=f"comma list of sections (default {','.join(DEFAULT)}; also: ablation)")
    p.add_argument("--ablation", default=",".join(ABLATION_DEFAULT),
                   help=f"ablation: comma list of rows (default {','.join(ABLATION_DEFAULT)}; all: {','.join(ABLATION)})")
    p.add_argument("--rounds", type=int, default=0,
                   help="rounds of throughput, ablation and cost (default 3, quick 1); a section out of time leaves the rest out")
    p.add_argument("--budget-s", type=float, default=None, help="time for all sections (default 360, quick 240)")
    p.add_argument("--out", default=None, help="evidence directory (default $OUT, else a new temporary one)")
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        print(f"gpu_check: --only {','.join(bad)} is not a section; valid: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    if args.rounds < 0:
        print(f"gpu_check: --rounds {args.rounds}: a count of rounds, 1 or more (0: each section's default)",
              file=sys.stderr)
        return 2
    rows = [r for r in args.ablation.split(",") if r]
    bad = [r for r in rows if r not in ABLATION]
    if bad or not rows:
        print(f"gpu_check: --ablation {args.ablation!r}: {','.join(bad) or 'no row'} is not a row; valid: "
              f"{', '.join(ABLATION)}", file=sys.stderr)
        return 2
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check-"))
    out.mkdir(parents=True, exist_ok=True)
    c = Run(out, args.budget_s or (240.0 if args.quick else 360.0), args.cpu, args.quick, rows, args.rounds)
    print(f"gpu_check: evidence in {out}, logs in {c.logs}", file=sys.stderr)
    for name in only:
        left = c.left_s()
        if left < 10:
            c.result["sections"][name] = {"section_error": f"not run: the time budget ({c.budget_s:.0f} s) was spent"}
            continue
        t0 = time.monotonic()
        budget_before = c.budget_s
        # A section may use its share of what is left; later ones keep the rest.
        c.budget_s = (time.monotonic() - c.t0) + left * SHARE[name] if name != only[-1] else budget_before
        try:
            c.result["sections"][name] = SECTIONS[name](c)
        except Exception as e:  # one section's failure is evidence, not the end of the check
            c.result["sections"][name] = {"section_error": f"{type(e).__name__}: {e}"}
        finally:
            c.budget_s = budget_before
        c.result["sections"][name]["section_s"] = round(time.monotonic() - t0, 1)
        print(f"gpu_check: {name} done in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        c.save()
    c.save()
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(c.logs, arcname="logs")
    h = headline(c.result)
    h["wall_s"] = c.result["wall_s"]
    print(json.dumps(h, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
