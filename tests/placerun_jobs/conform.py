"""The worker of tests/placerun/test_torchrun_conformance.py: reports what a program sees of itself and of
its launcher (one JSON file per rank and restart), says hello on stdout, then does what
CONFORM_ACTION asks. Standard library only, so any interpreter (PYTHON_EXEC) runs it."""
import json
import os
import signal
import sys
import time


def allowed_cpus():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()


rank, restart = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
report = {"pid": os.getpid(), "name": __name__, "file": __file__, "argv": sys.argv, "path": sys.path,
          "executable": sys.executable, "env": dict(os.environ), "allowed": allowed_cpus(),
          "imported": sorted(m for m in ("torch", "numpy", "psutil") if m in sys.modules),
          "sitecustomize": sys.modules.get("sitecustomize") and getattr(sys.modules["sitecustomize"], "__file__", None)}
with open(os.path.join(os.environ["CONFORM_OUT"], f"rank{rank}.r{restart}.json"), "w") as f:
    json.dump(report, f)
os.write(1, f"conform rank {rank} says hello\n".encode())  # one write: lines of two workers never interleave
action = os.environ.get("CONFORM_ACTION", "")
if action in ("fail_once", "exit3", "raise", "kill"):
    time.sleep(1.5)  # every worker reports before the agent stops the others
if action == "fail_once" and rank == "0" and restart == "0":
    sys.exit(1)
if rank == "1" and action == "exit3":
    sys.exit(3)
if rank == "1" and action == "raise":
    raise RuntimeError("conform worker raised")
if rank == "1" and action == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if action == "sleep":
    time.sleep(120)
