"""`placement doctor` on fixture trees (tests/sysfs_builder.py) and on this host: each check's
status, evidence and fix; unreadable facts are `unknown`, never `pass`; the --json schema."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from placement.cli import main as cli_main
from placement.config import load_config
from placement.doctor import facts as doctor_facts
from placement.handoff import Handoff
from placement.doctor.command import SCHEMA, format_report, gather, report_dict
from placement.cpuset import format_cpulist, parse_cpulist
from placement.doctor.checks import (CHECKS, SEVERITIES, STATUSES, Facts, gpu_pair_sys, irq_hot_cores, membind,
                                    memory_residence, run_checks)
from placement.plan.make import make_plan
from placement.plan.model import JobSpec
from placement.roles import HOT_ROLES
from placement.topology import discover
from sysfs_builder import make_tree, shared_trees

CHECK_NAMES = [c.__name__ for c in CHECKS]


def _checks(root: str) -> dict:
    return {c.name: c for c in run_checks(gather(root))}


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("doctor-trees")
    built: dict[str, str] = {}

    def tree(name: str) -> str:
        if name not in built:
            built[name] = make_tree(base, name)
        return built[name]
    return tree


def test_numa_balancing_on_is_reported(trees):
    checks = _checks(trees("numa_balancing_on"))
    c = checks["numa_balancing"]
    assert (c.status, c.severity) == ("warn", "high")
    assert c.evidence == ["proc/sys/kernel/numa_balancing = 1"]
    assert c.fix.startswith("sudo sysctl -w kernel.numa_balancing=0")
    assert checks["cpu_governor"].status == "warn" and "powersave on CPUs 0-31" in checks["cpu_governor"].evidence[0]
    assert checks["turbo"].status == "warn" and "intel_pstate/no_turbo" in checks["turbo"].fix


def test_dgx_has_no_cross_node_gpu_nic_pair(trees):
    checks = _checks(trees("dgx_h100"))
    c = checks["gpu_nic_locality"]
    assert c.status == "pass", c
    assert len(c.evidence) == 8 and all(", PIX)" in e for e in c.evidence)
    assert checks["numa_balancing"].status == "pass"
    assert checks["cpuset_size"].status == "pass"
    # GPUs 0-3 and 4-7 meet through SYS; NVLink is NVML's to say, on the live host only.
    pairs = checks["gpu_pair_sys"]
    assert pairs.status == "unknown" and "16 GPU pairs on different NUMA nodes" in pairs.evidence[0]


def test_gpu_and_nic_on_different_nodes_is_reported(trees):
    c = _checks(trees("gpu_nic_cross_node"))["gpu_nic_locality"]
    assert (c.status, c.severity) == ("warn", "high")
    assert "GPU 0 (node 0) / mlx5_0 (node 1)" in c.summary and "GPU 1 (node 0) / mlx5_0 (node 1)" in c.summary
    assert c.evidence[0] == "GPU 0 (0000:18:00.0, node 0) -> nearest NIC mlx5_0 (0000:9b:00.0, node 1, SYS)"
    # The plan's NCCL cores for those ranks, on the NIC's node 1 (CPUs 8-15 and 24-31).
    nccl = [e for e in c.evidence if e.startswith("plan: local rank")]
    node1 = frozenset(range(8, 16)) | frozenset(range(24, 32))
    assert len(nccl) == 2 and all(parse_cpulist(e.rsplit(" ", 1)[1]) <= node1 for e in nccl)
    assert "NCCL_IB_HCA" in c.fix


def test_unreadable_facts_are_unknown_not_pass(trees, tmp_path):
    root = Path(shutil.copytree(trees("numa_balancing_on"), tmp_path / "stripped", symlinks=True))
    (root / "proc/sys/kernel/numa_balancing").unlink()
    for gov in root.glob("sys/devices/system/cpu/cpu*/cpufreq/scaling_governor"):
        gov.unlink()
    (root / "sys/devices/system/cpu/intel_pstate/no_turbo").unlink()
    checks = _checks(str(root))
    for name in ("numa_balancing", "cpu_governor", "turbo", "membind", "irq_hot_cores"):
        assert checks[name].status == "unknown", checks[name]
    assert checks["membind"].summary.endswith("(probed on the live host only)")


def test_offline_cpus(trees):
    c = _checks(trees("sparse_offline"))["offline_cpus"]
    assert c.status == "warn" and c.evidence == ["offline CPUs: 10-11"]
    assert "/sys/devices/system/cpu/cpu$c/online" in c.fix


def test_perf_rank_names_the_fastest_cores(trees):
    c = _checks(trees("small_cpu"))["perf_rank"]
    assert c.status == "info" and "(2,5,10,13) are used for hot threads" in c.summary
    assert "intel-speed-select" in c.fix


@pytest.mark.slow  # copies a whole DGX machine tree
def test_cpuset_too_small_for_the_gpus(trees, tmp_path):
    """The DGX tree inside a cgroup v2 cpuset of 4 CPUs: no plan for 8 ranks fits."""
    root = Path(shutil.copytree(trees("dgx_h100"), tmp_path / "dgx_cpuset", symlinks=True))
    (root / "proc/self/cgroup").write_text("0::/job42\n")
    (root / "sys/fs/cgroup/job42").mkdir(parents=True)
    (root / "sys/fs/cgroup/cgroup.controllers").write_text("cpuset cpu memory\n")
    (root / "sys/fs/cgroup/job42/cpuset.cpus.effective").write_text("0-3\n")
    (root / "sys/fs/cgroup/job42/cpuset.mems.effective").write_text("0\n")
    c = _checks(str(root))["cpuset_size"]
    assert (c.status, c.severity) == ("warn", "high"), c
    assert c.summary.startswith("the cpuset is too small for one rank per GPU")
    assert "usable CPUs (online, in the cpuset): 4 of 224 online (0-3), 4 whole cores, for 8 GPUs" in c.evidence[0]


def _hot(facts: Facts) -> frozenset[int]:
    return frozenset().union(*(r.cpus(role) for r in facts.plan.ranks for role in HOT_ROLES))


def test_irqbalance_moving_interrupts_onto_hot_cores(trees, tmp_path):
    root = Path(shutil.copytree(trees("small_cpu"), tmp_path / "irq", symlinks=True))
    hot = _hot(gather(str(root)))
    cold = sorted(frozenset(range(16)) - hot)
    hot_cpu = min(hot)
    lines = ["           " + " ".join(f"CPU{i}" for i in range(16))]
    for irq, cpu, count in ((40, hot_cpu, 9000), (41, cold[0], 5000), (42, hot_cpu, 0)):
        d = root / f"proc/irq/{irq}"
        d.mkdir(parents=True)
        (d / "smp_affinity_list").write_text(f"{cpu}\n")
        lines.append(f" {irq}: " + " ".join(str(count if i == cpu else 0) for i in range(16))
                     + f"  IR-PCI-MSIX-0000:3b:00.0 {irq}-edge  mlx5_comp{irq}")
    (root / "proc/interrupts").write_text("\n".join(lines) + "\n")
    (root / "proc/4242").mkdir()
    (root / "proc/4242/comm").write_text("irqbalance\n")
    c = irq_hot_cores(gather(str(root)))
    assert (c.status, c.summary) == ("warn", "1 IRQs are delivered to planned hot cores")  # 42 never fired
    assert f"IRQ 40 (IR-PCI-MSIX-0000:3b:00.0 40-edge mlx5_comp40, 9000 so far) -> CPUs {hot_cpu}" in c.evidence
    assert "irqbalance running (pid 4242)" in c.evidence
    assert c.fix.startswith(f"add IRQBALANCE_BANNED_CPULIST={format_cpulist(hot)} to /etc/default/irqbalance")
    (root / "proc/4242/comm").write_text("bash\n")  # irqbalance gone: steer the IRQ by hand
    c = irq_hot_cores(gather(str(root)))
    assert c.fix == f"for irq in 40; do echo {format_cpulist(cold)} | sudo tee /proc/irq/$irq/smp_affinity_list; done"


def test_gpu_pairs_through_sys_without_nvlink(trees):
    facts = gather(trees("dgx_h100"))
    gpus = facts.topology.gpus
    every_pair = {frozenset((a.pci, b.pci)) for a in gpus for b in gpus if a is not b}
    assert gpu_pair_sys(replace(facts, nvlink=every_pair)).status == "pass"  # NVSwitch: all pairs NVLink
    c = gpu_pair_sys(replace(facts, nvlink=set()))  # PCIe-only box
    assert c.status == "warn" and c.summary.startswith("16 GPU pairs only meet through SYS")
    assert "NCCL_BUFFSIZE" in c.fix and "NCCL_MAX_NCHANNELS" in c.fix and "all_reduce_perf" in c.fix


def test_membind_refused_by_the_container(trees):
    """What the live probe says inside a container whose cpuset.mems refuses MPOL_BIND."""
    facts = gather(trees("container_cgroup2"))
    refused = replace(facts, live=True, topology=replace(
        facts.topology, kernel=replace(facts.topology.kernel, membind_allowed=False)))
    c = membind(refused)
    assert (c.status, c.severity) == ("warn", "high") and "membind is refused" in c.summary
    assert "placement.memory=preferred" in c.fix
    allowed = replace(refused, topology=replace(refused.topology, kernel=replace(
        refused.topology.kernel, membind_allowed=True)))
    assert membind(allowed).status == "pass"


def test_a_failing_check_does_not_hide_the_others(trees):
    facts = gather(trees("small_cpu"))
    checks = run_checks(replace(facts, topology=None))
    assert [c.name for c in checks] == CHECK_NAMES
    assert {c.status for c in checks if c.summary.startswith("check failed")} == {"unknown"}
    assert checks[1].name == "cpu_governor" and checks[1].status == "pass"  # needs no topology


@pytest.mark.slow  # reads the real machines' trees (extracted from their tarballs)
def test_real_machine_trees():
    """The gathered trees of ../shared: every check answers; what a tree lacks is unknown."""
    for root in shared_trees():
        checks = run_checks(gather(root))
        assert [c.name for c in checks] == CHECK_NAMES
        assert not [c for c in checks if c.summary.startswith("check failed")], root
        by_name = {c.name: c for c in checks}
        assert by_name["membind"].status == "unknown"  # a tree is never the live host
        assert by_name["offline_cpus"].status in ("pass", "warn")


def test_json_schema(trees, capsys):
    rc = cli_main(["doctor", "--root", trees("numa_balancing_on"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1  # a problem was found
    assert out["schema"] == SCHEMA and out["live"] is False
    assert [c["name"] for c in out["checks"]] == CHECK_NAMES
    for c in out["checks"]:
        assert set(c) == {"name", "status", "severity", "summary", "evidence", "fix"}
        assert c["status"] in STATUSES and c["severity"] in SEVERITIES
        assert isinstance(c["evidence"], list) and isinstance(c["summary"], str) and "\n" not in c["summary"]
    assert sum(out["counts"].values()) == len(out["checks"])
    assert out["counts"]["warn"] == 3


def test_text_report_and_exit_codes(trees, capsys):
    assert cli_main(["doctor", "--root", trees("small_cpu")]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("placement doctor: root ")
    assert "perf_rank" in text and "fix: on Intel Xeon" in text


@pytest.mark.parametrize("args, needle", [
    (["--root", "/nonexistent/tree"], "/nonexistent/tree"),
    (["--nproc-per-node", "0"], "--nproc-per-node=0 is not valid; valid: an integer 1..8192"),
    (["placement.policy=fast"], "choose one of: auto, node"),
])
def test_bad_input_is_one_line_exit_2(args, needle, capsys):
    assert cli_main(["doctor", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("placement doctor: ")


def test_live_host_without_privileges(tmp_path):
    """The live checks with no capability at all (as root: every capability dropped, so nothing
    privileged can help): everything still reports, nothing raises."""
    cmd = [sys.executable, "-m", "placement.cli", "doctor", "--json"]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv to drop the capabilities")
        cmd = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--", *cmd]
        caps = subprocess.run(cmd[:5] + ["grep", "CapEff", "/proc/self/status"], capture_output=True, text=True)
        assert caps.stdout.split() == ["CapEff:", "0000000000000000"], caps
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode in (0, 1), proc.stderr
    out = json.loads(proc.stdout)
    assert out["live"] is True and [c["name"] for c in out["checks"]] == CHECK_NAMES


# ---- memory_residence: placement ranks running now, sampled by pid -------------------------------
RANK_CHILD = r"""
import subprocess, sys
data = bytearray(64 << 20)
for i in range(0, len(data), 4096):
    data[i] = 1  # touched: resident, on the node the kernel chose
