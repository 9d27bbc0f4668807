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
from placement.doctor.command import SCHEMA, gather
from placement.cpuset import format_cpulist, parse_cpulist
from placement.doctor.checks import (CHECKS, SEVERITIES, STATUSES, Facts, gpu_pair_sys, irq_hot_cores, membind,
                                    run_checks)
from placement.roles import HOT_ROLES
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
