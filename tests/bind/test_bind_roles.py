"""Stage 2 on real threads with the real names (`pt_data_pin`, `NCCL Progress 0`, `pt_autograd_0`)
and on real DataLoader worker processes that respawn every epoch. Every check reads /proc."""
import json
import os
import threading
import time

import pytest
import torch
import torch.multiprocessing
from torch.utils.data import DataLoader, Dataset

from placement.bind import RoleBinder
from placement.bind.fork import rehome_forked_children, stop_rehoming
from placement.events import EventLog
from placement.plan.model import GpuRef, MemoryPolicy, RankPlan, RoleAssignment
from placement.roles import ThreadRole
from placement.tune.rules.base import Proposal, Rule
from placerun_helpers import allowed

ALLOWED = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(ALLOWED) < 2, reason="role sets that differ need 2 allowed CPUs")
A, B = frozenset(ALLOWED[:1]), frozenset(ALLOWED[1:2])
BOTH = A | B


def rank_plan(gpu=None, dataloader=B):
    roles = {ThreadRole.MAIN: A, ThreadRole.NCCL: B, ThreadRole.PIN_MEMORY: B,
             ThreadRole.DATALOADER: dataloader, ThreadRole.OTHER: BOTH}
    return RankPlan(local_rank=0, gpu=gpu, numa=[0], memory=MemoryPolicy("none"),
                    roles={r: RoleAssignment(sorted(c), f"test {r}") for r, c in roles.items()})


@pytest.fixture(autouse=True)
def restore_affinity():
    """The binder moves this process's own threads: put every one back afterwards."""
    yield
    stop_rehoming()
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), ALLOWED)
        except OSError:
            pass


class NamedThread:
    """A real thread that names itself (the kernel comm) as torch and NCCL do, then waits."""

    def __init__(self, name, rename_to=None):
        self.ready, self.renamed, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.rename_to = rename_to
        self._t = threading.Thread(target=self._body, args=(name,))
        self._t.start()
        self.ready.wait()

    def _body(self, name):
        self.tid = threading.get_native_id()
        torch.multiprocessing._set_thread_name(name)
        self.ready.set()
        if self.rename_to:
            self.renamed.wait()
            torch.multiprocessing._set_thread_name(self.rename_to)
            self.renamed.clear()
        self.stop.wait()

    def rename(self):
        self.renamed.set()
        while self.renamed.is_set():
            time.sleep(0.001)

    def close(self):
        self.stop.set()
        self._t.join()


@pytest.fixture
def threads():
    made = []
    yield lambda *a, **k: made.append(NamedThread(*a, **k)) or made[-1]
    for t in made:
        t.close()


def events_of(path):
    return [json.loads(line) for line in open(path)]


def test_real_thread_names_land_on_their_role_sets(threads, tmp_path):
    pin, autograd = threads("pt_data_pin"), threads("pt_autograd_0")
    log = EventLog(str(tmp_path / "rank0.jsonl"))
    binder = RoleBinder(rank_plan(), log)
    results = binder.rescan()
    pid = os.getpid()
    assert allowed(pid, pid) == A  # main: CPU-only rank, narrowed at once
    assert allowed(pid, pin.tid) == B  # pin_memory
    assert allowed(pid, autograd.tid) == BOTH  # backward: a CPU-only plan has none, so other's set
    roles = {t.tid: t.role for t in binder.threads()}
    assert roles[pid] is ThreadRole.MAIN and roles[pin.tid] is ThreadRole.PIN_MEMORY
    assert roles[autograd.tid] is ThreadRole.BACKWARD
    assert all(r.ok for r in results)
    log.close()
    binds = {e["tid"]: e for e in events_of(tmp_path / "rank0.jsonl") if e["type"] == "bind"}
    assert binds[pin.tid]["planned"] == binds[pin.tid]["applied"] == sorted(B)
    assert binds[pin.tid]["role"] == "pin_memory" and binds[pin.tid]["reason"] == "test pin_memory"


def test_rescan_is_idempotent_and_binds_only_newcomers(threads, monkeypatch):
    monkeypatch.setattr("placement.bind.binder.SETTLE_S", 0.0)
    binder = RoleBinder(rank_plan(), None)
    binder.rescan()
    assert binder.rescan() == []  # nothing changed: nothing re-bound
    nccl = threads("NCCL Progress 0")
    (r,) = binder.rescan()
    assert r.tid == nccl.tid and r.role is ThreadRole.NCCL and r.ok
    assert allowed(os.getpid(), nccl.tid) == B
    assert binder.rescan() == []