# A DataLoader worker inherits the rank's environment; it is not a rank.
kid = subprocess.Popen([sys.executable, "-S", "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
print(kid.pid, flush=True)
sys.stdin.read()
kid.stdin.close()
kid.wait()
"""


def _plan_file(tmp_path, nodes=(0,)) -> str:
    """A real plan for one rank on this host, its memory bound to `nodes`."""
    plan = make_plan(discover("/"), JobSpec(nproc_per_node=1, gpus=[None], dataloader_workers=0, visible_gpus=[]),
                     load_config([]))
    plan.ranks[0].memory = replace(plan.ranks[0].memory, nodes=list(nodes))
    return Handoff(load_config([]), plan).write(str(tmp_path))


def test_a_running_rank_is_found_by_its_environment_and_sampled_by_pid(tmp_path):
    """A real process started as placerun starts a rank (PLACEMENT_PLAN_FILE, LOCAL_RANK, RANK),
    its pages asked with move_pages by pid: all on node 0, this host's only node. Its child (as a
    DataLoader worker, same environment) is not counted. `-S`: the worker hook must not run."""
    env = dict(os.environ, PLACEMENT_PLAN_FILE=_plan_file(tmp_path), LOCAL_RANK="0", RANK="3")
    rank = subprocess.Popen([sys.executable, "-S", "-c", RANK_CHILD], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        kid = int(rank.stdout.readline())
        running = doctor_facts.running_ranks()
    finally:
        rank.stdin.close()
        rank.wait(timeout=60)
    ours = [r for r in running.ranks if r.pid == rank.pid]
    assert len(ours) == 1 and not [r for r in running.ranks if r.pid == kid]
    r = ours[0]
    assert (r.rank, r.local_rank, r.memory_mode, r.null) == (3, 0, "bind", None)
    assert r.residence.planned == (0,) and r.residence.share_pct == 100.0 and r.residence.resident >= 1000
    c = memory_residence(Facts(topology=None, live=True, running=replace(running, ranks=ours)))
    assert c.status == "pass", c
    assert c.summary == f"1 running rank: rank 3 (pid {rank.pid}) 100.0% on node 0 (threshold 90%)"
    assert c.evidence[0].startswith(f"rank 3 (pid {rank.pid}), memory policy bind: process: 100.0% of ")


def _proc_tree(tmp_path, plan_file: str) -> Path:
    """A /proc of three processes of this user: a rank (pid 100), its DataLoader worker (101, same
    environment) and one whose environment cannot be read (102)."""
    proc = tmp_path / "proc"
    for pid, parent in ((100, 1), (101, 100), (102, 1)):
        d = proc / str(pid)
        d.mkdir(parents=True)
        (d / "status").write_text(f"Name:\tpython\nPPid:\t{parent}\nUid:\t{os.getuid()}\t0\t0\t0\n")
        (d / "maps").write_text("7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n"
                                "7f1000000000-7f1000001000 r-xp 00000000 08:01 42 /usr/lib/libc.so.6\n")
    env = f"PATH=/usr/bin\0PLACEMENT_PLAN_FILE={plan_file}\0LOCAL_RANK=0\0RANK=0\0".encode()
    (proc / "100/environ").write_bytes(env)
    (proc / "101/environ").write_bytes(env)
    (proc / "102/environ").mkdir()  # read as a file: refused, as EACCES would be
    return proc


def test_pages_on_another_node_are_named_with_the_command_that_moves_them(tmp_path):
    """Four nodes: the rank is bound to node 0, but the kernel answers that 3 of 4 sampled pages
    sit on node 2 and the rest on 0 (move_pages' answer, through the reader's query seam)."""
    proc = _proc_tree(tmp_path, _plan_file(tmp_path))
    running = doctor_facts.running_ranks(str(proc), query=lambda addrs: [0 if i % 4 == 0 else 2
                                                                         for i in range(len(addrs))])
    assert [r.pid for r in running.ranks] == [100] and set(running.unreadable) == {102}
    res = running.ranks[0].residence
    assert res.asked == 1024 and res.share_pct == 25.0 and res.elsewhere() == {2: 75.0}
    c = memory_residence(Facts(topology=None, live=True, running=running, residence_min_pct=90.0))
    assert c.status == "warn", c
    assert c.summary == "1 running rank, 1 below 90% of sampled pages on the planned node(s): rank 0 (pid 100) " \
                        "25.0% on node 0 (75.0% on node 2)"
    assert c.fix.startswith("migratepages 100 2 0  #")
    assert c.evidence[-1] == "1 of your processes could not be read, so a rank among them is not seen: pids 102 (EINVAL)"
    text = format_report("/", [c])
    assert "warn     medium   memory_residence  1 running rank, 1 below 90%" in text and "fix: migratepages 100 2 0" in text


def test_no_rank_running_is_one_line_and_a_bad_plan_file_is_named(tmp_path):
    c = memory_residence(Facts(topology=None, live=True, running=doctor_facts.RunningRanks()))
    assert (c.status, c.evidence) == ("n/a", []) and c.summary.startswith("no placement rank is running")
    assert memory_residence(Facts(topology=None, live=False)).status == "n/a"  # a --root tree: no process to ask
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    running = doctor_facts.running_ranks(str(_proc_tree(tmp_path, str(bad))), query=lambda a: [0] * len(a))
    c = memory_residence(Facts(topology=None, live=True, running=running))
    assert c.status == "unknown" and c.summary == "1 running rank: rank 0 (pid 100) not sampled (threshold 90%)"
    assert "is not a placement plan" in c.evidence[0]


def test_doctor_json_carries_the_running_ranks_residence():
    """Live: the residence section is there (whatever runs on this host now), a --root tree: null."""
    facts = gather("/")
    out = report_dict("/", facts, run_checks(facts))
    assert out["residence"]["min_pct"] == 90.0 and isinstance(out["residence"]["ranks"], list)
    assert next(c for c in out["checks"] if c["name"] == "memory_residence")["status"] in STATUSES
