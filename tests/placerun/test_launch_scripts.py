"""launch/: each script is valid shell or YAML, and the placerun command line it builds parses with
placerun's own parser. Slurm's srun/scontrol and the Kubernetes operator cannot exist here: small
stand-ins run the scripts' real command lines, and a recording `placerun` captures the argv."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from placement.config import load_config
from placement.launcher import parse_placerun_args

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
SHELL_SCRIPTS = sorted(p for p in LAUNCH.iterdir() if p.suffix in (".sh", ".sbatch"))
VENV_BIN = str(Path(sys.executable).parent)

# Records its argv, its CPU mask and the env it ran with, as one JSON line per invocation.
RECORDER = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["RECORD_FILE"], "a") as f:
    f.write(json.dumps({{"prog": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
                        "cpus": sorted(os.sched_getaffinity(0)),
                        "env": {{k: v for k, v in os.environ.items() if k.startswith(("SRUN_", "SLURM_"))}}}}) + "\\n")
"""

# srun stand-in: records its own argv, then runs the task command (after srun's options) under the
# CPU mask Slurm's task/affinity plugin would give the task (SLURM_TASK_CPUS), like one task per node.
FAKE_SRUN = RECORDER + f"""
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
cpus = os.environ.get("SLURM_TASK_CPUS")
if cpus:
    os.sched_setaffinity(0, {{int(c) for c in cpus.split(",")}})
os.execvp(args[0], args)
"""

FAKE_SCONTROL = f"""#!{sys.executable}
import sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("gpu-node-017\\ngpu-node-018")
"""


def _fake_bin(tmp_path: Path, **programs: str) -> Path:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name, text in programs.items():
        p = d / name
        p.write_text(text)
        p.chmod(0o755)
    return d


