"""NCCL comm timing without a GPU: the flight-recorder reader on a dump torch itself produces
(gloo, CPU) and on NCCL-shaped stand-ins (tests/nccl_recorder_standins.py, each citing the upstream code
it copies), the completion hook on WorkInfo shaped as pybind11 delivers it, and the backend of
real gloo groups created with every backend string that works on CPU."""
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from nccl_recorder_standins import NcclGroup, fr_dump_json, fr_entry, work_info
from placement.monitor.comm.base import CommStep
from placement.monitor.comm.timing import make_comm_timing
from placement.monitor.comm.groups import describe_group, group_backends, nccl_groups, parse_backend_config
from placement.monitor.comm.nccl import (MAX_POLL_S, MIN_POLL_S, FrCadence, Ledger, NcclFlightRecorderComm, NcclHookComm,
                                         choose_nccl_timing, workinfo_start_wall)
from placement.monitor.comm.flight_recorder import DumpSource, RingReader, RingSetting, dump_sources, entries_from, ring_setting
from placement.monitor.warn import WarnOnce

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(**kw):
    dist.init_process_group(init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1, **kw)


# ---- the reader on torch's own dump (gloo records into FlightRecorder<c10::Event>) -----------------
def test_reader_reads_torch_own_cpu_dump_once_each_in_real_time(gloo_world_of_one):
    sources = [s for s in dump_sources() if s.recorder == "generic"]
    assert sources, "torch 2.13 has _dump_fr_trace_json in every build"

    def retired_by_torch(source, since_s):
        """Wait, bounded, until torch has retired every record created since `since_s`.
        ProcessGroupGloo::runLoop (ProcessGroupGloo.cpp) calls retire_id only after
        AsyncWork::execute has completed the work's future, so all_reduce can return while its
        record is still unretired, and the reader rightly holds such a record back until a
        later read: a read straight after all_reduce then misses it (seen 1 in ~300 runs)."""
        deadline = time.monotonic() + 10.0
        while True:
            ours = [e for e in json.loads(source.dump()).get("entries", [])
                    if e["time_created_ns"] >= since_s * 1e9]
            if all(e["retired"] for e in ours):
                return
            assert time.monotonic() < deadline, f"torch left records unretired for 10 s: {ours}"
            time.sleep(0.001)

    t = torch.ones(8)
    t_before = time.time()
    for _ in range(7):
        dist.all_reduce(t)
    t_after = time.time()
    for source in sources:  # the worker server and the binding give the same records
        try:
            retired_by_torch(source, t_before)
            reader = RingReader(prefix="gloo:")
            first = reader.read(source.dump()).entries
            ours = [e for e in first if t_before <= e.created_s <= t_after]
            assert len(ours) == 7 and all(e.name == "gloo:all_reduce" for e in ours)  # CLOCK_REALTIME, as time.time()
            ids = [e.record_id for e in first]
            assert ids == sorted(ids) and ids == list(range(ids[0], ids[0] + len(ids)))
            t_new = time.time()
            dist.all_reduce(t)
            retired_by_torch(source, t_new)
            again = reader.read(source.dump()).entries
            assert [e.record_id for e in again] == [ids[-1] + 1]  # only the new one
            assert reader.read(source.dump()).entries == []
        finally:  # a worker server left running keeps its socket file
            source.close()


def test_worker_server_route_leaves_the_gil_free_while_torch_formats(gloo_world_of_one):
    """The Python binding formats the dump holding the GIL; torch's worker server runs the
    same C++ dump on its thread with it released: the main thread keeps running meanwhile."""
    import threading

    sources = dump_sources()
    handler = next((s for s in sources if s.route == "server"), None)
    if handler is None:
        pytest.skip("this torch has no control-plane worker server for the flight recorder")
    binding = next(s for s in sources if s.route == "binding" and s.recorder == handler.recorder)
    t = torch.ones(8)
    for _ in range(1500):
        dist.all_reduce(t)

    def longest_main_gap(source):
        gaps, done = [], threading.Event()
        th = threading.Thread(target=lambda: (source.dump(), done.set()))
        last = time.perf_counter()
        th.start()
        while not done.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        th.join()
        return max(gaps)

    # A busy machine preempts main for a few ms whatever holds the GIL, which only ever makes the
    # free route look held, never the reverse: up to 3 rounds, each the shortest of 3 looks per route
    # (under two spinners one round read 5.5 ms free against 10.2 ms held).
    rounds = []
    try:
        handler.dump()  # the server starts at the first dump
        for _ in range(3):
            held = min(longest_main_gap(binding) for _ in range(3))
            free = min(longest_main_gap(handler) for _ in range(3))
            rounds.append((free, held))
            if free < held / 2:
                break
    finally:
        handler.close()
    assert any(free < held / 2 for free, held in rounds), rounds


