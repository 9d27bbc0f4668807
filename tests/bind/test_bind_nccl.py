"""A GPU rank's threads on this machine, with NCCL reproduced by tests/nccl_threads_standin.py (threads
with NCCL's names created at NCCL's points, the caller's mask saved / narrowed / restored as
src/init.cc does) and torch's backward thread by its name (pt_autograd_<device>). Real binding
through placement's one stage-1 function and the stage-2 binder; every check reads /proc."""
import json
import multiprocessing
import os
import threading

import pytest
import torch

from placement.bind import session as session_mod
from placement.bind.fork import rehome_forked_children, stop_rehoming
from placement.bind.stage1 import run_stage1
from placement.config import PlacementConfig
from placement.events import EventLog
from placement.identity import RankIdentity
from placement.plan.model import GpuRef, MemoryPolicy, Plan, RankPlan, RoleAssignment
from placement.roles import ThreadRole
from nccl_threads_standin import StandInComm
from placerun_helpers import allowed, wait_thread_gone

ALLOWED = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(ALLOWED) < 2, reason="role sets that differ need 2 allowed CPUs")
A, B = frozenset(ALLOWED[:1]), frozenset(ALLOWED[1:2])
BOTH = A | B
PID = os.getpid()


def gpu_plan() -> Plan:
    """A GPU rank on 2 CPUs: main on A; backward, NCCL's hot threads, pin-memory on B; the rest
    (NCCL's background threads among them) on both."""
    roles = {ThreadRole.MAIN: A, ThreadRole.BACKWARD: B, ThreadRole.NCCL: B, ThreadRole.PIN_MEMORY: B,
             ThreadRole.DATALOADER: B, ThreadRole.OTHER: BOTH}
    rank = RankPlan(local_rank=0, gpu=GpuRef(0, "0000:18:00.0"), numa=[0], memory=MemoryPolicy("none"),
                    env={"OMP_NUM_THREADS": "2"},
                    roles={r: RoleAssignment(sorted(c), f"test {r.value}") for r, c in roles.items()})
    return Plan("auto", [rank])


@pytest.fixture(autouse=True)
def restore_affinity():
    yield
    stop_rehoming()
    s = session_mod.current()
    if s is not None:
        s.close()
        session_mod.set_current(None)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), ALLOWED)
        except OSError:
            pass


@pytest.fixture
def comms():
    made = []
    yield lambda *a, **k: made.append(StandInComm(*a, **k)) or made[-1]
    for c in made:
        c.close()
    # An NCCL-named thread still listed would tell the next test's attach() that NCCL has started
    # (placement.bind.nccl.nccl_threads_present): closed is not gone yet (wait_thread_gone).
    lingering = [tid for c in made for tid in c.tids().values() if not wait_thread_gone(tid)]
    assert not lingering, f"stand-in NCCL threads {lingering} still alive 5 s after close"


class Autograd:
    """torch's autograd device thread: Engine::thread_init names it pt_autograd_<device>
    (torch/csrc/autograd/engine.cpp) when the engine starts its device threads."""

    def __init__(self):
        self.stop, ready = threading.Event(), threading.Event()

        def body():
            self.tid = threading.get_native_id()
            torch.multiprocessing._set_thread_name("pt_autograd_0")
            ready.set()
            self.stop.wait()

        self._t = threading.Thread(target=body, daemon=True)
        self._t.start()
        ready.wait()

    def close(self):
        self.stop.set()
        self._t.join()


def stage1(tmp_path, environ, entry="placerun"):
    events = EventLog(str(tmp_path / "rank0.jsonl"), 0)
    return run_stage1(PlacementConfig(), gpu_plan(), events, RankIdentity(0, 0, 1, 1, None, "test"),
                      entry=entry, environ=environ)


def events_of(tmp_path):
    return [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]


