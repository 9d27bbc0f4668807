"""Communication time behind one interface: gloo by call wall time (Python collectives and
DDP's bucket all-reduces through a comm hook), NCCL from PyTorch's own timing."""
import ctypes
import json
import logging
import os
import socket
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import placement
from placement.monitor.comm.timing import make_comm_timing
from placement.monitor.comm.base import CollectiveClock, CommStep, comm_step, union_ms
from placement.monitor.comm.nccl import NcclFlightRecorderComm, NcclHookComm
from placement.monitor.warn import WarnOnce


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(log_dir):
    lines = [json.loads(l) for l in open(os.path.join(log_dir, "rank0.jsonl"))]
    return [l for l in lines if l["type"] == "step"], lines


def test_union_counts_overlapping_buckets_once():
    ms = 1_000_000
    assert union_ms([]) == 0.0
    assert union_ms([(0, 4 * ms), (2 * ms, 6 * ms), (10 * ms, 11 * ms)]) == 7.0
    assert union_ms([(5 * ms, 6 * ms), (0, 1 * ms)]) == 2.0


def test_clock_counts_and_first_entry():
    clock = CollectiveClock(timed=True)
    t_before = time.time()
    t0 = clock.enter()
    time.sleep(0.005)
    clock.done(t0)
    clock.done(clock.enter())
    step = comm_step(clock.take_raw())
    assert step.count == 2 and step.comm_ms >= 4.5 and step.enter_t >= t_before
    assert comm_step(clock.take_raw()).count == 0


def test_python_collectives_sync_and_async_are_timed(tmp_path, gloo_world_of_one):
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0})
    t = torch.ones(1000)
    dist.all_reduce(t)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    dist.broadcast(t, 0)
    h.step()
    h.step()  # no collective in this one
    h.close()
    steps, lines = _steps(tmp_path)
    assert [s["comm_count"] for s in steps] == [3, 0]
    assert steps[0]["comm_inflight_ms"] > 0 and steps[0]["comm_enter_t"] is not None
    assert steps[1]["comm_ms"] == 0.0 and steps[1]["comm_enter_t"] is None
    start = next(l for l in lines if l["type"] == "start" and l.get("source") == "monitor")
    assert start["backend"] == "gloo" and start["comm_timing"] == "wall"
    assert start["exchange"] is False  # one rank: nobody to compare with


def test_ddp_bucket_allreduce_is_timed_and_gradients_are_unchanged(tmp_path, gloo_world_of_one):
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    plain = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    plain.load_state_dict(base.state_dict())
    x = torch.randn(16, 32)
    ddp = torch.nn.parallel.DistributedDataParallel(base)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    h = placement.attach(ddp, opt, policy="none", tune={"enabled": False},  # one rank: timed when asked
                         monitor={"log_dir": str(tmp_path), "summary_every": 0, "comm_timing": "wall"})
    ddp(x).square().mean().backward()
    plain(x).square().mean().backward()
    for a, b in zip(ddp.module.parameters(), plain.parameters()):
        assert torch.allclose(a.grad, b.grad)  # the hook all-reduces exactly as DDP's default
    opt.step()
    h.close()
    steps, lines = _steps(tmp_path)
    assert steps[0]["comm_count"] >= 1 and steps[0]["comm_inflight_ms"] > 0
    start = next(l for l in lines if l["type"] == "start")
    assert start["ddp_hook"] is True and start["ddp_buckets"] == "hook"


def _next_thread_state_id() -> int:
    """The id the next Python thread state gets (CPython numbers them in creation order,
    PyThreadState_GetID): a new thread's, read inside it."""
    get, get_id = ctypes.pythonapi.PyThreadState_Get, ctypes.pythonapi.PyThreadState_GetID
    get.restype, get_id.argtypes, get_id.restype = ctypes.c_void_p, [ctypes.c_void_p], ctypes.c_uint64
    got = []
    t = threading.Thread(target=lambda: got.append(get_id(get())))
    t.start()
    t.join()
    return got[0]