PARAMS_SCRIPT = textwrap.dedent("""
    import os
    import torch._C._distributed_c10d as c10d

    class Request(c10d._Request):
        def body(self):
            return b""

        def params(self):
            return {"onlyactive": "false"}

    class Response(c10d._Response):
        def set_content(self, content, content_type):
            self.content = content

        def set_status(self, status):
            self.status = status

    def probe(req, resp):
        try:  # the C++ getParam calls the virtual params(): the trampoline into Request.params
            resp.set_content("ok " + c10d._Request.get_param(req, "onlyactive"), "text/plain")
        except Exception as e:
            resp.set_content("error " + type(e).__name__, "text/plain")

    c10d._register_handler("placement_params_probe", probe)
    resp = Response()
    c10d._get_handler("placement_params_probe")(Request(), resp)
    print(resp.content, flush=True)
    os._exit(0)  # a Python handler left in torch's registry cannot be destroyed at exit
""")


def test_a_python_made_request_cannot_answer_params_hence_the_worker_server():
    """Why the NCCL handler is reached through the worker server: it reads req.params()
    (FlightRecorderCuda.cpp), and torch's trampoline for a Python _Request cannot cast what
    Python returns to the std::multimap of Handlers.hpp:22."""
    out = subprocess.run([sys.executable, "-c", PARAMS_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().startswith("error"), out.stdout + out.stderr[-1000:]


RING_SCRIPT = textwrap.dedent("""
    import json, os, socket, sys
    sys.path.insert(0, {root!r})
    import torch, torch.distributed as dist
    from placement.monitor.comm.flight_recorder import RingReader, dump_sources, ring_setting
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
    t = torch.ones(4)
    source = [x for x in dump_sources() if x.recorder == "generic"][0]
    reader = RingReader(prefix="gloo:")
    for _ in range(30): dist.all_reduce(t)
    a = reader.read(source.dump())
    for _ in range(100): dist.all_reduce(t)
    b = reader.read(source.dump())
    print(json.dumps({{"ring": ring_setting().size, "first": len(a.entries), "second": len(b.entries), "lost": b.lost,
                      "overflow": reader.overflow, "span": b.lost_span is not None}}))
    dist.destroy_process_group()
""")


def test_overflow_counts_records_the_ring_overwrote_between_polls():
    """A 40-record ring (TORCH_FR_BUFFER_SIZE, read once by torch when the recorder is made):
    30 read, then 100 more: ids 30..89 were overwritten unread."""
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="40", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", RING_SCRIPT.format(root=ROOT)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # The default group's creation records nothing on gloo here; 30 then 100 all_reduces.
    assert got == {"ring": 40, "first": 30, "second": 40, "lost": 60, "overflow": 60, "span": True}


# ---- NCCL-shaped records (FlightRecorderDetail.hpp) -------------------------------------------------
def test_overlapping_groups_lose_no_entry():
    """Group 1's collectives finish while group 0's earlier one still runs: the earlier one is
    read when it completes, not skipped because higher ids were read first."""
    t = 1000.0
    running = fr_entry(5, t + 0.001, pg_id=0, started_s=t + 0.002)
    later = [fr_entry(6, t + 0.003, pg_id=1, duration_ms=1.0, completed_s=t + 0.01, retired=True),
             fr_entry(7, t + 0.004, pg_id=1, duration_ms=2.0, completed_s=t + 0.011, retired=True)]
    reader = RingReader(low=5)
    first = reader.read(fr_dump_json([running] + later))
    assert [e.record_id for e in first.entries] == [6, 7] and reader.low == 5
    done = fr_entry(5, t + 0.001, pg_id=0, duration_ms=4.0, started_s=t + 0.002, completed_s=t + 0.02, retired=True)
    second = reader.read(fr_dump_json([done] + later))
    assert [(e.record_id, e.duration_ms) for e in second.entries] == [(5, 4.0)] and reader.low == 8
    assert reader.overflow == 0


def test_records_without_events_do_not_hold_the_reader_back():
    """Ops inside a coalesced group are recorded without events (never completed by
    themselves); the completed entry after them in the same group settles them."""
    t = 2000.0
    entries = [fr_entry(0, t, name="nccl:all_reduce"), fr_entry(1, t, name="nccl:all_reduce"),
               fr_entry(2, t + 0.001, name="nccl:coalesced", duration_ms=3.0, completed_s=t + 0.01)]
    reader = RingReader()
    got = reader.read(fr_dump_json(entries))
    assert [e.record_id for e in got.entries] == [0, 1, 2] and reader.low == 3
    assert [e.duration_ms for e in got.entries] == [None, None, 3.0]


def test_entries_from_parses_only_the_new_tail_and_detects_a_reset():
    text = fr_dump_json([fr_entry(i, 10.0 + i, duration_ms=1.0, completed_s=11.0 + i) for i in range(100, 110)])
    tail, first = entries_from(text, 107)
    assert first == 100 and [e["record_id"] for e in tail] == [107, 108, 109]
    assert entries_from(text, 110) == ([], 100)
    assert entries_from(fr_dump_json([]), 0) == ([], None)
    with pytest.raises(ValueError):
        entries_from(text, 500)  # ids went back below what was read: reset_all()
    reader = RingReader(low=500)
    assert len(reader.read(text).entries) == 10 and reader.low == 110
    late = RingReader()  # attached to a job whose ring wrapped long ago: nothing counted as lost
    got = late.read(text)
    assert len(got.entries) == 10 and got.lost == 0 and late.overflow == 0


def _resolve(comm, spans):
    """comm_ms of steps in which the clock saw a collective call (one each, as the wrappers
    count them), resolved from the source's records."""
    return [s.comm_ms for s in comm.resolve_steps(spans, [CommStep(None, 1, None)] * len(spans))]


def _poll_resolve(comm, spans):
    """What the monitor does at a build: a poll (now: the exit's final one), then the figures."""
    comm.poll_if_due(final=True)
    return _resolve(comm, spans)


def _standin_source(dumps: list[str]) -> DumpSource:
    it = iter(dumps)
    return DumpSource("nccl", "server", "dump_nccl_trace_json", lambda: next(it))


def test_flight_recorder_comm_time_per_step_with_timing_on():
    t = time.time() - 10
    spans = [(t, t + 0.1), (t + 0.1, t + 0.2), (t + 0.2, t + 0.3)]
    entries = [fr_entry(0, t + 0.01, duration_ms=2.5, completed_s=t + 0.05, retired=True),
               fr_entry(1, t + 0.02, duration_ms=1.5, completed_s=t + 0.06, retired=True),
               fr_entry(2, t + 0.15, duration_ms=8.0, completed_s=t + 0.19, retired=True),
               fr_entry(3, t + 0.16, name="gloo:all_reduce", completed_s=t + 0.17, retired=True)]
    comm = NcclFlightRecorderComm(WarnOnce(), sources=[_standin_source([fr_dump_json(entries)])], timing_on=True,
                                  since=0)
    assert _poll_resolve(comm, spans) == [4.0, 8.0, None]  # the third step's collectives: not in the ring


def test_timing_off_leaves_comm_null_and_says_what_to_set(caplog):
    """Without TORCH_NCCL_ENABLE_TIMING no entry has duration_ms: comm stays null, and after
    the first exchange window one warning names what to set."""
    caplog.set_level(logging.WARNING)
    t = time.time() - 10
    dumps = [fr_dump_json([fr_entry(i, t + 0.01 * i, completed_s=t + 0.01 * i + 0.005, retired=True)
                           for i in range(n)]) for n in (10, 20, 30)]
    comm = NcclFlightRecorderComm(WarnOnce(), window=15, sources=[_standin_source(dumps)], timing_on=False, since=0)
    assert _poll_resolve(comm, [(t + 0.01 * i, t + 0.01 * (i + 1)) for i in range(10)]) == [None] * 10
    assert "NCCL comm time is null" not in caplog.text
    _poll_resolve(comm, [(t + 0.01 * i, t + 0.01 * (i + 1)) for i in range(10, 20)])
    assert caplog.text.count("NCCL comm time is null") == 1 and "TORCH_NCCL_ENABLE_TIMING=1" in caplog.text
    _poll_resolve(comm, [(t + 0.01 * i, t + 0.01 * (i + 1)) for i in range(20, 30)])
    assert caplog.text.count("NCCL comm time is null") == 1


def test_overflow_nulls_the_steps_whose_records_were_lost(caplog):
    caplog.set_level(logging.WARNING)
    t = time.time() - 10
    # Each collective enqueued 2 ms into its 10 ms slot, never on a step's edge: at t + 0.01 * 30
    # against a step starting at t + 0.3 the float sums may differ by an ulp either way (time.time()
    # decides), and collective 30 fell in the step before (4.0 ms, not 5.0, seen once under load).
    ring = [fr_entry(i, t + 0.01 * i + 0.002, duration_ms=1.0, completed_s=t + 0.01 * i + 0.003, retired=True)
            for i in range(0, 10)]
    wrapped = [fr_entry(i, t + 0.01 * i + 0.002, duration_ms=1.0, completed_s=t + 0.01 * i + 0.003, retired=True)
               for i in range(25, 35)]  # 10..24 overwritten
    comm = NcclFlightRecorderComm(WarnOnce(), sources=[_standin_source([fr_dump_json(ring), fr_dump_json(wrapped)])],
                                  timing_on=True, environ={"TORCH_NCCL_TRACE_BUFFER_SIZE": "10"}, since=0)
    assert _poll_resolve(comm, [(t, t + 0.1)]) == [10.0]
    got = _poll_resolve(comm, [(t + 0.1, t + 0.2), (t + 0.2, t + 0.3), (t + 0.3, t + 0.4)])
    assert got[0] is None and got[1] is None and got[2] == 5.0  # 30..34 read whole; 10..24 gone
    assert comm.reader.overflow == 15 and "wrapped between two polls" in caplog.text
    assert comm.stats()["overflow"] == 15 and comm.ring == 10


def test_no_nccl_record_in_the_nccl_recorder_probes_the_generic_one_once(caplog):
    """Where upstream merged the two recorders, the NCCL records are in the generic one."""
    caplog.set_level(logging.WARNING)
    t = time.time() - 10
    nccl = _standin_source([fr_dump_json([])] * 3)
    merged = DumpSource("generic", "server", "fr_trace_json",
                        lambda: fr_dump_json([fr_entry(0, t + 0.01, duration_ms=3.0, completed_s=t + 0.02)]))
    comm = NcclFlightRecorderComm(WarnOnce(), sources=[nccl, merged], timing_on=True, since=0)
    _poll_resolve(comm, [(t, t + 0.005)])
    assert comm.source is merged and "NCCL records are in server fr_trace_json" in caplog.text
    assert _poll_resolve(comm, [(t + 0.005, t + 0.1)]) == [3.0]


def test_cadence_holds_the_gil_time_inside_the_budget_unless_the_ring_would_wrap():
    c = FrCadence(budget_pct=0.3, ring=2000)
    # 3 ms of GIL per poll: 1 s between polls keeps it to 0.3%.
    assert c.update(0.003, records=200, since_last_s=1.0) == pytest.approx(1.0) and not c.over_budget
    # 30 ms per poll would want 10 s: polls are at most MAX_POLL_S apart (a step is built soon after it settles).
    assert c.update(0.030, records=200, since_last_s=1.0) == MAX_POLL_S and c.over_budget
    # 2,000 records a second: the ring holds 1,000 at half-full, so polls 0.5 s apart at most.
    c = FrCadence(budget_pct=0.3, ring=2000)
    assert c.update(0.003, records=2000, since_last_s=1.0) == pytest.approx(0.5) and c.over_budget
    # Never faster than the watchdog retires (100 ms).
    assert FrCadence(budget_pct=0.3, ring=2000).update(0.0001, records=1, since_last_s=1.0) == MIN_POLL_S


def test_cadence_never_lets_bursty_steps_wrap_the_ring_between_polls():
    """3,000 collectives in the first 15 ms of each 1 s step (TP=8 with sequence parallelism),
    a poll holding the GIL 46 ms (seen under load): a poll that falls between bursts reads none,
    and must not stretch the next interval over more bursts than the ring holds (seen in CI:
    5 s between polls, 2,000 of 10,000 records lost)."""
    ring, burst, step_s = 10_000, 3000, 1.0
    c = FrCadence(budget_pct=0.3, ring=ring)
    bursts = [k * step_s for k in range(200)]
    t, last, worst = 0.0, 0.0, 0
    while t < 150.0:
        t = last + c.interval_s
        records = sum(burst for b in bursts if last < b + 0.015 <= t)
        worst = max(worst, records)
        c.update(0.046, records=records, since_last_s=t - last)
        last = t
    assert worst <= ring * 0.9, worst
    assert c.interval_s >= 1.0  # and the polls are not needlessly frequent: the GIL budget still counts


def test_settled_through_is_the_oldest_collective_still_owed_its_duration():
    """Completed on the GPU but not retired by the watchdog yet (no duration_ms): the steps from
    its enqueue on wait; once retired with its duration they are settled through the dump."""
    t = time.time() - 10
    done = fr_entry(0, t + 0.01, duration_ms=2.0, completed_s=t + 0.02, retired=True)
    completed = fr_entry(1, t + 0.11, completed_s=t + 0.12)  # the dump's copy queried the end event: no retire yet
    retired = fr_entry(1, t + 0.11, duration_ms=3.0, completed_s=t + 0.12, retired=True)
    comm = NcclFlightRecorderComm(WarnOnce(), sources=[_standin_source([fr_dump_json([done, completed]),
                                                                          fr_dump_json([done, retired])])],
                                  timing_on=True, since=0)
    comm.poll_if_due()
    assert comm.settled_through() == pytest.approx(t + 0.11)
    assert _resolve(comm, [(t, t + 0.1)]) == [2.0]
    comm.poll_if_due(final=True)
    assert comm.settled_through() > t + 9 and _resolve(comm, [(t + 0.1, t + 0.2)]) == [3.0]


# ---- the completion hook: WorkInfo as pybind11 hands it over ----------------------------------------
def test_hook_enables_timing_and_converts_steady_clock_start_times():
    group = NcclGroup(timing=False)  # registration without timing is refused by ProcessGroupNCCL
    comm = NcclHookComm(WarnOnce(), groups=[group])
    assert group.timing is True and group.hook is not None and comm.groups == 1
    t = time.time() - 5
    group.fire([work_info(t + 0.01, 2.0), work_info(t + 0.02, 3.0), work_info(t + 0.12, 7.5)])
    assert _poll_resolve(comm, [(t, t + 0.1), (t + 0.1, t + 0.2)]) == [pytest.approx(5.0), pytest.approx(7.5)]
    comm.close()
    group.fire([work_info(t + 0.3, 1.0)])  # a hook cannot be removed: it goes quiet
    assert _poll_resolve(comm, [(t + 0.2, t + 0.4)]) == [None]


def test_workinfo_start_times_of_both_clock_types():
    t = time.time() - 3
    offset = time.time() - time.monotonic()
    assert workinfo_start_wall(work_info(t, 1.0), offset) == pytest.approx(t, abs=1e-3)
    old = type("OldWorkInfo", (), {"time_started": datetime.datetime.fromtimestamp(t)})()  # system_clock
    assert workinfo_start_wall(old, offset) == pytest.approx(t, abs=1e-3)
    with pytest.raises(TypeError):
        workinfo_start_wall(type("X", (), {"time_started": 5})(), offset)


def test_a_second_hook_on_a_group_is_refused_with_a_warning(caplog):
    caplog.set_level(logging.WARNING)
    group = NcclGroup(timing=True)
    group._register_on_completion_hook(lambda info: None)  # the user's own hook
    comm = NcclHookComm(WarnOnce(), groups=[group])
    assert comm.groups == 0 and "already registered" in caplog.text


def test_ledger_sums_per_span_and_consumes():
    led = Ledger()
    for t, d in [(0.5, 1.0), (0.1, 2.0), (1.5, None), (2.5, 4.0)]:
        led.add(t, d)
    assert [f.ms for f in led.take([(0.0, 1.0), (1.0, 2.0)])] == [3.0, None]
    assert [f.ms for f in led.take([(2.0, 3.0)])] == [4.0]


# ---- backend detection -------------------------------------------------------------------------------
@pytest.mark.parametrize("form", [None, "gloo", "GLOO", "cpu:gloo", "cpu:gloo,cuda:gloo"])
def test_backend_of_real_gloo_groups_from_each_string_form(form):
    kw = {} if form is None else {"backend": form}
    _init(**kw)
    try:
        sub = dist.new_group(**kw)
        groups = group_backends()
        assert len(groups) == 2 and all(g.name == "gloo" and not g.nccl for g in groups)
        assert groups[0].devices["cpu"] == "gloo"
        assert nccl_groups() == []
        assert sub in [g.group for g in groups]
        if form is None:
            assert dist.get_backend() == "undefined"  # the string compare this replaces
        assert make_comm_timing("auto", groups[0].name, WarnOnce()).name == "wall"
    finally:
        dist.destroy_process_group()


class _DistStandIn:
    """torch.distributed.get_backend_config as it answers for NCCL groups on a GPU host
    (BackendConfig.__repr__, distributed_c10d.py:483; undefined -> the accelerator's
    default, "cuda:nccl", line 419)."""

    def __init__(self, config: str):
        self.config = config

    def get_backend_config(self, _group):
        return self.config


@pytest.mark.parametrize("config", ["cuda:nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_groups_found_whatever_string_the_user_gave(config):
    g = describe_group(_DistStandIn(config), object())
    assert g.nccl and g.name == "nccl" and g.devices["cuda"] == "nccl"
    assert parse_backend_config("cpu:gloo,cuda:gloo") == {"cpu": "gloo", "cuda": "gloo"}


def test_nccl_timing_chosen_when_a_group_runs_nccl(monkeypatch):
    import placement.monitor.comm.groups as cg

    monkeypatch.setattr(cg, "group_backends", lambda: [describe_group(_DistStandIn("cpu:gloo,cuda:nccl"), object())])
    assert make_comm_timing("auto", "gloo", WarnOnce()).name == "flight_recorder"
    assert isinstance(choose_nccl_timing("hook", WarnOnce()), NcclHookComm)


def test_ring_size_as_torch_reads_it():
    assert ring_setting({}) == RingSetting(2000, None)
    assert ring_setting({"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}) == RingSetting(500, "TORCH_NCCL_TRACE_BUFFER_SIZE")
    both = ring_setting({"TORCH_FR_BUFFER_SIZE": "64", "TORCH_NCCL_TRACE_BUFFER_SIZE": "500"})
    assert both == RingSetting(64, "TORCH_FR_BUFFER_SIZE") and str(both) == "TORCH_FR_BUFFER_SIZE=64"
    assert ring_setting({"TORCH_FR_BUFFER_SIZE": "12abc"}).size == 12  # std::stoi reads the leading digits
    assert ring_setting({"TORCH_FR_BUFFER_SIZE": "abc"}) == RingSetting(2000, None)


# ---- through attach(): the step monitor holds steps back until the poll that times them -------------
@pytest.fixture
def relabelled_nccl_timing(monkeypatch, request):
    """The monitor's comm timing made as NCCL's flight-recorder timing over the real CPU
    recorder, its gloo records relabelled as NCCL ones with a duration (as ProcessGroupNCCL's
    are with timing on), and a GIL budget so small that polls are spaced out. Yields the list
    the timings made are appended to."""
    import placement.monitor.comm.timing as comm_mod

    real = next(s for s in dump_sources() if s.recorder == "generic" and s.route == "server")
    request.addfinalizer(real.close)

    def as_nccl():
        d = json.loads(real.dump())
        for e in d.get("entries", []):
            if e["profiling_name"] == "gloo:all_reduce":
                e.update(profiling_name="nccl:all_reduce", state="completed", duration_ms=1.5)
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    made = []

    def make(mode, backend, warn, **kw):
        made.append(NcclFlightRecorderComm(warn, window=kw.get("window", 20), budget_pct=0.0001,
                                           sources=[DumpSource("nccl", "server", "dump_nccl_trace_json", as_nccl)],
                                           timing_on=True))
        return made[-1]

    monkeypatch.setattr(comm_mod, "make_comm_timing", make)
    return made


def test_flight_recorder_timing_end_to_end_through_the_monitor(tmp_path, gloo_world_of_one, relabelled_nccl_timing):
    """The real CPU recorder, its gloo records relabelled as NCCL ones with a duration (as
    ProcessGroupNCCL's are with timing on): every step gets its collectives' time, also the
    steps held back on flushes without a poll (a budget so small that polls are spaced out)."""
    import placement
    from placement.records.step import line_steps

    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "flush_every": 5, "summary_every": 0})
    t = torch.ones(16)
    for _ in range(23):
        dist.all_reduce(t)
        dist.all_reduce(t)
        h.step()
    h.close()
    lines = [json.loads(l) for l in open(tmp_path / "rank0.jsonl")]
    steps = [l for l in lines if l["type"] == "step"]
    assert [n for s in steps for n in line_steps(s)] == list(range(1, 24))
    assert [s["comm_ms"] for s in steps] == [3.0] * len(steps)  # per step (a record of several: their mean)
    assert relabelled_nccl_timing[0].polls < 23 / 5  # polls were spaced out: steps waited for the next one
    fr_event = next(l for l in lines if l["type"] == "monitor" and l.get("source") == "comm")
    assert fr_event["flight_recorder"]["overflow"] == 0 and fr_event["flight_recorder"]["entries"] == 46


def test_exchange_sends_the_same_steps_whatever_the_poll_cadence(tmp_path, gloo_world_of_one, relabelled_nccl_timing):
    """Polls spaced out (a tiny budget): at a build without a poll the steps after the last
    settled point are held back. The steps an exchange sends are still exchange_steps(step,
    every), the same on every rank whatever its polls, and all built: an exchange whose steps
    are not built yet waits until they are (it used to go out empty)."""
    import placement
    from placement.monitor.crossrank.exchange import exchange_steps

    class SentFigures:  # the exchange as the monitor uses it; a world of one has none
        enabled, pending = True, False

        def __init__(self):
            self.sent = []

        def submit(self, windows, wait_s=None, at_exit=False):
            self.sent.extend((figs.first_step, figs.last_step, figs.steps, at_exit) for figs in windows)
            return []

        def close(self, timeout_s=2.0):
            return []

    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "flush_every": 5, "exchange_every": 10, "summary_every": 0})
    h.monitor.crossrank.exchange = exchange = SentFigures()
    t = torch.ones(16)
    for _ in range(43):
        dist.all_reduce(t)
        h.step()
    h.close()
    assert relabelled_nccl_timing[0].polls < 43 / 5  # polls were spaced out: some builds held steps back
    during = [(first, last, n) for first, last, n, at_exit in exchange.sent if not at_exit]
    assert [(first, last) for first, last, _ in during] == [exchange_steps(s, 10) for s in (10, 20, 30, 40)]
    # every step of them built when sent (the first exchange's window is before step 1)
    assert all(n == last - first + 1 for first, last, n in during[1:]), during


def test_null_comm_is_one_warning_event_after_the_first_exchange_window(tmp_path, gloo_world_of_one, monkeypatch,
                                                                          request):
    """Timing off: the records carry no duration; after monitor.exchange_every steps one
    `warning` event (and log line) says why and what to set, and no more follow."""
    import placement
    import placement.monitor.comm.timing as comm_mod

    real = next(s for s in dump_sources() if s.recorder == "generic" and s.route == "server")
    request.addfinalizer(real.close)

    def as_untimed_nccl():
        d = json.loads(real.dump())
        for e in d.get("entries", []):
            e.update(profiling_name="nccl:all_reduce", state="completed")  # no duration_ms: timing off
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    def make(mode, backend, warn, **kw):
        return NcclFlightRecorderComm(warn, window=kw["window"], timing_on=False,
                                      sources=[DumpSource("nccl", "server", "dump_nccl_trace_json", as_untimed_nccl)])

    monkeypatch.setattr(comm_mod, "make_comm_timing", make)
    h = placement.attach(policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "flush_every": 5, "exchange_every": 10, "summary_every": 0})
    t = torch.ones(16)
    for _ in range(40):
        dist.all_reduce(t)
        h.step()
    h.close()
    lines = [json.loads(l) for l in open(tmp_path / "rank0.jsonl")]
    assert all(l["comm_ms"] is None for l in lines if l["type"] == "step")
    warnings = [l["message"] for l in lines if l["type"] == "warning" and "NCCL comm time is null" in l["message"]]
    assert len(warnings) == 1 and "TORCH_NCCL_ENABLE_TIMING=1" in warnings[0], warnings


@pytest.mark.parametrize("last", ["completed", "started", "scheduled", "coalesced-then-completed"])
def test_a_stall_says_from_the_recorder_whether_the_rank_waits_inside_an_nccl_collective(caplog, last):
    """NCCL calls return at enqueue, so only the recorder knows whether a hung rank's GPU waits
    inside a collective (for a peer): an entry of this rank not completed (scheduled, or started
    with timing on) and not settled by a later completed entry of its group. A rank whose every
    collective completed stopped outside them: the one its peers wait for."""
    t0 = time.time()
    entries = [fr_entry(i, t0 + i, duration_ms=1.0, started_s=t0 + i, completed_s=t0 + i + 0.5) for i in range(5)]
    if last == "started":
        entries.append(fr_entry(5, t0 + 5, started_s=t0 + 5))
    elif last == "scheduled":
        entries.append(fr_entry(5, t0 + 5))
    elif last == "coalesced-then-completed":  # an op inside a coalesced group never completes by itself
        entries += [fr_entry(5, t0 + 5, name="nccl:all_reduce_coalesced"),
                    fr_entry(6, t0 + 5.1, completed_s=t0 + 6, duration_ms=1.0)]
    dump = fr_dump_json(entries)
    timing = NcclFlightRecorderComm(WarnOnce(), sources=[DumpSource("nccl", "server", "dump_nccl_trace_json",
                                                                    lambda: dump)],
                                    timing_on=True, since=t0 - 1)
    timing.poll_if_due(final=True)  # what the monitor read before the stall: the settled entries are behind its low mark
    assert timing.in_collective() is (last in ("started", "scheduled"))

    def broken():
        raise ConnectionError("worker server gone")

    timing.source = DumpSource("nccl", "server", "dump_nccl_trace_json", broken)
    with caplog.at_level(logging.WARNING, logger="placement"):
        assert timing.in_collective() is None and timing.in_collective() is None
    said = [r.getMessage() for r in caplog.records if "at a stall" in r.getMessage()]
    assert len(said) == 1 and "worker server gone" in said[0] and "null" in said[0], said


@pytest.mark.slow
def test_a_stall_dump_that_hangs_is_given_up_in_bounded_time_and_said(caplog):
    """The dump queries CUDA events, which can hang while another thread holds the context in a
    synchronize (ProcessGroupNCCL.cpp's watchdog warns of it): in_collective waits
    STALL_DUMP_WAIT_S at most, says why once, and does not start a second dump behind it."""
    from placement.monitor.comm.nccl import STALL_DUMP_WAIT_S

    release = threading.Event()

    def hung():
        release.wait(60)
        return fr_dump_json([])

    timing = NcclFlightRecorderComm(WarnOnce(), sources=[DumpSource("nccl", "server", "dump_nccl_trace_json", hung)],
                                    timing_on=True, since=0)
    try:
        with caplog.at_level(logging.WARNING, logger="placement"):
            t0 = time.monotonic()
            assert timing.in_collective() is None
            waited = time.monotonic() - t0
            assert timing.in_collective() is None  # the first dump still hangs: no second one
        assert STALL_DUMP_WAIT_S * 0.9 <= waited < STALL_DUMP_WAIT_S * 5, waited
        assert "did not answer" in timing.null_why or "still not answered" in timing.null_why
        said = [r.getMessage() for r in caplog.records if "at a stall" in r.getMessage()]
        assert len(said) == 1 and "did not answer within" in said[0], said
    finally:
        release.set()


def test_flight_recorder_gives_unseen_collectives_their_count_and_entry_time():
    """DDP's bucket all-reduces reach no Python wrapper when no comm hook is installed
    (timing.ddp_bucket_route): a step the clock saw nothing of takes its count, first enqueue
    time and durations from the ring; one the ring holds nothing of had no collective (0.0);
    one the clock saw a call in (e.g. on a gloo group) but the ring did not stays null."""
    from placement.monitor.comm.base import UNSEEN
    t = time.time() - 10
    entries = [fr_entry(0, t + 0.01, duration_ms=2.5, completed_s=t + 0.05, retired=True),
               fr_entry(1, t + 0.02, duration_ms=1.5, completed_s=t + 0.06, retired=True),
               fr_entry(2, t + 0.25, duration_ms=8.0, completed_s=t + 0.29, retired=True)]
    comm = NcclFlightRecorderComm(WarnOnce(), sources=[_standin_source([fr_dump_json(entries)])], timing_on=True,
                                  since=0)
    assert comm.sees_all
    comm.poll_if_due(final=True)
    seen_gloo = CommStep(None, 1, t + 0.15)
    got = comm.resolve_steps([(t, t + 0.1), (t + 0.1, t + 0.2), (t + 0.2, t + 0.3), (t + 0.3, t + 0.4)],
                             [UNSEEN, seen_gloo, CommStep(None, 1, t + 0.21), UNSEEN])
    assert got[0] == CommStep(4.0, 2, pytest.approx(t + 0.01))
    assert got[1] == CommStep(None, 1, t + 0.15)  # the clock's call is not in the ring: null, not 0
    assert got[2] == CommStep(8.0, 1, pytest.approx(t + 0.21))  # the earlier of the two entry times
    assert got[3] == CommStep(0.0, 0, None)


def test_a_recorder_that_may_miss_collectives_does_not_call_an_empty_step_zero():
    """Without a ring (TORCH_FR_BUFFER_SIZE=0) nothing is recorded, so the recorder cannot say a
    step had no collective: sees_all is false, an unseen step stays null."""
    from placement.monitor.comm.base import UNSEEN
    comm = NcclFlightRecorderComm(WarnOnce(), sources=[_standin_source([fr_dump_json([])] * 3)], timing_on=True,
                                  environ={"TORCH_FR_BUFFER_SIZE": "0"}, since=0)
    assert not comm.sees_all
    t = time.time() - 10
    comm.poll_if_due(final=True)
    assert [s.comm_ms for s in comm.resolve_steps([(t, t + 0.1)], [UNSEEN])] == [None]
    hook = NcclHookComm(WarnOnce(), groups=[])
    assert not hook.sees_all


def test_the_worker_servers_socket_lives_in_a_directory_of_ours_alone(gloo_world_of_one, tmp_path, monkeypatch):
    """The flight recorder's worker-server socket: in <tmp>/placement-<uid>/, made mode 0700 (no
    other user can pre-create the path or reach torch's handlers through it, whatever the umask);
    a directory of that name made first by another user is refused (the source fails, one line
    where it is used), never used."""
    import stat as stat_mod
    import tempfile

    import torch._C._distributed_c10d as c10d

    from placement.events import UnsafePlace
    from placement.monitor.comm.flight_recorder import WorkerServer

    if not hasattr(c10d, "_WorkerServer"):
        pytest.skip("this torch has no _WorkerServer")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    names = set(c10d._get_handler_names())
    handler = "dump_traceback" if "dump_traceback" in names else sorted(names)[0]
    old = os.umask(0o002)
    try:
        server = WorkerServer(c10d)
        try:
            server.fetch(handler)
            home = os.path.dirname(server.path)
            assert home == str(tmp_path / f"placement-{os.geteuid()}")
            st = os.lstat(home)
            assert stat_mod.S_ISDIR(st.st_mode) and stat_mod.S_IMODE(st.st_mode) == 0o700
        finally:
            server.close()
    finally:
        os.umask(old)
    planted = tmp_path / "elsewhere"
    planted.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(planted))
    os.mkdir(planted / f"placement-{os.geteuid()}", 0o700)
    os.chown(planted / f"placement-{os.geteuid()}", 4242, 4242)
    with pytest.raises(UnsafePlace, match="uid 4242"):
        WorkerServer(c10d).fetch(handler)
