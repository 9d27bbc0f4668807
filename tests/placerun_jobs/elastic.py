"""A rank for tests/placerun/test_placerun_elastic.py: reports its attempt, pid, plan and CPU mask; on the
first attempt it waits to be killed, once the test has marked the kill it finishes at once.

    elastic.py OUT_DIR

(TORCHELASTIC_RESTART_COUNT does not tell attempts apart: an agent whose own workers did not
fail restarts them for the re-rendezvous without counting a restart.)
"""
import json
import os
import sys
import time

import torch.distributed as dist


def allowed():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    attempt = 1 if os.path.exists(os.path.join(out, "killed")) else 0
    rank = dist.get_rank()
    plan_file = os.environ.get("PLACEMENT_PLAN_FILE")  # unset under plain torchrun
    plan = json.load(open(plan_file))["plan"] if plan_file else None  # the hand-off file: config and plan
    name = os.path.join(out, f"attempt{attempt}.rank{rank}.json")
    with open(name + ".tmp", "w") as f:
        json.dump({"rank": rank, "attempt": attempt, "pid": os.getpid(), "allowed": allowed(), "plan": plan,
                   "plan_file": plan_file,
                   "restart_count": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}, f)
    os.rename(name + ".tmp", name)
    if attempt == 0:
        time.sleep(120)  # the test kills one rank; its agent restarts the job
        sys.exit(3)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