@pytest.mark.slow  # a process of its own: ~9 s on the dev VM
def test_the_callbacks_that_time_collectives_keep_their_threads_python_state(tmp_path):
    """Each DDP bucket's future callback, and an async collective's, runs on gloo's run loop under
    pybind11's GIL acquire, which made a Python thread state and deleted it at each one, as did
    the release of the callback and of the work's tensors (comm/base.py: 64 made over these 30
    steps before the callbacks kept their threads'); so does NCCL's completion hook on its thread
    (stand-ins here). Only a thread's first may make one now.
    In a process of its own: a process keeps at most ThreadStates.MAX threads' states, and this
    one's earlier tests may have used them up."""
    from placerun_helpers import run_gloo_ranks

    run_gloo_ranks(1, [__file__, "thread-states", str(tmp_path)], timeout=120)
    made = json.loads((tmp_path / "made.json").read_text())
    steps, _ = _steps(tmp_path)
    assert len(steps) == 65 and all(s["comm_count"] >= 2 for s in steps[5:35]), steps[-1]  # buckets: 2 a step or more
    assert all(s["comm_count"] == 1 and s["comm_inflight_ms"] > 0 for s in steps[35:]), steps[-1]
    assert made["ddp"] <= 4 and made["async"] <= 2 and made["nccl_hook"] <= 2, made


def _thread_states_worker(log_dir: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)), bucket_cap_mb=0.001)
    h = placement.attach(model, policy="none", tune={"enabled": False},
                         monitor={"log_dir": log_dir, "summary_every": 0, "comm_timing": "wall", "record_min_s": 0})
    x = torch.randn(16, 32)
    for _ in range(5):
        model(x).square().mean().backward()
        h.step()
    first = _next_thread_state_id()
    for _ in range(30):
        model(x).square().mean().backward()
        h.step()
    made = _next_thread_state_id() - first - 1
    group, t = dist.new_group([0]), torch.ones(8)  # a group of its own: run loops no callback has kept
    first = _next_thread_state_id()
    for _ in range(30):  # an async collective called from Python: timed by its future's callback
        dist.all_reduce(t, group=group, async_op=True).wait()
        h.step()
    made_async = _next_thread_state_id() - first - 1
    h.close()
    # NCCL's completion hook, stand-ins: a group that takes the hook as ProcessGroupNCCL's
    # _register_on_completion_hook does, and a thread Python has never seen that calls it under
    # pybind11's GIL acquire, as pt_nccl_runhook does (PyProcessGroup.hpp:366
    # PythonOnCompletionHook::operator()): a gloo future's done callback (pybind_utils.h:203)
    class StandInNcclGroup:
        hook = None

        def _enable_collectives_timing(self):
            pass

        def _register_on_completion_hook(self, hook):
            self.hook = hook

    pg = StandInNcclGroup()
    nccl_hook = NcclHookComm(WarnOnce(), groups=[pg])
    group = dist.new_group([0])
    first = _next_thread_state_id()
    for _ in range(30):
        work = dist.all_reduce(t, group=group, async_op=True)
        work.get_future().add_done_callback(lambda _f: pg.hook(None))
        work.wait()
    made_nccl = _next_thread_state_id() - first - 1
    nccl_hook.close()
    with open(os.path.join(log_dir, "made.json"), "w") as f:
        json.dump({"ddp": made, "async": made_async, "nccl_hook": made_nccl}, f)
    dist.destroy_process_group()


def test_a_one_rank_ddp_job_has_no_comm_hook_and_says_its_comm_time_is_null(tmp_path, gloo_world_of_one):
    """Its all-reduces move nothing, and the hook's Python call per bucket was the whole gap between
    placerun and torchrun on it: under `auto` DDP keeps its own C++ all-reduce, and comm_ms is
    null (not a figure missing the buckets), said once in the log."""
    from placement.monitor.comm import ONE_RANK_LINE

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    h = placement.attach(ddp, opt, policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0})
    x = torch.randn(16, 32)
    for _ in range(3):
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    h.close()
    steps, lines = _steps(tmp_path)
    assert not getattr(ddp, "_comm_hooks", None) and not hasattr(ddp, "_placement_ddp_target")
    assert len(steps) == 3 and all(s["comm_ms"] is None for s in steps)
    start = next(l for l in lines if l["type"] == "start")
    assert start["ddp_hook"] is False and start["ddp_buckets"] == "unmeasured"
    said = [l for l in lines if l["type"] == "monitor" and l.get("message") == ONE_RANK_LINE]
    assert len(said) == 1 and "comm_timing=wall" in ONE_RANK_LINE