def _run(script: Path, args: list[str], tmp_path: Path, env: dict[str, str], fake: Path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    record = tmp_path / "record.jsonl"
    full_env = {"PATH": f"{fake}:{VENV_BIN}:/usr/bin:/bin", "HOME": str(tmp_path), "RECORD_FILE": str(record), **env}
    proc = subprocess.run(["bash", str(script), *args], env=full_env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return proc, calls


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=[p.name for p in SHELL_SCRIPTS])
def test_shell_syntax(script):
    assert shutil.which("bash"), "bash is needed to check the launch scripts"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert os.access(script, os.X_OK), f"{script.name} is not executable"


def test_bare_metal_single_node(tmp_path):
    fake = _fake_bin(tmp_path, placerun=RECORDER)
    proc, calls = _run(LAUNCH / "bare_metal.sh", ["train.py", "--steps", "5"], tmp_path,
                       {"NPROC_PER_NODE": "2", "PLACEMENT_DOCTOR": "0",
                        "PLACERUN_ARGS": "placement.policy=exclusive placement.tune.enabled=false"}, fake)
    assert proc.returncode == 0, proc.stderr
    [call] = calls
    pa = parse_placerun_args(call["argv"])
    t = pa.torch_args
    assert t.standalone and t.nproc_per_node == "2"
    assert (t.training_script, t.training_script_args) == ("train.py", ["--steps", "5"])
    assert pa.overrides == ["placement.policy=exclusive", "placement.tune.enabled=false"]


def test_bare_metal_multi_node_uses_c10d(tmp_path):
    fake = _fake_bin(tmp_path, placerun=RECORDER)
    proc, calls = _run(LAUNCH / "bare_metal.sh", ["train.py"], tmp_path,
                       {"NNODES": "2", "MASTER_ADDR": "10.0.0.1", "NPROC_PER_NODE": "8", "PLACEMENT_DOCTOR": "0"}, fake)
    assert proc.returncode == 0, proc.stderr
    t = parse_placerun_args(calls[0]["argv"]).torch_args
    assert (t.nnodes, t.rdzv_backend, t.rdzv_endpoint, t.nproc_per_node) == ("2", "c10d", "10.0.0.1:29500", "8")
    assert not t.standalone


def test_bare_metal_errors_are_one_line(tmp_path):
    fake = _fake_bin(tmp_path, placerun=RECORDER)
    proc, calls = _run(LAUNCH / "bare_metal.sh", ["train.py"], tmp_path,
                       {"NNODES": "2", "NPROC_PER_NODE": "8", "PLACEMENT_DOCTOR": "0"}, fake)
    assert proc.returncode != 0 and not calls
    assert "MASTER_ADDR" in proc.stderr
    proc, calls = _run(LAUNCH / "bare_metal.sh", [], tmp_path, {}, fake)
    assert proc.returncode == 2 and "usage:" in proc.stderr and not calls


def test_bare_metal_runs_doctor_first(tmp_path):
    """The real `placement doctor` on this host goes to the log before placerun starts; its
    findings never stop the launch."""
    fake = _fake_bin(tmp_path, placerun=RECORDER)
    proc, calls = _run(LAUNCH / "bare_metal.sh", ["train.py"], tmp_path, {"NPROC_PER_NODE": "1"}, fake)
    assert proc.returncode == 0, proc.stderr
    assert "placement doctor: root /" in proc.stdout
    assert len(calls) == 1


SLURM_ENV = {"SLURM_JOB_NODELIST": "gpu-node-[017-018]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
             "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "96"}


def _sbatch_header(script: Path) -> dict[str, str]:
    out = {}
    for m in re.finditer(r"^#SBATCH --([\w-]+)=(\S+)", script.read_text(), re.M):
        out[m.group(1)] = m.group(2)
    return out


def test_slurm_sbatch_builds_a_c10d_placerun_per_node(tmp_path):
    fake = _fake_bin(tmp_path, placerun=RECORDER, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    proc, calls = _run(LAUNCH / "slurm.sbatch", ["examples/train_ddp.py", "--steps", "100"], tmp_path,
                       dict(SLURM_ENV, PLACERUN_ARGS="placement.tune.enabled=false"), fake)
    assert proc.returncode == 0, proc.stderr
    srun, placerun = calls
    assert srun["prog"] == "srun" and "--kill-on-bad-exit=1" in srun["argv"]
    assert "--cpu-bind=none" not in srun["argv"], "Slurm's own binding must stand"
    # srun stopped inheriting --cpus-per-task from sbatch in Slurm 22.05.
    assert srun["env"]["SRUN_CPUS_PER_TASK"] == "96"
    pa = parse_placerun_args(placerun["argv"])
    t = pa.torch_args
    assert (t.nnodes, t.nproc_per_node, t.rdzv_backend) == ("2", "8", "c10d")
    assert (t.rdzv_endpoint, t.rdzv_id) == ("gpu-node-017:29500", "4242")
    assert (t.training_script, t.training_script_args) == ("examples/train_ddp.py", ["--steps", "100"])
    assert pa.overrides == ["placement.monitor.log_dir=placement_logs/4242", "placement.tune.enabled=false"]
    header = _sbatch_header(LAUNCH / "slurm.sbatch")
    assert header["ntasks-per-node"] == "1" and int(header["cpus-per-task"]) > 1
    # METRICS_PORT: each node's placerun serves its ranks' live metrics there
    proc, calls = _run(LAUNCH / "slurm.sbatch", ["train.py"], tmp_path, dict(SLURM_ENV, METRICS_PORT="9450"), fake)
    assert proc.returncode == 0, proc.stderr
    pa = parse_placerun_args(calls[-1]["argv"])
    assert "placement.metrics.port=9450" in pa.overrides and load_config(pa.overrides).metrics.port == 9450


def test_slurm_task_cpuset_reaches_placerun(tmp_path):
    """The CPU mask Slurm gives the task is the one placerun starts with (nothing widens it)."""
    last = max(os.sched_getaffinity(0))
    fake = _fake_bin(tmp_path, placerun=RECORDER, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    proc, calls = _run(LAUNCH / "slurm.sbatch", ["train.py"], tmp_path,
                       dict(SLURM_ENV, SLURM_TASK_CPUS=str(last)), fake)
    assert proc.returncode == 0, proc.stderr
    assert calls[1]["prog"] == "placerun" and calls[1]["cpus"] == [last]


@pytest.mark.slow
def test_slurm_dry_run_plans_inside_the_task_cpuset(tmp_path):
    """The real placerun under the task's one-CPU mask plans only that CPU."""
    last = max(os.sched_getaffinity(0))
    fake = _fake_bin(tmp_path, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    env = dict(SLURM_ENV, SLURM_TASK_CPUS=str(last), NPROC_PER_NODE="1", SLURM_NNODES="1",
               PLACERUN_ARGS="--dry-run placement.strict=false")
    proc, _ = _run(LAUNCH / "slurm.sbatch", ["train.py"], tmp_path, env, fake)
    assert proc.returncode == 0, proc.stderr
    assert set(_planned_cpus(proc.stdout)) == {"main", "nccl", "pin_memory", "dataloader", "other"}, proc.stdout
    assert set(_planned_cpus(proc.stdout).values()) == {str(last)}, proc.stdout


def _planned_cpus(table: str) -> dict[str, str]:
    """role -> cpus column of `placerun --dry-run`'s plan table (fixed-width columns)."""
    lines = table.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("rank "))
    header = lines[i]
    role, cpus, reason = header.index("role"), header.index("cpus"), header.index("reason")
    out = {}
    for line in lines[i + 1:]:
        if line.startswith(("env ", "warning:", "worker command:")):
            break
        out[line[role:cpus].strip()] = line[cpus:reason].strip()
    return out


def _k8s_expand(text: str, env: dict[str, str]) -> str:
    # Kubernetes expands $(VAR) in command/args from the container's env; unknown ones stay as written.
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def test_pytorchjob_manifest(monkeypatch):
    docs = list(yaml.safe_load_all((LAUNCH / "pytorchjob.yaml").read_text()))
    [job] = docs
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    nodes = sum(s["replicas"] for s in specs.values())
    # What the training operator sets in every pod (PET_* are torchrun's env defaults).
    operator_env = {"MASTER_ADDR": "placement-train-master-0", "MASTER_PORT": "23456",
                    "PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"]}
    for k, v in operator_env.items():
        monkeypatch.setenv(k, v)
    for role, spec in specs.items():
        [c] = spec["template"]["spec"]["containers"]
        assert c["command"] == ["placerun"]
        pa = parse_placerun_args([_k8s_expand(a, operator_env) for a in c["args"]])
        t = pa.torch_args
        assert t.rdzv_backend == "c10d" and t.rdzv_endpoint == "placement-train-master-0:23456"
        assert int(t.nnodes) == nodes and t.nproc_per_node == job["spec"]["nprocPerNode"]
        assert "placement.strict=false" in pa.overrides
        # live metrics: placerun serves the pod's ranks on the port the annotations name
        port = spec["template"]["metadata"]["annotations"]["prometheus.io/port"]
        assert f"placement.metrics.port={port}" in pa.overrides
        assert {"name": "metrics", "containerPort": int(port)} in c["ports"]
        res = c["resources"]
        # Guaranteed QoS with whole CPUs: the static CPU manager gives the pod an exclusive cpuset.
        assert res["requests"] == res["limits"]
        assert float(res["limits"]["cpu"]).is_integer()
        assert res["limits"]["nvidia.com/gpu"] == int(job["spec"]["nprocPerNode"])
