"""What the memory-residence readers cost on a big process, and whether they stall its other threads.

This process allocates and touches GIB GiB (4 by default; every page written, in 4 KiB pages:
madvise(MADV_NOHUGEPAGE), the page-table walk's worst case; --thp leaves transparent huge pages
to the kernel, which makes the full read ~500x cheaper), then:
- sample: placement.residence.sample_process (maps read + move_pages(2) in query mode on
  SAMPLE_PAGES addresses): us per look and per page asked;
- full read: read_process (/proc/self/numa_maps, every page table walked): us per read;
- stall: while each reader runs in a loop on a second thread, the main thread maps, touches and
  unmaps 1 MiB over and over (mmap and munmap take the mmap lock for writing, as a training
  thread's allocator does); its slowest and median round, against the same with no reader.

    python benchmarks/residence.py [--quick] [--gib N]

Last line: {"gib": ..., "sample_us": ..., "sample_us_per_page": ..., "numa_maps_us": ...,
"stall_max_ms": {"none": ..., "sample": ..., "numa_maps": ...}, ...}
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from placement.residence import SAMPLE_PAGES, read_process, sample_process  # noqa: E402


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def mmap_rounds(seconds: float) -> list[float]:
    """ms per map + touch + unmap of 1 MiB, repeated for `seconds`."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter_ns()
        m = mmap.mmap(-1, 1 << 20)
        m[::4096] = b"x" * 256
        m.close()
        out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


def under(reader, seconds: float) -> list[float]:
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            reader()

    t = threading.Thread(target=loop, daemon=True)
    if reader is not None:
        t.start()
    try:
        return mmap_rounds(seconds)
    finally:
        stop.set()
        if reader is not None:
            t.join()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (well under a minute)")
    p.add_argument("--gib", type=float, default=4.0, help="GiB to allocate and touch (default 4)")
    p.add_argument("--thp", action="store_true", help="let the kernel use transparent huge pages")
    args = p.parse_args(argv)
    n_sample, n_full, stall_s = (20, 3, 2.0) if args.quick else (200, 10, 5.0)

    t0 = time.monotonic()
    big = mmap.mmap(-1, int(args.gib * (1 << 30)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if not args.thp:
        big.madvise(mmap.MADV_NOHUGEPAGE)
    np.frombuffer(big, dtype=np.uint8)[:] = 1  # every page written: resident
    touch_s = time.monotonic() - t0
    node = next(iter(read_process([0]).by_node), 0)
    planned = [node]

    sample = timed(lambda: sample_process(planned), n_sample)
    last = sample_process(planned)
    full = timed(lambda: read_process(planned), n_full)
    exact = read_process(planned)
    print(f"{args.gib:g} GiB touched in {touch_s:.1f} s; {exact.resident} resident anonymous pages")
    print(f"sample ({SAMPLE_PAGES} addresses): median {statistics.median(sample):.0f} us "
          f"({statistics.median(sample) / max(1, last.asked):.3f} us/page asked), {last.describe()}")
    print(f"numa_maps full read: median {statistics.median(full):.0f} us, {exact.describe()}")

    stalls = {}
    for name, reader in (("none", None), ("sample", lambda: sample_process(planned)),
                         ("numa_maps", lambda: read_process(planned))):
        rounds = under(reader, stall_s)
        stalls[name] = (max(rounds), statistics.median(rounds))
        print(f"mmap+touch+munmap 1 MiB while {name:9} runs: max {max(rounds):.2f} ms, "
              f"median {statistics.median(rounds):.3f} ms over {len(rounds)} rounds")
    big.close()
    print(json.dumps({
        "gib": args.gib, "thp": args.thp, "sample_pages": SAMPLE_PAGES, "sample_us": round(statistics.median(sample), 1),
        "sample_us_per_page": round(statistics.median(sample) / max(1, last.asked), 4),
        "sample_share_pct": last.share_pct, "numa_maps_us": round(statistics.median(full), 1),
        "numa_maps_us_per_gib": round(statistics.median(full) / args.gib, 1),
        "stall_max_ms": {k: round(v[0], 2) for k, v in stalls.items()},
        "stall_median_ms": {k: round(v[1], 3) for k, v in stalls.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