def test_ddp_buckets_are_seen_by_the_recorder_where_it_sees_all_else_by_the_hook(gloo_world_of_one):
    """The route each DDP job's bucket all-reduces take (timing.ddp_bucket_route)."""
    from placement.config import CommTimingMode as M
    from placement.monitor.comm import DdpBuckets, ddp_bucket_route
    from placement.monitor.comm.flight_recorder import DumpSource

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 2)))
    fr = NcclFlightRecorderComm(WarnOnce(), sources=[DumpSource("nccl", "server", "dump_nccl_trace_json", lambda: "{}")],
                                timing_on=True, since=0)
    wall = make_comm_timing("auto", "gloo", WarnOnce())
    hook = NcclHookComm(WarnOnce(), groups=[])
    assert fr.sees_all and ddp_bucket_route(M.AUTO, fr, 8, ddp) is DdpBuckets.RECORDER
    assert ddp_bucket_route(M.FLIGHT_RECORDER, fr, 1, ddp) is DdpBuckets.RECORDER
    assert ddp_bucket_route(M.HOOK, hook, 8, ddp) is DdpBuckets.HOOK  # it settles by the counts the hook enters
    assert ddp_bucket_route(M.AUTO, wall, 1, ddp) is DdpBuckets.UNMEASURED
    assert ddp_bucket_route(M.AUTO, wall, 2, ddp) is DdpBuckets.HOOK
    assert ddp_bucket_route(M.WALL, wall, 1, ddp) is DdpBuckets.HOOK
    assert ddp_bucket_route(M.AUTO, fr, 8, torch.nn.Linear(2, 2)) is DdpBuckets.NOT_DDP
    hook.close()
    fr.close()


def test_ddp_buckets_reach_the_records_through_the_recorder_alone(tmp_path, gloo_world_of_one, monkeypatch):
    """The recorder route end to end, on CPU: torch's generic flight recorder, which records gloo
    work, read as the NCCL one would be (its `gloo:` entries), a real DDP model, attach(). No comm
    hook is installed, and each step's collectives are the recorder's: DDP's first backward
    all-reduces one bucket, the second forward rebuilds the buckets with two broadcasts
    (Reducer::rebuild_buckets), then 4 buckets of 2 MB caps a step. gloo records no duration, so
    comm_ms is null with its count."""
    import torch._C._distributed_c10d as c10d
    from placement.monitor.comm import timing
    from placement.monitor.comm.flight_recorder import DumpSource, _binding_dump

    if not hasattr(c10d, "_dump_fr_trace_json"):
        pytest.skip("this torch has no generic flight-recorder dump")

    def recorder(mode, backend, warn, **_):
        src = DumpSource("nccl", "binding", "_dump_fr_trace_json", _binding_dump(c10d._dump_fr_trace_json))
        fr = NcclFlightRecorderComm(warn, sources=[src], timing_on=False)
        fr.reader.prefix = "gloo:"
        return fr

    monkeypatch.setattr(timing, "make_comm_timing", recorder)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    h = placement.attach(ddp, opt, policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0})
    x = torch.randn(8, 1024)
    for _ in range(6):
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    h.close()
    steps, lines = _steps(tmp_path)
    start = next(l for l in lines if l["type"] == "start" and l.get("source") == "monitor")
    assert start["comm_timing"] == "flight_recorder" and start["ddp_hook"] is False
    assert start["ddp_buckets"] == "flight_recorder" and not getattr(ddp, "_comm_hooks", None)
    assert [s["comm_count"] for s in steps] == [1, 6, 4, 4, 4, 4]
    assert all(s["comm_ms"] is None for s in steps)
    assert all(a["t"] <= b["comm_enter_t"] <= b["t"] for a, b in zip(steps, steps[1:]))  # inside its own step
    assert steps[0]["comm_enter_t"] <= steps[0]["t"]


