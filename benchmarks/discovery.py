"""Topology discovery time: placement's discover() against hwloc's lstopo on the same tree, and on
the live machine.

usage: python benchmarks/discovery.py [--quick] [--repeat N]

The tree is the largest of ../shared/topologies (most online CPUs), extracted to tmpfs; without
../shared, the largest fixture of tests/sysfs_builder.py. lstopo (Debian package `hwloc`) reads
the same tree through HWLOC_FSROOT; without it its figures are null. Every figure is the median
of N runs after one warm-up run (page cache warm for both tools).

Measured side by side:
  discover(tree)        in-process call, what placement pays at start-up
  lstopo                whole process (`lstopo-no-graphics --of xml`), exec and library load included
  placement topo        whole process (`python -m placement.cli topo --json`), Python start-up included
  discover("/")         live: sysfs + NVML attempt + membind probe (fork), each also timed alone
The last line is one JSON object of headline figures.
"""
from __future__ import annotations

import argparse
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
sys.path.insert(0, str(REPO / "tests"))

from placement.topology import discover  # noqa: E402
from placement.topology.gpus import nvml_gpus  # noqa: E402
from placement.topology.kernel import membind_allowed  # noqa: E402
from sysfs_builder import FIXTURES, SHARED, extract_tree, make_tree  # noqa: E402


def median_ms(fn, repeat: int) -> float:
    fn()  # warm-up: page cache, imports
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def largest_tree(workdir: str) -> tuple[str, str]:
    """(label, root) of the shared tree with most online CPUs, or of the largest fixture."""
    tarballs = sorted((SHARED / "topologies").glob("*.tar.bz2"))
    if tarballs:
        def cpus(t: Path) -> int:
            return len(json.loads(Path(str(t).removesuffix(".tar.bz2") + ".truth.json").read_text())["online"])

        best = max(tarballs, key=lambda t: (cpus(t), t.stat().st_size))
        return best.name.removesuffix(".tar.bz2"), extract_tree(best, tempfile.mkdtemp(dir=workdir))
    name = max(FIXTURES, key=lambda n: len(FIXTURES[n]().cpus))
    return f"fixture {name} (../shared absent)", make_tree(workdir, name)


def count_files(root: str) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def lstopo_ms(root: str, repeat: int):
    exe = shutil.which("lstopo-no-graphics") or shutil.which("lstopo")
    if exe is None:
        return None
    env = dict(os.environ, HWLOC_FSROOT=root)
    cmd = [exe, "--of", "xml", "-"]

    def once() -> None:
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)

    return median_ms(once, repeat)


def cli_ms(root: str, repeat: int) -> float:
    cmd = [sys.executable, "-m", "placement.cli", "topo", "--root", root, "--json"]

    def once() -> None:
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)

    return median_ms(once, repeat)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (well under a minute)")
    parser.add_argument("--repeat", type=int, default=None, help="runs per figure (default 5 quick, 30 full)")
    args = parser.parse_args(argv)
    repeat = args.repeat or (5 if args.quick else 30)

    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    workdir = tempfile.mkdtemp(prefix="placement-bench-", dir=shm)
    try:
        label, root = largest_tree(workdir)
        topo = discover(root)
        print(f"tree: {label}: {len(topo.cpus)} CPUs, {len(topo.numa_nodes)} NUMA nodes, "
              f"{count_files(root)} files; median of {repeat} runs")
        disc = median_ms(lambda: discover(root), repeat)
        lst = lstopo_ms(root, repeat)
        try:
            cli = cli_ms(root, max(3, repeat // 5))
        except subprocess.CalledProcessError as e:
            cli = None
            print(f"  (placement topo CLI failed: exit {e.returncode})")
        ratio = None if lst is None else disc / lst
        print(f"  discover(tree)             {disc:8.2f} ms   in-process")
        print(f"  lstopo, HWLOC_FSROOT=tree  " + ("    null      lstopo not installed (apt-get install hwloc)"
                                                  if lst is None else f"{lst:8.2f} ms   whole process"))
        print(f"  placement topo --json      " + ("    null" if cli is None else f"{cli:8.2f} ms   whole process"))
        print(f"  ratio discover/lstopo      " + ("    null" if ratio is None else f"{ratio:8.2f}"))

        live = median_ms(lambda: discover("/"), repeat)
        nvml = median_ms(nvml_gpus, repeat)
        probe = median_ms(membind_allowed, repeat)
        sysfs_only = median_ms(lambda: discover("/", live=False), repeat)
        print(f"live machine: {len(discover('/').cpus)} CPUs")
        print(f"  discover('/')              {live:8.2f} ms   target < 50 ms")
        print(f"    sysfs/procfs only        {sysfs_only:8.2f} ms")
        print(f"    NVML attempt             {nvml:8.2f} ms   ({'loaded' if nvml_gpus() is not None else 'no driver'})")
        print(f"    membind probe (fork)     {probe:8.2f} ms")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def r(x):
        return None if x is None else round(x, 2)

    print(json.dumps({"discovery_ms": r(disc), "lstopo_ms": r(lst), "ratio": r(ratio), "live_ms": r(live)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
