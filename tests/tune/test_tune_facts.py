"""Host facts read live from /proc and /sys (and from small fake trees for the parsers)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hogs import spin_pinned, stop
from placement.tune import facts


def test_a_pinned_spinning_process_is_found_on_its_cpu_and_ours_are_not():
    cpu = min(os.sched_getaffinity(0))
    pid = spin_pinned(cpu)
    try:
        deadline = time.monotonic() + 10
        while True:
            found = [t for t in facts.running_threads_on(frozenset({cpu}), {os.getpid()}) if t.pid == pid]
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert found, "the spinner was not seen runnable on its cpu"
        assert found[0].affinity == {cpu} and found[0].pinned_within(frozenset({cpu}))
        assert found[0].last_cpu == cpu
        assert not [t for t in facts.running_threads_on(frozenset({cpu}), {os.getpid(), pid}) if t.pid == pid]
        live = facts.LiveFacts(own_pids=lambda: [pid])
        assert not [t for t in live.foreign_threads(frozenset({cpu})) if t.pid in (pid, os.getpid())]
    finally:
        stop([pid])


def test_numa_readers_on_a_fake_proc(tmp_path):
    (tmp_path / "self").mkdir()
    (tmp_path / "sys" / "kernel").mkdir(parents=True)
    (tmp_path / "sys" / "kernel" / "numa_balancing").write_text("1\n")
    (tmp_path / "self" / "sched").write_text(
        "python (7, #threads: 1)\n---\nnuma_pages_migrated  :  12\ntotal_numa_faults  :  340\nnr_switches : 9\n")
    (tmp_path / "vmstat").write_text("nr_free_pages 10\nnuma_hint_faults 77\nnuma_pages_migrated 5\n")
    assert facts.numa_balancing(str(tmp_path)) == 1
    assert facts.numa_counters(str(tmp_path)) == {"task_numa_pages_migrated": 12, "task_total_numa_faults": 340,
                                                  "numa_hint_faults": 77, "numa_pages_migrated": 5}
    assert facts.numa_balancing(str(tmp_path / "missing")) is None
    assert facts.numa_counters(str(tmp_path / "missing")) == {}


def test_cpu_mhz_from_cpufreq(tmp_path):
    d = tmp_path / "devices" / "system" / "cpu" / "cpu3" / "cpufreq"
    d.mkdir(parents=True)
    (d / "scaling_cur_freq").write_text("3450000\n")
    assert facts.cpu_mhz(3, str(tmp_path)) == 3450.0
    assert facts.cpu_mhz(4, str(tmp_path)) is None


def test_memory_policy_reads_the_calling_threads_policy():
    if facts.memory_policy() is None:
        pytest.skip("get_mempolicy is not available here")
    code = ("import numa.memory, placement.tune.facts as f; print(f.memory_policy()); "
            "numa.memory.set_membind_nodes(0); print(f.memory_policy())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["none", "bind"]
