"""The real gloo job the detection and precision benchmarks run: WORLD rank processes of one
script on this host (env:// rendezvous on a free port), each attached to placement with policy
none, the tuner off and the monitor settings the command line overrides."""
from __future__ import annotations

import os
import socket
import subprocess
import sys


def start_ranks(world: int, argv: list[str], **popen) -> list[subprocess.Popen]:
    """`world` processes of `python argv...`, rank r with RANK=r and the rest of torchrun's env."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, **popen))
    return procs


def attach_rank(log_dir: str, overrides: str):
    """In a rank process: join the gloo group, attach (the monitor's keys from `overrides`,
    'placement.monitor.KEY=VALUE,...'); (rank, handle)."""
    import torch.distributed as dist

    import placement

    dist.init_process_group("gloo")
    monitor = {"log_dir": log_dir, "summary_every": 0}
    for kv in filter(None, overrides.split(",")):
        k, v = kv.split("=", 1)
        monitor[k.removeprefix("placement.monitor.")] = float(v)
    return dist.get_rank(), placement.attach(policy="none", tune={"enabled": False}, monitor=monitor)


def monitor_config(name: str, overrides: list[str]):
    """The config the command line's placement.monitor.KEY=VALUE overrides make, or None after
    saying in one line why they are not valid (the caller exits 2)."""
    from placement.config import load_config
    from placement.errors import ConfigError

    try:
        return load_config(overrides)
    except ConfigError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return None
