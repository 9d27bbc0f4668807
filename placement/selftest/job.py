"""The job `placement selftest` runs under placerun on a GPU node (one rank per GPU): NCCL
init, then 2 x `steps` training steps of a small CUDA model fed by a pinning DataLoader, each
step ending with collectives the job times itself with CUDA events (64 MB all-reduces for the
first `steps`, 4 KB ones after: steps of a few ms); threads, and where the process's pages and
the loader's pinned batch buffers sit, are read while the loader runs; it writes what it saw
to <out>/rank<R>.json for placement/selftest/checks.py.

    placerun --standalone --nproc-per-node N -m placement.selftest.job --out DIR [--steps 100]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import placement
from placement import _procfs
from placement import residence
from placement.bind import session as session_mod
from placement.events import EventKind
from placement.roles import scan_threads
from placement.topology.gpus import nvml_gpus

COLLECTIVES_PER_STEP = 4
COLLECTIVE_FLOATS = 16 << 20  # 64 MB per all-reduce: long enough that event overheads are noise
SHORT_FLOATS = 1 << 10  # 4 KB per all-reduce: steps of a few ms, far below the watchdog's 100 ms retire period
REHOME_WAIT_S = 2.5  # placerun's watcher re-homes new threads once a second


def _gpu_pci(torch, index: int) -> str:
    """The PCI address of a CUDA device, formatted as torch/numa/binding.py:593-600 does."""
    p = torch.cuda.get_device_properties(index)
    return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"


def _gpu_numa(pci: str):
    try:
        with open(f"/sys/bus/pci/devices/{pci}/numa_node") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _threads() -> list[dict]:
    """This process's threads: name, role and Cpus_allowed_list read back from /proc."""
    out = []
    for t in scan_threads(os.getpid(), include_children=False):
        try:
            cpus = sorted(_procfs.cpus_allowed(t.pid, t.tid))
        except _procfs.ThreadGone:
            continue
        out.append({"tid": t.tid, "name": t.name, "role": str(t.role), "cpus": cpus})
    return out


def _main_cpus() -> list[int]:
    return sorted(_procfs.cpus_allowed(os.getpid(), os.getpid()))


def residence_evidence(planned, batch) -> dict:
    """Where this process's pages and the batch's buffers (pinned host memory from a pinning
    DataLoader on a GPU node) are, against the planned nodes: each look as Residence.to_dict(),
    or the one-line reason it could not be made (residence.py, the monitor's own reader)."""
    out: dict = {"planned": sorted(planned), "looks": [], "null": []}
    looks = [("process", lambda: residence.sample_process(planned))]
    buffers, pinned = residence.tensor_buffers(batch)
    what = "pinned batch buffers" if pinned else "batch buffers"
    if buffers:
        looks.append((what, lambda: residence.sample_buffers(what, buffers, planned)))
    else:
        out["null"].append(f"{what}: the batch holds no CPU tensor")
    for name, reader in looks:
        got, why = residence.safe(reader)
        if got is None:
            out["null"].append(f"{name}: {why}")
        else:
            out["looks"].append(got.to_dict())
    return out


def _read_log(path: str) -> tuple[dict, list[dict], dict]:
    start, steps, end = {}, [], {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type") == EventKind.STEP:
                steps.append(rec)
            elif rec.get("type") == EventKind.START and rec.get("source") == "monitor":
                start = rec
            elif rec.get("type") == EventKind.END and rec.get("source") == "monitor":
                end = rec
    return start, steps, end


def run(out: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    ev: dict = {"local_rank": local_rank, "main_cpus_before_nccl": _main_cpus()}
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)  # the communicator exists and has run a kernel
    torch.cuda.synchronize()
    ev["main_cpus_after_nccl"] = _main_cpus()
    ev["rank"] = rank = dist.get_rank()
    ev["world_size"] = dist.get_world_size()  # one rank: NCCL's all-reduce moves nothing (checks.comm_time)
    time.sleep(REHOME_WAIT_S)
    ev["threads_after_init"] = _threads()
    ev["gpu_pci"] = _gpu_pci(torch, local_rank)
    ev["gpu_numa"] = _gpu_numa(ev["gpu_pci"])
    if rank == 0:
        nv = nvml_gpus()
        ev["nvml_gpus"] = None if nv is None else [g.pci for g in nv]
        ev["torch_gpus"] = [_gpu_pci(torch, i) for i in range(torch.cuda.device_count())]
    session = session_mod.current()
    ev["plan"] = None if session is None else session.rank_plan.to_dict()
    planned = () if session is None else residence.planned_nodes(session.rank_plan.memory.mode,
                                                                 session.rank_plan.memory.nodes)
    # The threshold placerun's config gave this rank (monitor.residence_min_pct).
    ev["residence_min_pct"] = None if session is None else session.config.monitor.residence_min_pct

    data = torch.utils.data.TensorDataset(torch.randn(2 * steps * 64, 256), torch.randn(2 * steps * 64, 16))
    loader = torch.utils.data.DataLoader(data, batch_size=64, num_workers=2, pin_memory=True)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log_dir = os.path.join(out, "logs")
    handle = placement.attach(model, opt, monitor={"log_dir": log_dir, "flush_every": 10, "summary_every": 0})
    long_bufs = [torch.ones(COLLECTIVE_FLOATS, device="cuda") for _ in range(COLLECTIVES_PER_STEP)]
    short_bufs = [torch.ones(SHORT_FLOATS, device="cuda") for _ in range(COLLECTIVES_PER_STEP)]
    events = []
    # The first `steps` steps end with 64 MB all-reduces, the next `steps` with 4 KB ones.
    for i, (xb, yb) in enumerate(handle.watch(loader)):
        if i == steps // 2:
            # While the loader runs (its pt_data_pin thread is joined when it is exhausted), once
            # the watcher has had time to re-home the loader's threads.
            time.sleep(REHOME_WAIT_S)
            ev["threads_during_steps"] = _threads()
            ev["residence"] = residence_evidence(planned, (xb, yb))  # the batch as the pin-memory thread filled it
        xb, yb = xb.cuda(non_blocking=True), yb.cuda(non_blocking=True)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        step_events = []
        for b in (long_bufs if i < steps else short_bufs):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dist.all_reduce(b)  # blocking: the current stream waits for the NCCL stream
            e.record()
            step_events.append((s, e))
        events.append(step_events)
        opt.step()  # the step ends here (post-step hook)
    torch.cuda.synchronize()
    ev["threads_after_steps"] = _threads()
    ev["main_cpus_after_steps"] = _main_cpus()
    handle.close()
    reference = [sum(s.elapsed_time(e) for s, e in step) for step in events]
    start, recs, end = _read_log(os.path.join(log_dir, f"rank{rank}.jsonl"))
    ev["comm_timing"] = start.get("comm_timing")
    recs.sort(key=lambda r: r["step"])
    monitor = [r.get("comm_ms") for r in recs]
    ev["comm_ms_reference"], ev["comm_ms_reference_short"] = reference[:steps], reference[steps:]
    ev["comm_ms_monitor"], ev["comm_ms_monitor_short"] = monitor[:steps], monitor[steps:]
    long_recs, short_recs = recs[:steps], recs[steps:]
    ev["step_ms_median"] = statistics.median(r["step_ms"] for r in long_recs) if long_recs else None
    ev["step_ms_median_short"] = statistics.median(r["step_ms"] for r in short_recs) if short_recs else None
    ev["monitor_us_per_step"] = end.get("monitor_us_per_step")
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(ev, f)
    return ev


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args(argv)
    run(args.out, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