def test_a_settled_rescan_lists_threads_only_when_its_look_changed_or_every_listing_every(threads, monkeypatch):
    """Between listings a rescan looks (thread counts, the main thread's children): nothing
    listed while that is unchanged; a thread that replaced one that ended (the same count) is
    bound at the LISTING_EVERY-th look at the latest."""
    from placement.bind import binder as binder_mod

    monkeypatch.setattr(binder_mod, "SETTLE_S", 0.0)
    listings = []
    real = binder_mod._task_ids
    monkeypatch.setattr(binder_mod, "_task_ids", lambda pid: listings.append(pid) or real(pid))
    gone = threads("python")
    binder = RoleBinder(rank_plan(), None)
    binder.rescan()
    binder.rescan()  # the first settled look, then a listing
    listings.clear()
    for _ in range(3):
        assert binder.rescan() == []
    assert listings == []  # looked, listed nothing
    gone.close()
    nccl = threads("NCCL Progress 0")  # the same thread count as before
    bound = []
    for _ in range(binder_mod.LISTING_EVERY):
        bound += binder.rescan()
        if bound:
            break
    assert [r.tid for r in bound] == [nccl.tid] and allowed(os.getpid(), nccl.tid) == B
    more = threads("pt_data_pin")  # one more thread: the next look sees it
    (r,) = binder.rescan()
    assert r.tid == more.tid and allowed(os.getpid(), more.tid) == B


def test_thread_named_after_its_first_scan_is_rehomed(threads):
    late = threads("python", rename_to="NCCL Service 0")  # seen with the inherited name first
    binder = RoleBinder(rank_plan(), None)
    binder.rescan()
    assert allowed(os.getpid(), late.tid) == BOTH  # `other`, for now
    late.rename()
    (r,) = binder.rescan()
    assert r.role is ThreadRole.NCCL and allowed(os.getpid(), late.tid) == B


def test_main_waits_for_nccl_threads_on_a_gpu_rank(threads):
    binder = RoleBinder(rank_plan(gpu=GpuRef(0, "0000:18:00.0")), None)
    pid = os.getpid()
    binder.rescan()
    assert allowed(pid, pid) == frozenset(ALLOWED)  # NCCL not up yet: main keeps the wide mask
    threads("NCCL Progress 0")
    binder.rescan()
    assert allowed(pid, pid) == A


def test_set_role_cpus_rehomes_live_threads_now_and_later_ones(threads, tmp_path):
    log = EventLog(str(tmp_path / "rank0.jsonl"))
    binder = RoleBinder(rank_plan(), log)
    first = threads("gloo_tcp_loop")
    binder.rescan()
    results = binder.set_role_cpus(ThreadRole.OTHER, A, "tuner: move other off the nccl core")
    assert {r.tid for r in results} >= {first.tid} and all(r.role is ThreadRole.OTHER for r in results)
    assert allowed(os.getpid(), first.tid) == A
    second = threads("python")
    binder.rescan()
    assert allowed(os.getpid(), second.tid) == A
    log.close()
    moved = [e for e in events_of(tmp_path / "rank0.jsonl") if e["type"] == "bind" and e["tid"] == first.tid]
    assert moved[-1]["reason"] == "tuner: move other off the nccl core" and moved[-1]["applied"] == sorted(A)


def _watch_a_pin_memory_thread_born_later(binder, threads, interval_s: float) -> None:
    """Start the binder's watcher, start a pin-memory thread, and wait (bounded) until the
    watcher has put it on its role's set; the watcher is stopped either way."""
    binder.start_watcher(interval_s)
    try:
        pin = threads("pt_data_pin")
        deadline = time.monotonic() + 30
        while allowed(os.getpid(), pin.tid) != B and time.monotonic() < deadline:
            time.sleep(0.02)
        assert allowed(os.getpid(), pin.tid) == B
    finally:
        binder.stop_watcher()


def test_watcher_rehomes_threads_born_later(threads):
    _watch_a_pin_memory_thread_born_later(RoleBinder(rank_plan(), None), threads, 0.02)
    assert not any(t.name == "placement_watch" for t in threading.enumerate() if t.is_alive())


