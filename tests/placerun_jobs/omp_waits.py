"""The worker of tests/bind/test_bind_openmp.py: small ops on torch's 2-thread OpenMP pool, back to
back; prints one JSON line: main's mask as torch's import left it and now, the pool's new
threads, and their voluntary context switches per op (a wait that ended in a futex sleep)."""
import json
import os
import time

before_import = sorted(os.sched_getaffinity(0))
import torch  # noqa: E402  (the import is what the test is about)

after_import = sorted(os.sched_getaffinity(0))
OPS = int(os.environ.get("OMP_WAITS_OPS", "3000"))


def tids():
    return set(int(t) for t in os.listdir("/proc/self/task"))


def voluntary(tid):
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


known = tids()
torch.set_num_threads(2)
a, b = torch.ones(1 << 17), torch.ones(1 << 17)
out = torch.empty_like(a)
torch.add(a, b, out=out)  # the first parallel region: the pool's thread exists from here on
pool = sorted(tids() - known)


def cpus(tid):
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()


if os.environ.get("OMP_WAITS_BOUND") == "1":  # under placerun: the watcher moves the pool's thread off main's core
    deadline = time.monotonic() + 30
    while any(cpus(t) == cpus(os.getpid()) for t in pool) and time.monotonic() < deadline:
        time.sleep(0.05)
for _ in range(50):
    torch.add(a, b, out=out)
start = {t: voluntary(t) for t in pool}
for _ in range(OPS):
    torch.add(a, b, out=out)
switches = sum(voluntary(t) - start[t] for t in pool)
print(json.dumps({"before_import": before_import, "after_import": after_import,
                  "main_now": sorted(os.sched_getaffinity(0)), "pool": len(pool), "ops": OPS,
                  "switches_per_op": switches / OPS}), flush=True)
