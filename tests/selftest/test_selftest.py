"""`placement selftest`: the no-GPU line, and every check judged on CPU from evidence shaped as
placement/selftest/job.py writes it, with thread facts read from this process's real /proc."""
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from placement.roles import ThreadRole, name_this_thread
from placement.selftest import checks as C
from placement.selftest.job import _main_cpus, _threads, residence_evidence
from placement.selftest.runner import SelftestResult, evaluate, job_command, table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this node has a GPU: selftest runs for real")
def test_no_gpu_is_one_json_line_and_exit_0():
    out = subprocess.run([sys.executable, "-m", "placement.cli", "selftest"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and len(lines) == 1, out.stdout + out.stderr
    got = json.loads(lines[0])
    assert got["skipped"] is True and got["schema"] == "placement.selftest/1" and "GPU" in got["reason"]


def test_bad_nproc_is_one_line_exit_2():
    out = subprocess.run([sys.executable, "-m", "placement.cli", "selftest", "--nproc-per-node", "0"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "--nproc-per-node=0" in out.stderr


@pytest.fixture
def named_threads():
    """Real threads named as NCCL, the pin-memory thread and autograd name theirs."""
    stop = threading.Event()
    ready = []

    def run(name):
        name_this_thread(name.encode())
        ready.append(name)
        stop.wait(30)

    threads = [threading.Thread(target=run, args=(n,), daemon=True)
               for n in ("NCCL Progress 0", "NCCL Service 0", "pt_data_pin", "pt_autograd_0")]
    for t in threads:
        t.start()
    while len(ready) < len(threads):
        pass
    yield
    stop.set()
    for t in threads:
        t.join()


def _loader_batch():
    """A batch from a real DataLoader, pinned where this host has a GPU (ordinary pages here)."""
    data = torch.utils.data.TensorDataset(torch.randn(512, 256), torch.randn(512, 16))
    return next(iter(torch.utils.data.DataLoader(data, batch_size=64, pin_memory=torch.cuda.is_available())))


def _evidence(cpus):
    threads = _threads()
    main = _main_cpus()
    return {"rank": 0, "local_rank": 0, "gpu_pci": "0000:18:00.0", "gpu_numa": 0,
            "main_cpus_before_nccl": main, "main_cpus_after_nccl": main, "main_cpus_after_steps": main,
            "threads_after_init": threads, "threads_during_steps": threads, "threads_after_steps": threads,
            "nvml_gpus": ["00000000:18:00.0", "00000000:2A:00.0"], "torch_gpus": ["0000:18:00.0"],
            "comm_timing": "flight_recorder", "comm_ms_monitor": [None] * 5 + [10.2] * 95,
            "comm_ms_reference": [10.0] * 100, "comm_ms_monitor_short": [None] * 5 + [0.05] * 95,
            "comm_ms_reference_short": [0.08] * 100, "step_ms_median": 100.0, "step_ms_median_short": 3.0,
            "monitor_us_per_step": 40.0, "residence": residence_evidence((0,), _loader_batch()),
            "residence_min_pct": 90.0}


def _plan(cpus):
    roles = {r: {"cpus": cpus, "reason": "test"} for r in ("main", "nccl", "pin_memory", "other", "dataloader")}
    return {"local_rank": 0, "gpu": {"index": 0, "pci": "0000:18:00.0"}, "numa": [0], "roles": roles}


def test_every_check_passes_on_a_rank_as_planned(named_threads):
    cpus = sorted(os.sched_getaffinity(0))
    ev = _evidence(cpus)
    assert _main_cpus() == cpus  # read back from /proc
    got = evaluate([dict(ev, plan=_plan(cpus))], 1, budget_pct=0.3)
    assert [c.name for c in got] == ["gpus_match", "rank_placement", "nccl_threads_after_init",
                                     "nccl_threads_after_steps", "main_mask_after_nccl_init", "comm_time",
                                     "comm_time_short_steps", "pin_memory_threads", "backward_threads", "memory_residence",
                                     "monitor_cost"]
    assert all(c.passed is True for c in got), [(c.name, c.why) for c in got]
    nccl = next(c for c in got if c.name == "nccl_threads_after_init")
    assert sorted(t["name"] for t in nccl.evidence["threads"]) == ["NCCL Progress 0", "NCCL Service 0"]
    assert SelftestResult(False, "", got).passed and "comm_time" in table(SelftestResult(False, "", got))


def test_threads_off_their_planned_cpus_fail(named_threads):
    cpus = sorted(os.sched_getaffinity(0))
    plan = _plan(cpus)
    plan["roles"]["nccl"] = {"cpus": [max(cpus) + 1], "reason": "elsewhere"}
    c = C.threads_on_plan(_evidence(cpus), plan, when="after_init", kind=ThreadRole.NCCL, name="n")
    assert c.passed is False and "off the planned CPUs" in c.why
    missing = C.threads_on_plan({"threads_after_steps": []}, plan, when="after_steps", kind=ThreadRole.PIN_MEMORY,
                                name="p")
    assert missing.passed is False and "no pin_memory thread found" in missing.why
    backward = C.threads_on_plan(_evidence(cpus), dict(plan, roles=dict(plan["roles"], backward={"cpus": cpus})),
                                 when="after_steps", kind=ThreadRole.BACKWARD, name="b")
    assert backward.passed is True and backward.evidence["role"] == "backward"
    assert [t["name"] for t in backward.evidence["threads"]] == ["pt_autograd_0"]


@pytest.mark.parametrize("change, name, why", [
    ({"main_cpus_after_nccl": [1]}, "main_mask_after_nccl_init", "changed by NCCL init"),
    ({"comm_ms_monitor_short": [None] * 100}, "comm_time_short_steps", "null on 95 of 95 short steps"),
    ({"comm_ms_monitor": [None] * 100}, "comm_time", "comm time null"),
    ({"comm_ms_monitor": [13.0] * 100}, "comm_time", "outside 20%"),
    ({"monitor_us_per_step": 400.0}, "monitor_cost", "0.400%"),
    ({"gpu_pci": "0000:2a:00.0"}, "rank_placement", "not the planned one"),
])
def test_each_failure_is_named_with_its_evidence(change, name, why):
    ev = dict(_evidence([0]), main_cpus_before_nccl=[0, 1], main_cpus_after_steps=[0, 1], **{})
    ev.update(change)
    plan = _plan([0, 1])
    got = {c.name: c for c in C.rank_checks(ev, plan, 0.3)}
    assert got[name].passed is False and why in got[name].why, got[name]


def test_gpu_lists_compared_by_pci_address():
    assert C.gpus_match(["00000000:18:00.0"], ["0000:18:00.0"]).passed is True
    assert C.gpus_match(["00000000:18:00.0"], ["0000:2a:00.0"]).passed is False
    assert C.gpus_match(None, ["0000:18:00.0"]).passed is None


def test_a_rank_without_evidence_fails_and_the_job_runs_under_placerun():
    got = evaluate([], 2, 0.3)
    assert [(c.name, c.rank, c.passed) for c in got] == [("rank_ran", 0, False), ("rank_ran", 1, False)]
    cmd = job_command(2, "/tmp/x", 100)
    assert cmd[1:3] == ["-m", "placement.launcher"] and "--nproc-per-node" in cmd
    assert cmd[cmd.index("-m", 3) + 1] == "placement.selftest.job"
    from placement.launcher import parse_placerun_args  # placerun takes the module as torchrun does
    pa = parse_placerun_args(cmd[3:])
    assert pa.torch_args.module and pa.torch_args.training_script == "placement.selftest.job"


def test_one_rank_comm_time_is_judged_as_timed_and_never_above_the_streams_span():
    """As seen on an H200: NCCL runs nothing for a one-rank in-place all-reduce, so the recorded
    durations are microseconds against the stream's ~0.13 ms per call; the ratio is not judged."""
    ev = dict(_evidence([0]), world_size=1, comm_ms_monitor=[None] * 5 + [0.021] * 95, comm_ms_reference=[0.533] * 100)
    got = C.comm_time(ev)
    assert got.passed is True and "one rank" in got.why and got.evidence["median_ratio"] < 0.1
    over = C.comm_time(dict(ev, comm_ms_monitor=[None] * 5 + [0.9] * 95))
    assert over.passed is False and over.evidence["over_steps"] == 95
    assert C.comm_time(dict(ev, comm_ms_monitor=[None] * 100)).passed is False  # null is never a pass


def test_main_narrowed_by_placement_after_nccl_init_passes_and_a_change_nccl_left_fails():
    """The binder narrows main to its planned CPUs when NCCL's threads appear (bind/binder.py);
    NCCL restores the mask it saved (src/init.cc). The old check compared with the mask before
    init, so placement's own narrowing failed it; a mask NCCL left narrowed to the GPU's CPUs
    (neither the share nor main's set) is what must fail."""
    plan = _plan([0, 1])
    plan["roles"]["main"] = {"cpus": [0], "reason": "test"}
    plan["roles"]["nccl"] = {"cpus": [1], "reason": "test"}
    share = [0, 1]
    narrowed_by_us = {"main_cpus_before_nccl": share, "main_cpus_after_nccl": [0]}
    assert C.main_mask_after_nccl_init(narrowed_by_us, plan).passed is True
    assert C.main_mask_after_nccl_init({"main_cpus_before_nccl": share, "main_cpus_after_nccl": share}, plan).passed
    plan_wide = _plan([0, 1, 2, 3])
    left_by_nccl = {"main_cpus_before_nccl": [0, 1, 2, 3], "main_cpus_after_nccl": [2, 3]}
    c = C.main_mask_after_nccl_init(left_by_nccl, plan_wide)
    assert c.passed is False and "not restored" in c.why


class _PinningLoaderIter:
    """A non-persistent DataLoader iterator's pin-memory thread as torch runs it: started with
    the iterator (torch/utils/data/dataloader.py ~1195-1210, named pt_data_pin by
    _utils/pin_memory.py), joined when the iterator is exhausted (_shutdown_workers, called at
    StopIteration unless persistent, ~1489-1491; the join ~1627-1636)."""

    def __init__(self, n):
        self.n, self.done = n, threading.Event()
        started = threading.Event()

        def pin_loop():
            name_this_thread(b"pt_data_pin")
            started.set()
            self.done.wait(30)

        self.thread = threading.Thread(target=pin_loop, daemon=True)
        self.thread.start()
        started.wait(10)

    def __iter__(self):
        return self

    def __next__(self):
        if self.n == 0:
            self.done.set()
            self.thread.join()
            raise StopIteration
        self.n -= 1
        return self.n


def test_the_pin_memory_thread_is_looked_for_while_the_loader_runs():
    cpus = sorted(os.sched_getaffinity(0))
    plan = _plan(cpus)
    during = None
    for i in _PinningLoaderIter(6):
        if i == 3:
            during = _threads()
    after = _threads()
    pin = dict(kind=ThreadRole.PIN_MEMORY, name="pin_memory_threads")
    # Today's job looked after the loop: the thread was joined, the check always failed.
    assert C.threads_on_plan({"threads_after_steps": after}, plan, when="after_steps", **pin).passed is False
    c = C.threads_on_plan({"threads_during_steps": during}, plan, when="during_steps", **pin)
    assert c.passed is True and [t["name"] for t in c.evidence["threads"]] == ["pt_data_pin"]


def test_residence_of_the_process_and_the_loaders_batch_on_this_host():
    """Real move_pages answers on this host's one node: every sampled page of the process and of a
    real DataLoader batch is on node 0, so the check passes at the configured 90%."""
    ev = {"residence": residence_evidence((0,), _loader_batch()), "residence_min_pct": 90.0}
    looks = ev["residence"]["looks"]
    assert [d["what"] for d in looks] == ["process", "pinned batch buffers" if torch.cuda.is_available()
                                          else "batch buffers"]
    assert all(d["share_pct"] == 100.0 and d["by_node"].keys() == {"0"} for d in looks), looks
    assert looks[1]["asked"] >= 64 * (256 + 16) * 4 // 4096 and looks[1]["absent"] == 0  # every page of x and y
    c = C.memory_residence(ev)
    assert c.passed is True and c.why.startswith("process 100.0% on node 0; ") and c.why.endswith("(>= 90%)"), c


def test_residence_below_the_threshold_fails_naming_the_nodes_and_unmeasured_is_null():
    """Constructed looks as the job writes them (Residence.to_dict): 3 of 4 sampled pages of the
    pinned buffers on node 1 while node 0 is planned."""
    far = {"what": "pinned batch buffers", "planned": [0], "share_pct": 25.0, "by_node": {"0": 100, "1": 300},
           "source": "move_pages", "asked": 400, "absent": 0, "cost_us": 80.0}
    near = dict(far, what="process", share_pct=99.0, by_node={"0": 1980, "1": 20}, asked=2048, absent=48)
    ev = {"residence": {"planned": [0], "looks": [near, far], "null": []}, "residence_min_pct": 90.0}
    c = C.memory_residence(ev)
    assert c.passed is False and c.why == "below 90%: pinned batch buffers 25.0% on node 0 (75.0% on node 1)", c
    assert C.memory_residence(dict(ev, residence_min_pct=20.0)).passed is True  # the configured threshold rules
    none = C.memory_residence({"residence": {"planned": [], "looks": [dict(near, planned=[], share_pct=None)],
                                             "null": []}})
    assert none.passed is None and none.why.startswith("no node planned")
    failed = C.memory_residence({"residence": {"planned": [0], "looks": [], "null": ["process: EPERM: Operation "
                                                                                    "not permitted"]}})
    assert failed.passed is None and failed.why == "process: EPERM: Operation not permitted"
    assert C.memory_residence({}).passed is None