def test_the_watcher_waits_its_interval_times_the_pace_it_is_given(threads):
    """The monitor's budget stretches its hand-overs: the watcher then rescans half as often
    (RoleBinder.pace_watch, wired by attach()); a thread born meanwhile is bound all the same."""
    binder = RoleBinder(rank_plan(), None)
    waited: list[float] = []
    binder.pace_watch(lambda: 2.0)
    wait = binder._stop.wait  # (the watcher's timed wait, recorded)
    binder._stop.wait = lambda s: (waited.append(s), wait(s))[1]
    _watch_a_pin_memory_thread_born_later(binder, threads, 0.01)
    assert waited and set(waited) == {0.02}


class WhereAmI(Dataset):
    """Each item reports the worker process that made it and the CPUs it was allowed at that moment."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([os.getpid(), *sorted(allowed(os.getpid()))])


def test_dataloader_workers_respawn_and_are_rehomed_every_epoch(tmp_path):
    pid = os.getpid()
    binder = RoleBinder(rank_plan(dataloader=B), None, background_nice=5)
    binder.rescan()
    assert allowed(pid, pid) == A  # main is narrow: forked workers would inherit A
    rehome_forked_children(binder)
    loader = DataLoader(WhereAmI(), batch_size=1, num_workers=2, persistent_workers=False)
    epochs = []
    for _ in range(2):
        seen = {}
        for batch in loader:
            worker, *cpus = batch[0].tolist()
            seen[worker] = cpus
            assert frozenset(cpus) == B  # at-fork: on the dataloader set before any rescan
            binder.rescan()  # stage 2 finds them by name and binds every thread they have
            if os.path.exists(f"/proc/{worker}"):
                for tid in os.listdir(f"/proc/{worker}/task"):
                    assert allowed(worker, int(tid)) == B
                # B holds no live hot thread (no NCCL or pin-memory thread here): own nice kept
                assert os.getpriority(os.PRIO_PROCESS, worker) == 0
        epochs.append(set(seen))
    assert len(epochs[0]) == 2 and epochs[0].isdisjoint(epochs[1])  # respawned: new processes
    dl_threads = [t for t in binder.threads() if t.role is ThreadRole.DATALOADER]
    assert all(t.pid != pid for t in dl_threads)


@pytest.mark.slow
def test_spawned_workers_are_found_by_name(tmp_path):
    """Workers started by spawn are not forked from main: the rescan binds them by `pt_data_worker`."""
    binder = RoleBinder(rank_plan(dataloader=B), None)
    binder.rescan()
    loader = DataLoader(WhereAmI(), batch_size=1, num_workers=1, multiprocessing_context="spawn")
    it = iter(loader)
    worker = int(next(it)[0][0])
    binder.rescan()
    for tid in os.listdir(f"/proc/{worker}/task"):
        assert allowed(worker, int(tid)) == B
    del it


class SlowItems(Dataset):
    """Items that take a while, so the worker processes stay alive between checks."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.05)
        return torch.tensor([os.getpid()])


def _worker_nice(worker):
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{worker}/task")}


def test_a_worker_forked_between_watcher_ticks_is_ours_at_the_monitors_next_span():
    """The monitor's span refresh reads Binder.current_threads: a worker started since the
    watcher's last tick is bound and listed (so the tuner does not take it for a foreign
    thread pinned to the dataloader's core) without waiting for the next tick."""
    binder = RoleBinder(rank_plan(dataloader=B), None)
    binder.rescan()
    binder.start_watcher(interval_s=3600.0)  # no tick during this test
    rehome_forked_children(binder)
    it = iter(DataLoader(SlowItems(), batch_size=1, num_workers=1))
    try:
        worker = int(next(it)[0][0])
        assert worker not in {t.pid for t in binder.threads()}  # the watcher's list: not yet
        listed = [t for t in binder.current_threads() if t.pid == worker]
        assert listed and {t.role for t in listed} == {ThreadRole.DATALOADER}
        assert worker in {t.pid for t in binder.threads()}
        for tid in os.listdir(f"/proc/{worker}/task"):
            assert allowed(worker, int(tid)) == B
    finally:
        binder.stop_watcher()
        del it