def test_every_thread_ends_on_its_planned_cpus_through_nccl_init(tmp_path, comms):
    environ = {}
    s = stage1(tmp_path, environ)
    assert environ["NCCL_SET_THREAD_NAME"] == "1" and environ["NCCL_PROXY_CPUSET"] == ",".join(map(str, sorted(B)))
    assert allowed(PID, PID) == BOTH  # stage 1: the whole share
    s.binder.rescan()
    assert allowed(PID, PID) == BOTH  # a GPU rank's main waits for NCCL's threads
    autograd = Autograd()
    seen_during_init = {}

    def watcher_fires_during_init():  # the 1 s watcher may rescan while NCCL holds main narrowed
        s.binder.rescan()
        seen_during_init["main"] = allowed(PID, PID)

    comm = comms(B, environ=environ, after_proxy_create=watcher_fires_during_init)
    comm.init()
    assert comm.narrowed_to == B  # init.cc narrowed the caller to (its mask & GPU-local CPUs)
    assert seen_during_init["main"] == A  # NCCL's service thread seen: main narrowed ...
    assert allowed(PID, PID) == BOTH  # ... and NCCL's restore of its saved mask widened it again
    s.binder.rescan()  # the drift check
    assert allowed(PID, PID) == A
    comm.first_collective()
    s.binder.rescan()
    tids = comm.tids()
    want = {PID: A, autograd.tid: B, tids["service"]: B, tids["uds"]: B, tids["progress"]: B,
            tids["ras"]: BOTH, tids["bootstrap"]: BOTH}
    assert {tid: allowed(PID, tid) for tid in want} == want
    roles = {t.tid: t.role for t in s.binder.threads()}
    assert roles[autograd.tid] is ThreadRole.BACKWARD
    assert {roles[tids[k]] for k in ("service", "uds", "progress")} == {ThreadRole.NCCL}
    assert {roles[tids[k]] for k in ("ras", "bootstrap")} == {ThreadRole.OTHER}
    names = {t.tid: t.name for t in s.binder.threads()}
    assert names[tids["uds"]] == "NCCL UDS Servic" and names[tids["service"]] == "NCCL Service  0"
    s.events.flush()
    drift = [e for e in events_of(tmp_path) if e["type"] == "bind" and e.get("drift")]
    assert len(drift) == 1 and drift[0]["tid"] == PID and drift[0]["role"] == "main"
    assert drift[0]["drift"] == {"found": sorted(BOTH), "set": sorted(A)} and drift[0]["applied"] == sorted(A)
    assert "NCCL restores" in drift[0]["reason"]
    s.binder.rescan()  # nothing rewrote anything since: nothing re-applied
    s.events.flush()
    assert len([e for e in events_of(tmp_path) if e["type"] == "bind" and e.get("drift")]) == 1
    autograd.close()


def test_nccl_places_its_proxy_threads_itself_with_the_cpuset_stage1_sets(tmp_path, comms):
    environ = {}
    s = stage1(tmp_path, environ)
    comm = comms(B, environ=environ)
    comm.init()
    comm.first_collective()
    tids = comm.tids()  # no rescan yet: where NCCL itself put them
    assert allowed(PID, tids["service"]) == allowed(PID, tids["uds"]) == allowed(PID, tids["progress"]) == B
    assert allowed(PID, tids["ras"]) == BOTH  # not covered by NCCL_PROXY_CPUSET: created by main
    s.binder.rescan()
    assert allowed(PID, tids["ras"]) == BOTH and allowed(PID, PID) == A


def test_main_is_narrowed_after_a_bounded_wait_when_nccl_threads_never_show(tmp_path, comms, monkeypatch):
    monkeypatch.setattr("placement.bind.binder.MAIN_WAIT_S", 0.0)
    environ = {"NCCL_SET_THREAD_NAME": "0"}  # the user's choice: kept, and said
    s = stage1(tmp_path, environ)
    comm = comms(B, environ=environ)
    comm.init()  # unnamed: NCCL's threads carry main's name
    s.binder.rescan()
    assert allowed(PID, PID) == A
    tids = comm.tids()
    roles = {t.tid: t.role for t in s.binder.threads()}
    assert {roles[tids[k]] for k in ("service", "uds", "ras")} == {ThreadRole.OTHER}
    s.events.flush()
    ev = events_of(tmp_path)
    assert any(e["type"] == "warning" and "NCCL_SET_THREAD_NAME='0'" in e["message"] for e in ev)
    main_bind = [e for e in ev if e["type"] == "bind" and e["role"] == "main"]
    assert main_bind and "narrowed after waiting" in main_bind[-1]["reason"]