def test_nccl_modes_asked_on_gloo_fall_back_to_wall_time_with_a_warning(caplog):
    caplog.set_level(logging.WARNING)
    timing = make_comm_timing("hook", "gloo", WarnOnce())
    assert timing.name == "wall"
    assert "needs the NCCL backend" in caplog.text
    assert make_comm_timing("off", "gloo", WarnOnce()).name == "off"


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                               reason="NCCL timing needs an NVIDIA GPU and an NCCL build of torch")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", ["hook", "flight_recorder"])
def test_nccl_comm_time_on_a_one_gpu_group(tmp_path, mode, monkeypatch):
    monkeypatch.setenv("NCCL_SET_THREAD_NAME", "1")
    if mode == "flight_recorder":  # durations are recorded only with timing on (ProcessGroupNCCL.hpp:88-94)
        monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", "1")
    dist.init_process_group(init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))  # no backend: "undefined", NCCL on a GPU host
    try:
        h = placement.attach(policy="none", tune={"enabled": False},
                             monitor={"log_dir": str(tmp_path), "comm_timing": mode, "flush_every": 5,
                                      "summary_every": 0})
        x = torch.ones(64 << 20, device="cuda")
        for _ in range(10):
            for _ in range(4):
                dist.all_reduce(x)
            torch.cuda.synchronize()  # the test's own sync: the monitor adds none
            time.sleep(0.15)  # let the watchdog (kWatchdogThreadSleepMillis = 100) retire them
            h.step()
        h.close()
        steps, lines = _steps(tmp_path)
        start = next(l for l in lines if l["type"] == "start")
        assert start["backend"] == "nccl" and start["comm_timing"] == mode
        assert all(s["comm_count"] == 4 for s in steps)
        timed = [s["comm_ms"] for s in steps if s["comm_ms"]]
        assert len(timed) >= 5 and all(ms > 0 for ms in timed)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@needs_gpu
def test_ddp_on_nccl_has_no_comm_hook_and_its_buckets_come_from_the_flight_recorder(tmp_path, monkeypatch):
    """Under `auto` a DDP model on NCCL gets no comm hook (its Python call per bucket takes the
    GIL on the autograd thread): each step's bucket all-reduces, their count, first enqueue
    time and durations come from the flight recorder."""
    monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", "1")  # what placerun sets on GPU ranks
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=2)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        h = placement.attach(ddp, opt, policy="none", tune={"enabled": False},
                             monitor={"log_dir": str(tmp_path), "flush_every": 5, "summary_every": 0})
        x = torch.randn(64, 1024, device="cuda")
        for _ in range(12):
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            time.sleep(0.15)  # let the watchdog (kWatchdogThreadSleepMillis = 100) retire them
        h.close()
        steps, lines = _steps(tmp_path)
        start = next(l for l in lines if l["type"] == "start")
        assert start["comm_timing"] == "flight_recorder" and start["ddp_hook"] is False
        assert not getattr(ddp, "_comm_hooks", None)
        # DDP's first backward all-reduces one bucket; the second forward rebuilds the buckets
        # (Reducer::rebuild_buckets, two broadcasts of sync_bucket_indices), then 16 MB of
        # gradients go in 4 buckets of 2 MB caps. The hook saw only the all-reduces; the recorder
        # sees the broadcasts too. (The same sequence on gloo in torch's generic recorder.)
        assert [s["comm_count"] for s in steps] == [1, 6] + [4] * (len(steps) - 2)
        timed = [s for s in steps if s["comm_ms"]]
        assert len(timed) >= len(steps) - 1 and all(s["comm_ms"] > 0 for s in timed)
        assert all(s["comm_enter_t"] is not None and s["comm_enter_t"] <= s["t"] for s in steps)
    finally:
        dist.destroy_process_group()


def test_nccl_timers_need_no_gpu_to_be_built():
    """Both NCCL timers construct (and stay quiet) without any NCCL group: they only read
    PyTorch's own records, never add events unless asked (hook mode, per group)."""
    warn = WarnOnce()
    fr = NcclFlightRecorderComm(warn)
    assert fr.resolve_steps([], []) == [] and fr.timed_calls is False
    hook = NcclHookComm(warn, groups=[])
    assert [s.comm_ms for s in hook.resolve_steps([(0.0, 1.0)], [CommStep(None, 1, None)])] == [None]
    hook.close()
    fr.close()


if __name__ == "__main__":
    if sys.argv[1] == "thread-states":
        _thread_states_worker(sys.argv[2])