def test_workers_are_niced_only_while_they_share_a_hot_threads_cpu():
    if os.geteuid() != 0:
        pytest.skip("lowering a nice value back needs CAP_SYS_NICE (root here)")
    binder = RoleBinder(rank_plan(dataloader=BOTH), None, background_nice=5)  # shares main's A
    binder.rescan()
    rehome_forked_children(binder)
    it = iter(DataLoader(SlowItems(), batch_size=1, num_workers=1))
    worker = int(next(it)[0][0])
    binder.rescan()
    assert _worker_nice(worker) == {5}  # born niced (at fork) and every thread of it niced
    binder.set_role_cpus(ThreadRole.DATALOADER, B, "test: off main's cpu")
    assert _worker_nice(worker) == {0}  # B has no live hot thread: back to its own nice
    binder.set_role_cpus(ThreadRole.DATALOADER, A, "test: onto main's cpu")
    assert _worker_nice(worker) == {5}
    del it


def test_the_binder_keeps_one_record_per_thread(threads):
    """What the binder knows of a thread is one ThreadRecord: its role, the set it gave it, what
    the kernel reported after it; gone with the thread."""
    binder = RoleBinder(rank_plan(), None)
    pin = threads("pt_data_pin")
    before = time.monotonic()
    binder.rescan()
    rec = binder.record(os.getpid(), pin.tid)
    assert rec.info.role is ThreadRole.PIN_MEMORY and rec.info.tid == pin.tid
    assert rec.applied == B and rec.kernel == allowed(os.getpid(), pin.tid) == B
    assert rec.first_seen <= before + 1.0 and rec.nice is None  # nice is only kept for DataLoader workers
    main = binder.record(os.getpid(), os.getpid())
    assert main.info.role is ThreadRole.MAIN and main.applied == A
    pin.close()
    deadline = time.monotonic() + 10
    while binder.record(os.getpid(), pin.tid) is not None and time.monotonic() < deadline:
        binder.rescan()
        time.sleep(0.01)
    assert binder.record(os.getpid(), pin.tid) is None


class MovePin(Rule):
    """A tune rule that moves pin_memory onto main's CPU once, whatever the window says."""

    name = "runqueue"

    def propose(self, ctx):
        if ctx.layout.cpus(ThreadRole.PIN_MEMORY) == A:
            return None
        return Proposal(self.name, ThreadRole.PIN_MEMORY, A, "test: pin_memory next to main")


def test_a_tuner_move_goes_through_the_binder_and_proc_shows_it(threads, tmp_path):
    """The binder owns each role's set: the tuner reads it, proposes a move, the binder applies
    and records it, and the kernel's Cpus_allowed_list of the live thread shows it."""
    from placement.tune.tuner import Tuner
    from tune_fakes import FakeFacts, ListEvents, tune_cfg, window

    log = EventLog(str(tmp_path / "rank0.jsonl"))
    binder = RoleBinder(rank_plan(), log)
    pin = threads("pt_data_pin")
    binder.rescan()
    assert allowed(os.getpid(), pin.tid) == B
    tuner = Tuner(binder, tune_cfg(window=5), ListEvents(), facts=FakeFacts())
    tuner.rules = [MovePin()]
    assert tuner.role_cpus(ThreadRole.PIN_MEMORY) == B  # the plan's set, as the binder holds it
    for r in window(5 * 3):  # two warm-up windows, then the rule is asked
        tuner.observe(r)
    assert binder.role_cpus(ThreadRole.PIN_MEMORY) == A == tuner.role_cpus(ThreadRole.PIN_MEMORY)
    assert allowed(os.getpid(), pin.tid) == A  # /proc/<pid>/task/<tid>/status Cpus_allowed_list
    assert binder.record(os.getpid(), pin.tid).applied == A
    binder.set_role_cpus(ThreadRole.PIN_MEMORY, B, "test: someone else moved it back")
    assert tuner.role_cpus(ThreadRole.PIN_MEMORY) == B  # one owner: the tuner keeps no copy
    log.close()
    moved = [e for e in events_of(tmp_path / "rank0.jsonl") if e["type"] == "bind" and e["tid"] == pin.tid]
    assert moved[-2]["reason"].startswith("tune runqueue: test: pin_memory next to main") and moved[-2]["applied"] == sorted(A)
