"""torch's DataLoader worker-count check counts the CPUs the process was launched with, not main's
narrowed core nor the rank's share (placement/bind/dataloader.py): placerun adds no warning
torchrun does not give."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils.data.dataloader as dl

from placement.bind.dataloader import count_workers_against

REPO = Path(__file__).resolve().parents[2]
CPUS = sorted(os.sched_getaffinity(0))
WARNING = "suggested max number of worker"
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs: one for the narrowed thread, a share of 2")


def _build_on_one_cpu() -> tuple[list[str], set[int]]:
    """Build a 2-worker DataLoader on a thread narrowed to one CPU (as main is under placerun):
    the warnings torch gave, and the thread's mask afterwards (read back from the kernel)."""
    got: dict = {}

    def run():
        os.sched_setaffinity(0, {CPUS[0]})
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            dl.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4)), num_workers=2)
        got["warnings"] = [str(x.message) for x in w]
        got["mask"] = os.sched_getaffinity(0)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return got["warnings"], got["mask"]


@pytest.fixture
def torch_check(monkeypatch):
    """torch's own check on the class for the test (an attach() earlier in this process patched it)."""
    current = dl.DataLoader.check_worker_number_rationality
    monkeypatch.setattr(dl.DataLoader, "check_worker_number_rationality", getattr(current, "__wrapped__", current))
    return dl.DataLoader.check_worker_number_rationality


@needs_two
def test_the_check_counts_the_launched_cpus_and_the_thread_keeps_its_core(torch_check):
    before, _ = _build_on_one_cpu()
    assert any(WARNING in m for m in before), before  # torch's own check, on one CPU: warns
    count_workers_against(dl, lambda: ())
    count_workers_against(dl, lambda: CPUS[:2])  # once per class; the latest session's CPUs count
    assert dl.DataLoader.check_worker_number_rationality.__wrapped__ is torch_check
    after, mask = _build_on_one_cpu()
    assert not any(WARNING in m for m in after), after
    assert mask == {CPUS[0]}  # narrowed again once the check returned


@needs_two
def test_more_workers_than_the_launched_cpus_still_warn(torch_check):
    count_workers_against(dl, lambda: [CPUS[0]])  # launched on one CPU: 2 workers are too many, as torch says
    warned, _ = _build_on_one_cpu()
    assert any(WARNING in m for m in warned), warned


@pytest.mark.slow
@needs_two
def test_placerun_adds_no_dataloader_warning(tmp_path):
    job = str(REPO / "tests" / "placerun_jobs" / "dataloader_workers.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLACEMENT_")}
    out = {}
    for name, launcher in (("placerun", ["placement.launcher", f"placement.monitor.log_dir={tmp_path}"]),
                           ("torchrun", ["torch.distributed.run"])):
        # Two ranks: on a 2-CPU host each rank's share is one CPU, fewer than its 2 workers.
        p = subprocess.run([sys.executable, "-m", launcher[0], "--standalone", "--nproc-per-node", "2", *launcher[1:],
                            job], capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path))
        assert p.returncode == 0, p.stderr[-2000:]
        out[name] = p
    mains = [line for line in out["placerun"].stdout.splitlines() if line.startswith("main cpus")]
    assert len(mains) == 2 and all(len(m.split()[-1].split(",")) < len(CPUS) for m in mains)  # narrowed
    for name, p in out.items():
        assert WARNING not in p.stderr, (name, p.stderr[-2000:])
