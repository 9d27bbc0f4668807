"""A rank for tests/test_placerun_elastic.py: records its restart count, plan and CPU mask; on
the first attempt it waits to be killed, on a restart it finishes at once.

    elastic.py OUT_DIR
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
    rank, restart = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with open(os.environ["PLACEMENT_PLAN_FILE"]) as f:
        plan = json.load(f)
    name = os.path.join(out, f"rank{rank}.restart{restart}.json")
    with open(name + ".tmp", "w") as f:
        json.dump({"rank": rank, "restart": restart, "pid": os.getpid(), "allowed": allowed(), "plan": plan,
                   "plan_file": os.environ["PLACEMENT_PLAN_FILE"]}, f)
    os.rename(name + ".tmp", name)
    if restart == 0:
        time.sleep(120)  # the test kills one rank; its agent restarts the job
        sys.exit(3)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