def test_attach_after_nccl_init_says_so_once_with_the_fix(tmp_path, comms, capfd):
    environ = {"NCCL_SET_THREAD_NAME": "1"}  # set by the user for NCCL, not by placement
    comm = comms(B, environ=environ)
    comm.init()  # DDP(...) created the communicator before attach()
    stage1(tmp_path, {}, entry="attach")
    err = capfd.readouterr().err
    lines = [l for l in err.splitlines() if "NCCL created its communicator" in l]
    assert len(lines) == 1
    assert "call placement.attach() before init_process_group, or launch with placerun" in lines[0]


def test_attach_before_nccl_init_sets_the_env_placerun_sets(tmp_path, capfd):
    environ = {}
    stage1(tmp_path, environ, entry="attach")
    assert environ["NCCL_SET_THREAD_NAME"] == "1" and environ["NCCL_PROXY_CPUSET"] == ",".join(map(str, sorted(B)))
    assert environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and environ["OMP_NUM_THREADS"] == "2"
    assert "NCCL created its communicator" not in capfd.readouterr().err


def _report_child(conn):
    conn.send((sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0)))


def test_only_dataloader_workers_are_rehomed_other_children_keep_the_share(tmp_path):
    s = stage1(tmp_path, {})
    s.binder.background_nice = 5
    rehome_forked_children(s.binder)
    s.binder.rescan()
    s.binder.set_role_cpus(ThreadRole.MAIN, A, "test: main narrowed")
    assert allowed(PID, PID) == A
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_report_child, args=(child,))  # a user's own process
    p.start()
    cpus, nice = parent.recv()
    p.join()
    assert frozenset(cpus) == BOTH and nice == os.getpriority(os.PRIO_PROCESS, 0)
    loader = torch.utils.data.DataLoader(WhereAmI(), batch_size=1, num_workers=1)
    (batch,) = list(loader)
    assert frozenset(batch[0].tolist()[1:]) == B  # the dataloader set


class WhereAmI(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        return torch.tensor([os.getpid(), *sorted(os.sched_getaffinity(0))])


def test_the_watcher_alone_keeps_every_thread_on_plan_through_nccl_init(tmp_path, comms):
    """No manual rescans: the stage-2 watcher (as under placerun, faster here) does it all."""
    import time

    environ = {}
    s = stage1(tmp_path, environ)
    s.binder.start_watcher(0.05)
    try:
        autograd = Autograd()
        comm = comms(B, environ=environ, after_proxy_create=lambda: time.sleep(0.3))  # NCCL busy in init
        comm.init()
        comm.first_collective()
        tids = comm.tids()
        want = {PID: A, autograd.tid: B, tids["service"]: B, tids["uds"]: B, tids["progress"]: B,
                tids["ras"]: BOTH, tids["bootstrap"]: BOTH}
        deadline = time.monotonic() + 30
        while {tid: allowed(PID, tid) for tid in want} != want and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {tid: allowed(PID, tid) for tid in want} == want
        time.sleep(0.3)  # and it stays so
        assert {tid: allowed(PID, tid) for tid in want} == want
        autograd.close()
    finally:
        s.binder.stop_watcher()


def test_a_hot_thread_that_exits_is_skipped_by_the_drift_check(tmp_path, comms):
    s = stage1(tmp_path, {})
    comm = comms(B, environ={"NCCL_SET_THREAD_NAME": "1"})
    comm.init()
    s.binder.rescan()
    service = comm.threads.pop("service")
    service.close()  # exits between two rescans, still in the binder's list
    assert s.binder._check_drift() == []
    s.events.flush()
    assert not any(e["type"] == "warning" and "rescan failed" in e.get("message", "") for e in events_of(tmp_path))
