"""How fast a hung rank is named, and whether pauses that are not faults raise alarms.

A real gloo job (WORLD ranks on this host, an all_reduce per ~20 ms step, placement.attach with
its DEFAULT monitor settings unless overridden) goes through these phases:
- balanced: the first BALANCED steps (500 with --quick, 5,000 without) every rank alike; false
  straggler events = `straggler` events whose window lies in them, per 1,000 exchange windows
  (with --quick 25 windows: one false event would read 40 per 1,000);
- shared pause: 40 steps later every rank pauses SHARED_S together (a checkpoint: 60 s, --quick
  12 s, longer than the default hang bound either way); alarms = `stall` events naming a rank
  (not the one job-wide event) during it;
- single pause: 120 steps after the balanced ones rank 1 pauses 5 s (a garbage collection);
  alarms likewise;
- straggler: from step 140 to 190 (after the balanced ones) rank 1 sleeps STRAGGLER_FRAC (30%)
  longer each step; onset = seconds (and exchange windows) from its first slow step to rank 0's
  first `straggler` event naming rank 1; windows naming a rank outside those steps are counted;
- frozen: at step 250 rank 2 stops itself (SIGSTOP: every thread of it, as a frozen host's are;
  no post, no row) until rank 0 names it or FROZEN_WAIT_S pass, then the harness continues it;
  latency = seconds from the stop to rank 0's `stall` event naming rank 2, against the limit;
- hang: after step 300 (after the balanced ones) rank 1 blocks for good; latency = seconds from
  its last step to the first `stall` event naming rank 1 in any rank's log (one host: one clock).

    python benchmarks/detection.py [--quick] [placement.monitor.KEY=VALUE ...]

Last line: {"hang_named_s": ..., "shared_pause_alarms": ..., "single_pause_alarms": ..., ...}
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_ranks import attach_rank, monitor_config, start_ranks  # noqa: E402  (benchmarks/, the script's own folder)

WORLD = 3
# The frozen rank stops 60 steps after the straggler's: its windows are judged by then (rank 0
# waits up to Exchange.WAIT_S for a frozen rank's row, which would date the straggler's event late).
SHARED_AT, SINGLE_AT, FROZEN_AT, HANG_AT = 40, 120, 250, 300
SINGLE_S = 5.0
STRAGGLER_AT, STRAGGLER_TO, STRAGGLER_FRAC = 140, 190, 0.3
STEP_S = 0.02
HANG_WAIT_S = 40.0  # the harness gives up on naming after this long
FROZEN_WAIT_S = 40.0  # ... and continues the frozen rank after this long


def worker(log_dir: str, shared_s: float, overrides: str, balanced: int) -> None:
    import torch
    import torch.distributed as dist

    rank, h = attach_rank(log_dir, overrides)
    x = torch.ones(1024)
    marks = {}
    for at in range(1, 10**6):
        step = at - balanced  # the phases below count from the end of the balanced steps
        slow = rank == 1 and STRAGGLER_AT <= step < STRAGGLER_TO
        if slow and step == STRAGGLER_AT:
            marks["straggler"] = time.time()
        time.sleep(STEP_S * (1.0 + STRAGGLER_FRAC) if slow else STEP_S)
        dist.all_reduce(x)
        h.step()
        if step == SHARED_AT:
            marks["shared"] = [time.time()]
            time.sleep(shared_s)  # a checkpoint: every rank, outside any collective
            marks["shared"].append(time.time())
        elif step == SINGLE_AT and rank == 1:
            marks["single"] = [time.time()]
            time.sleep(SINGLE_S)  # a garbage collection on one rank
            marks["single"].append(time.time())
        elif step == FROZEN_AT and rank == 2:
            marks["frozen"] = time.time()
            Path(log_dir, f"marks{rank}.json").write_text(json.dumps(marks))
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops here, the monitor's too
            marks["thawed"] = time.time()
        elif step == HANG_AT and rank == 1:
            marks["hang"] = time.time()
            Path(log_dir, f"marks{rank}.json").write_text(json.dumps(marks))
            threading.Event().wait()  # hung for good, on a futex
        if step == HANG_AT - 1:
            Path(log_dir, f"marks{rank}.json").write_text(json.dumps(marks))


def _events(log_dir: Path) -> list[dict]:
    out = []
    for f in log_dir.glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _named_stalled(events: list[dict], rank: int, since: float) -> list[dict]:
    return [e for e in events if e.get("type") == "stall" and e.get("rank") == rank
            and e.get("phase") == "stalled" and e["t"] >= since]


def _thaw_when_named(log_dir: Path, proc, named: Optional[float]) -> Optional[float]:
    """Continue the frozen rank once rank 0 named it (or FROZEN_WAIT_S passed); the time it was
    named, once known."""
    path = log_dir / "marks2.json"
    if named is not None or not path.exists():
        return named
    frozen = json.loads(path.read_text()).get("frozen")
    if frozen is None:
        return None
    got = _named_stalled(_events(log_dir), 2, frozen)
    if got or time.time() > frozen + FROZEN_WAIT_S:
        proc.send_signal(signal.SIGCONT)
        return min(e["t"] for e in got) if got else math.inf
    return None


def _alarms(events: list[dict], lo: float, hi: float) -> list[dict]:
    return [e for e in events if e.get("type") == "stall" and e.get("phase") == "stalled"
            and e.get("scope") != "job" and lo <= e["t"] <= hi]


def run(shared_s: float, overrides: list[str], keep: str = "", balanced: int = 500, exchange_every: int = 20) -> dict:
    with tempfile.TemporaryDirectory(prefix="placement-detection-") as d:
        log_dir = Path(keep or d)
        log_dir.mkdir(parents=True, exist_ok=True)
        procs = start_ranks(WORLD, [__file__, "--worker", str(log_dir), str(shared_s), ",".join(overrides),
                                    str(balanced)], start_new_session=True)
        try:
            deadline = None
            frozen_named = None
            while True:
                time.sleep(0.2)
                frozen_named = _thaw_when_named(log_dir, procs[2], frozen_named)
                if any(p.poll() is not None for p in procs):
                    raise SystemExit("a rank exited: " + procs[[p.poll() is not None for p in procs].index(True)]
                                     .stderr.read().decode(errors="replace")[-2000:])
                if (log_dir / "marks1.json").exists() and "hang" in json.loads((log_dir / "marks1.json").read_text()):
                    deadline = deadline or time.monotonic() + HANG_WAIT_S
                    ev = _events(log_dir)
                    if any(e.get("type") == "stall" and e.get("rank") == 1 and e.get("phase") == "stalled"
                           and e["t"] >= json.loads((log_dir / "marks1.json").read_text())["hang"] for e in ev) \
                            or time.monotonic() > deadline:
                        time.sleep(0.5)
                        break
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        marks = {r: json.loads((log_dir / f"marks{r}.json").read_text()) for r in range(WORLD)}
        events = _events(log_dir)
    hang_t = marks[1]["hang"]
    frozen_t = marks[2].get("frozen")
    frozen = sorted(_named_stalled(events, 2, frozen_t), key=lambda e: e["t"]) if frozen_t else []
    frozen_limit = frozen[0].get("threshold_s") if frozen else None
    named = sorted(e["t"] for e in events if e.get("type") == "stall" and e.get("rank") == 1
                   and e.get("phase") == "stalled" and e["t"] >= hang_t)
    shared_lo = min(m["shared"][0] for m in marks.values())
    shared_hi = max(m["shared"][1] for m in marks.values())
    single_lo, single_hi = marks[1]["single"]
    strag_t = marks[1]["straggler"]
    judged = sorted((e for e in events if e.get("type") == "straggler"), key=lambda e: e["t"])
    onset = next((e for e in judged if e["steps"][1] >= balanced + STRAGGLER_AT
                  and any(s.get("ranks") == [1] for s in e.get("stragglers") or [])), None)
    elsewhere = [e for e in judged if e.get("stragglers")
                 and balanced < e["steps"][1] and (e["steps"][1] < balanced + STRAGGLER_AT
                                                   or balanced + STRAGGLER_TO <= e["steps"][0]
                                                   and e["steps"][1] < balanced + FROZEN_AT)]
    first = next((e for e in sorted(events, key=lambda e: e["t"]) if e.get("type") == "stall"
                  and e.get("rank") == 1 and e.get("phase") == "stalled" and e["t"] >= hang_t), None)
    balanced_windows = balanced // exchange_every
    false_events = [e for e in judged if e.get("stragglers") and e["steps"][1] <= balanced]  # a rank named
    return {
        "balanced_windows": balanced_windows, "false_straggler_events": len(false_events),
        "false_per_1000_windows": round(1000.0 * len(false_events) / balanced_windows, 1) if balanced_windows else None,
        "job_wide_events": sum(1 for e in judged if e.get("job_wide") and e["steps"][1] <= balanced),
        "hang_named_s": None if not named else round(named[0] - hang_t, 2),
        "hang_named_by": None if first is None else first.get("reported_by", 1),
        "shared_pause_s": shared_s, "shared_pause_alarms": len(_alarms(events, shared_lo, shared_hi + 1)),
        "shared_pause_job_events": sum(1 for e in events if e.get("scope") == "job" and e.get("phase") == "stalled"),
        "single_pause_s": SINGLE_S, "single_pause_alarms": len(_alarms(events, single_lo, single_hi + 1)),
        "straggler_pct": round(100 * STRAGGLER_FRAC), "straggler_named_s": None if onset is None else round(onset["t"] - strag_t, 2),
        # windows from the first slow step to the end of the window that named it (its own length)
        "straggler_named_windows": None if onset is None else
        -(-(onset["steps"][1] - balanced - STRAGGLER_AT + 1) // (onset["steps"][1] - onset["steps"][0] + 1)),
        "straggler_events_elsewhere": len(elsewhere),
        # the frozen rank: named after how long, by how (rank 0: "silent"), within its limit + 2 s
        "frozen_named_s": None if not frozen else round(frozen[0]["t"] - frozen_t, 2),
        "frozen_named_how": None if not frozen else frozen[0].get("how"),
        "frozen_limit_s": frozen_limit,
        "frozen_met": None if not frozen or frozen_limit is None else frozen[0]["t"] - frozen_t <= frozen_limit + 2.0,
        "world": WORLD, "overrides": overrides,
    }


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], float(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="500 balanced steps and a 12 s shared pause instead of 5,000 and 60 s (under a minute)")
    p.add_argument("--log-dir", default="", help="keep the ranks' logs here (default: a temporary directory)")
    p.add_argument("overrides", nargs="*", metavar="placement.monitor.KEY=VALUE")
    args = p.parse_args(argv)
    cfg = monitor_config("detection", args.overrides)  # bad overrides: one line, exit 2
    if cfg is None:
        return 2
    result = run(12.0 if args.quick else 60.0, args.overrides, args.log_dir, 500 if args.quick else 5000,
                 cfg.monitor.exchange_every)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
