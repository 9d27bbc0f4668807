"""What the cross-rank straggler exchange costs as the job grows (placement/monitor/crossrank/exchange.py).

usage: python benchmarks/exchange_scale.py [--quick] [--exchanges N] [--hosts N]
(--quick: fewer exchanges; well under a minute here)

Every process is forked from this one after it imported torch (no rank pays torch's import;
nothing of torch.distributed is initialised before the fork: each rank makes its own gloo
group and store client, as a launched rank does).

Part 1, real: W = 2, 4, 8, 16 processes on this machine, each a rank of one gloo job
(init_process_group, env://: the default store is the TCPStore rank 0 hosts), each with the
monitor's Exchange over that store. Every ~20 ms "step window" every rank submits synthetic
figures (rank 1 late, cpu-slow); rank 0 judges. Per rank: median CPU microseconds of a submit
on the rank's thread (append + add: what its monitor thread pays; the headline), and its wall
time, which here includes waiting for a CPU: W processes wake at the same instant on 2 cores.
Rank 0: median ms from its last poll to the judged report.
Part 2, the judging side at W = 1,024, 4,096, 16,384 through the real transport: one TCPStore
server, rank 0's Exchange as one client, and 4 sender processes, each a store client sending
the rows of W/4 ranks exactly as those ranks would (append + add each), synthetic figures with
a slow node (8 ranks cpu-slow), 40 compute-slow ranks and one data-slow rank. Rank 0: median
ms per exchange (last poll, get, delete, decode, judge) and the event it writes.
Targets: per-rank cost flat in W (W=16 within 1.5x of W=2); rank 0 < 100 ms at 16,384.

--hosts N (root; the host test bed of tests/hostbed.py): the same real ranks, 2 per host, on N
hosts, each its own network namespace with an address on a bridge (rank 0's store and gloo
reached over veth links, a real network stack), against the same 2N ranks on one host of the
bed (loopback). Per rank: the CPU and wall microseconds of a submit; rank 0: its judge time.
Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from placement.monitor.crossrank.exchange import Exchange  # noqa: E402
from placement.monitor.crossrank.rows import HEADER, encode_row  # noqa: E402
from placement.monitor.health.peers import PeerLiveness  # noqa: E402
from placement.monitor.stragglers.event import straggler_event  # noqa: E402
from placement.monitor.stragglers.figures import FIELDS, RankFigures  # noqa: E402

SLOTS = 20  # monitor.exchange_every's default
START = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
T0 = 1_800_000_000.0
ROW_BYTES = 8 * (len(HEADER) + len(FIELDS) + SLOTS)


class _Warn:
    def __init__(self):
        self.lines = []

    def __call__(self, key, message):
        self.lines.append(message)


def figures(rank: int, seq: int, kind: str = "") -> RankFigures:
    rng = random.Random(rank * 7919 + seq)
    late = {"cpu-slow": 0.020, "compute-slow": 0.012, "data-slow": 0.025}.get(kind, 0.0)
    comm = tuple(40.0 - late * 1e3 - rng.random() * 0.2 for _ in range(SLOTS))  # the late wait less
    return RankFigures(rank=rank, steps=SLOTS, first_step=(seq - 1) * SLOTS + 1, last_step=seq * SLOTS,
                       step_ms=100.0 + rng.random(), data_ms=0.5 + (25.0 if kind == "data-slow" else 0.0),
                       comm_ms=sum(comm) / SLOTS,
                       cpu_stall_ms=0.1 + (20.0 if kind == "cpu-slow" else 0.0), nccl_runq_ms=0.05,
                       main_cpu_ms=75.0, main_mhz=None, comm_steps=comm)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------- part 1: real ranks
def _rank(rank: int, world: int, port: int, exchanges: int, out, master: str = "127.0.0.1") -> None:
    import torch.distributed as dist

    from placement.monitor.crossrank.exchange import default_store

    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    reports = []
    ex = Exchange(rank, world, default_store(), _Warn(), slots=SLOTS, node_rank=rank // 8,
                  liveness=PeerLiveness(world) if rank == 0 else None)
    dist.barrier()
    for seq in range(1, exchanges + 1):
        time.sleep(0.02)  # the steps of a window
        reports.extend(v.report for v in ex.submit([figures(rank, seq, "cpu-slow" if rank == 1 else "")]))
    reports.extend(v.report for v in ex.close(timeout_s=10.0))
    dist.barrier()
    named = [r.names() for r in reports]
    out.put({"rank": rank, "send_us": list(ex.send_us), "send_cpu_us": list(ex.send_cpu_us),
             "judge_ms": list(ex.judge_ms), "named": named})
    dist.destroy_process_group()


def real_ranks(world: int, exchanges: int) -> dict:
    ctx = mp.get_context(START)
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, exchanges, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return summary(world, results)


def summary(world: int, results: list[dict]) -> dict:
    sends = [us for r in results for us in r["send_us"][1:]]  # the first pays connection warm-up
    cpu = [us for r in results for us in r["send_cpu_us"][1:]]
    rank0 = next(r for r in results if r["rank"] == 0)
    named_ok = sum(1 for n in rank0["named"] if n == [1])
    return {"world": world, "per_rank_us": statistics.median(cpu), "per_rank_p90_us": _p90(cpu),
            "per_rank_wall_us": statistics.median(sends), "per_rank_wall_p90_us": _p90(sends),
            "rank0_ms": statistics.median(rank0["judge_ms"][1:] or rank0["judge_ms"]),
            "judged": len(rank0["named"]), "named_rank1": named_ok}


def _p90(values):
    s = sorted(values)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


# ---------------------------------------------------------------- part 2: the judging side at scale
def kind_of(rank: int, world: int) -> str:
    if 40 <= rank < 48:
        return "cpu-slow"  # one slow node
    if rank == world - 3:
        return "data-slow"
    if rank % (world // 40) == 5 and rank >= 48:
        return "compute-slow"
    return ""


def _sender(todo, done) -> None:
    """One store client sending the rows of a share of ranks, for whatever job it is told."""
    import torch.distributed as dist

    from placement.monitor.crossrank.exchange import StoreTransport

    port = None
    while True:
        job = todo.get()
        if job is None:
            return
        job_port, world, first, last, seq = job
        if job_port != port:
            port = job_port
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
            transport = StoreTransport(store, 0, world)
        rows = [encode_row(seq, r // 8, figures(r, seq, kind_of(r, world)), SLOTS) for r in range(first, last)]
        t0 = time.perf_counter()
        for row in rows:
            transport.send(seq, row)
        done.put((time.perf_counter() - t0) / max(1, len(rows)) * 1e6)


class Senders:
    """Sender processes, started once and reused for every W."""

    def __init__(self, n: int):
        ctx = mp.get_context(START)
        self.queues = [ctx.Queue() for _ in range(n)]
        self.done = ctx.Queue()
        self.procs = [ctx.Process(target=_sender, args=(q, self.done)) for q in self.queues]
        for p in self.procs:
            p.start()

    def send(self, port: int, world: int, seq: int) -> list[float]:
        share = math.ceil(world / len(self.queues))
        for i, q in enumerate(self.queues):
            q.put((port, world, i * share, min(world, (i + 1) * share), seq))
        return [self.done.get(timeout=120) for _ in self.queues]

    def stop(self) -> None:
        for q in self.queues:
            q.put(None)
        for p in self.procs:
            p.join(timeout=60)


def judging_side(world: int, exchanges: int, senders: Senders) -> dict:
    import torch.distributed as dist

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=60))
    events = []
    warn = _Warn()
    ex = Exchange(0, world, server, warn, slots=SLOTS, liveness=PeerLiveness(world))
    send_us = []
    for seq in range(1, exchanges + 1):
        send_us.extend(senders.send(port, world, seq))
        ex._seq = seq
        ex._pending = (seq, time.monotonic())
        events.extend(straggler_event(v) for v in ex.collect(block=True))
    last = events[-1] if events else {}
    return {"world": world, "rank0_ms": statistics.median(ex.judge_ms), "take_ms": statistics.median(ex.take_ms),
            "sender_us_per_rank": statistics.median(send_us), "bytes_to_rank0": world * ROW_BYTES,
            "event_bytes": len(json.dumps(last)), "named": [(s["kind"], s["ranks"]) for s in last.get("stragglers", [])],
            "more": last.get("more", {}), "warnings": warn.lines[:2]}


# ------------------------------------------------------------------ --hosts: ranks on bed hosts
def host_ranks(first: int, local: int, world: int, master: str, port: int, exchanges: int) -> None:
    """Inside one host of the bed: its `local` ranks from `first`, forked from here; their
    results, one JSON list, on stdout."""
    import torch.distributed  # noqa: F401  (once, here: the forked ranks inherit it)

    ctx = mp.get_context(START)
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, exchanges, out, master))
             for r in range(first, first + local)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    print(json.dumps(results))


def on_hosts(n_hosts: int, per_host: int, exchanges: int) -> dict:
    """`per_host` real ranks on each of `n_hosts` hosts of a new bed; the summary of real_ranks."""
    import subprocess

    sys.path.insert(0, str(REPO / "tests"))
    from hostbed import HostBed  # tests/hostbed.py: the bed lives with the tests that use it

    world = n_hosts * per_host
    bed = HostBed.create(n_hosts)
    try:
        master, port = bed.hosts[0].addr, 29500
        procs = [subprocess.Popen(h.argv([sys.executable, __file__, "--host-ranks", str(h.index * per_host),
                                          str(per_host), str(world), master, str(port), str(exchanges)]),
                                  stdout=subprocess.PIPE, text=True, env=h.env(), cwd=REPO)
                 for h in bed.hosts]
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"exchange_scale: a host's ranks failed (exit {p.returncode})")
            results.extend(json.loads(out.strip().splitlines()[-1]))
    finally:
        bed.close()
    return {"hosts": n_hosts, **summary(world, results)}


def hosts_main(n_hosts: int, exchanges: int) -> None:
    rows = []
    for hosts, per_host in ((1, 2 * n_hosts), (n_hosts, 2)):
        r = on_hosts(hosts, per_host, exchanges)
        rows.append(r)
        print(f"W={r['world']} on {hosts} host(s): per rank {r['per_rank_us']:.0f} us CPU/exchange "
              f"(p90 {r['per_rank_p90_us']:.0f}), wall {r['per_rank_wall_us']:.0f} us (p90 {r['per_rank_wall_p90_us']:.0f}), "
              f"rank 0 {r['rank0_ms']:.2f} ms; rank 1 named in {r['named_rank1']}/{r['judged']} windows", flush=True)
    one, many = rows
    print(json.dumps({"hosts": n_hosts, "world": many["world"],
                      "per_rank_us": {"1_host": round(one["per_rank_us"], 1), f"{n_hosts}_hosts": round(many["per_rank_us"], 1)},
                      "per_rank_wall_us": {"1_host": round(one["per_rank_wall_us"], 1),
                                           f"{n_hosts}_hosts": round(many["per_rank_wall_us"], 1)},
                      "rank0_ms": {"1_host": round(one["rank0_ms"], 2), f"{n_hosts}_hosts": round(many["rank0_ms"], 2)},
                      "hosts_over_one_per_rank": round(many["per_rank_us"] / one["per_rank_us"], 2),
                      "named_rank1": all(r["named_rank1"] >= r["judged"] - 1 for r in rows)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer exchanges (< 1 minute)")
    ap.add_argument("--exchanges", type=int)
    ap.add_argument("--hosts", type=int, choices=range(2, 9), metavar="N",
                    help="real ranks, 2 per host, on N hosts of the test bed (2..8) against one host")
    ap.add_argument("--host-ranks", nargs=6, help=argparse.SUPPRESS)  # inside a bed host (on_hosts)
    args = ap.parse_args()
    if args.host_ranks:
        first, local, world, master, port, exchanges = args.host_ranks
        host_ranks(int(first), int(local), int(world), master, int(port), int(exchanges))
        return
    if args.hosts:
        hosts_main(args.hosts, args.exchanges or (20 if args.quick else 50))
        return
    n_real = args.exchanges or (20 if args.quick else 30)
    n_judge = args.exchanges or (3 if args.quick else 10)
    import torch.distributed  # noqa: F401  (once, here: the forked ranks and senders inherit it)

    senders = Senders(4)
    real = []
    for w in (2, 4, 8, 16):
        r = real_ranks(w, n_real)
        real.append(r)
        print(f"W={w:>5} real ranks: per rank {r['per_rank_us']:.0f} us CPU/exchange (p90 {r['per_rank_p90_us']:.0f}), "
              f"wall {r['per_rank_wall_us']:.0f} us (p90 {r['per_rank_wall_p90_us']:.0f}), "
              f"rank 0 {r['rank0_ms']:.2f} ms; rank 1 named in {r['named_rank1']}/{r['judged']} windows", flush=True)
    judged = []
    try:
        for w in (1024, 4096, 16384):
            j = judging_side(w, n_judge, senders)
            judged.append(j)
            print(f"W={w:>5} judging side: rank 0 {j['rank0_ms']:.1f} ms/exchange (store {j['take_ms']:.1f} ms), "
                  f"{j['bytes_to_rank0'] / 2**20:.2f} MiB to rank 0, sender {j['sender_us_per_rank']:.0f} us per rank; "
                  f"event {j['event_bytes']} bytes names {j['named']} and counts {j['more']}", flush=True)
    finally:
        senders.stop()
    per_rank = {str(r["world"]): round(r["per_rank_us"], 1) for r in real}
    head = {"per_rank_us": per_rank,
            "per_rank_wall_us": {str(r["world"]): round(r["per_rank_wall_us"], 1) for r in real},
            f"per_rank_w{real[-1]['world']}_over_w2": round(real[-1]["per_rank_us"] / real[0]["per_rank_us"], 2),
            "rank0_ms": {str(j["world"]): round(j["rank0_ms"], 1) for j in judged},
            "rank0_real_ms": {str(r["world"]): round(r["rank0_ms"], 2) for r in real},
            "bytes_per_rank": ROW_BYTES,
            "bytes_to_rank0": {str(j["world"]): j["bytes_to_rank0"] for j in judged},
            "event_bytes": {str(j["world"]): j["event_bytes"] for j in judged},
            "named_rank1_real": all(r["named_rank1"] >= r["judged"] - 1 for r in real)}
    head["met"] = real[-1]["per_rank_us"] <= 1.5 * real[0]["per_rank_us"] and head["rank0_ms"]["16384"] < 100
    print(json.dumps(head))


if __name__ == "__main__":
    main()
