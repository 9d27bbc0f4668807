"""placement.attach() without placerun: configuration, errors at start, steps, data wait,
observers, and what it leaves behind when closed."""
import json
import os
import threading
import time

import pytest
import torch

import placement
from placement.attach_api import build_config, torch_optimizer
from placement.errors import ConfigError, PlacementError
from placement.records.step import StepRecord, line_steps


def _attach(tmp_path, model=None, opt=None, **kw):
    monitor = {"log_dir": str(tmp_path), "summary_every": 0, **kw.pop("monitor", {})}
    return placement.attach(model, opt, policy="none", tune={"enabled": False}, monitor=monitor, **kw)


def _lines(tmp_path, rank=0):
    return [json.loads(l) for l in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()]


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train_step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_keyword_overrides_nested_and_dotted_and_config_forms(tmp_path):
    cfg = build_config(None, {"policy": "none", "monitor": {"flush_every": 3}, "monitor.rescan_every": 7})
    assert (cfg.policy, cfg.monitor.flush_every, cfg.monitor.rescan_every) == ("none", 3, 7)
    cfg = build_config(["placement.monitor.exchange_every=9"], {"tune.enabled": False})
    assert cfg.monitor.exchange_every == 9 and cfg.tune.enabled is False
    yml = tmp_path / "p.yaml"
    yml.write_text("placement:\n  monitor:\n    summary_every: 11\n")
    assert build_config(str(yml), {}).monitor.summary_every == 11
    assert build_config({"monitor": {"log_dir": "x"}}, {}).monitor.log_dir == "x"


def test_bad_keys_and_values_fail_at_attach_with_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        placement.attach(monitor={"log_dir": str(tmp_path), "flush_evry": 3})
    assert "flush_evry" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        placement.attach(policy="fastest", monitor={"log_dir": str(tmp_path)})
    assert "'fastest'" in str(e.value) and "exclusive" in str(e.value)
    with pytest.raises(PlacementError):
        placement.attach(config=42)


def test_unwritable_log_dir_fails_at_attach_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = str(blocker / "logs")  # a directory cannot be made under a regular file, even as root
    with pytest.raises(PlacementError) as e:
        placement.attach(policy="none", monitor={"log_dir": bad})
    msg = str(e.value)
    assert bad in msg and "not writable" in msg and "\n" not in msg


def test_optimizer_post_step_hook_makes_one_record_per_step(tmp_path):
    model, opt = _model()
    seen = []
    h = _attach(tmp_path, model, opt, monitor={"flush_every": 4, "record_min_s": 0})  # a record a step
    h.add_observer(seen.append)
    built_on = set()
    h.add_observer(lambda r: built_on.add(threading.current_thread().name))
    x = torch.randn(8, 16)
    for _ in range(10):
        _train_step(model, opt, x)
    deadline = time.monotonic() + 10
    while len(seen) < 8 and time.monotonic() < deadline:  # records are built on the monitor thread
        time.sleep(0.01)
    assert [r.step for r in seen] == [1, 2, 3, 4, 5, 6, 7, 8]  # delivered in batches of flush_every
    assert built_on == {"placement_mon"}  # not on the training thread
    h.close()
    assert [r.step for r in seen] == list(range(1, 11))  # close writes the rest
    steps = [l for l in _lines(tmp_path) if l["type"] == "step"]
    assert [s["step"] for s in steps] == list(range(1, 11))
    for s in steps:
        rec = StepRecord.from_dict(s)
        assert rec.to_dict() == s and json.loads(rec.to_json()) == s
        main = s["roles"]["main"]
        assert main["threads"] == 1 and main["cpu_ms"] >= 0 and main["runq_ms"] >= 0
        assert main["cpus"] and set(main["cpus"]) <= os.sched_getaffinity(0)
        assert s["verdict"] in ("cpu-bound", "comm-bound", "data-bound", "balanced")
    kinds = [l["type"] for l in _lines(tmp_path)]
    assert kinds[0] == "start" and kinds[-1] == "end"
    # After close the optimizer no longer feeds the monitor.
    _train_step(model, opt, x)
    assert len(seen) == 10


def test_the_end_event_says_what_the_monitor_thread_cost_per_step(tmp_path):
    """The monitor thread's CPU over its life per step: no less than the kernel's own count of
    that thread's CPU read just before close, no more than the whole process used."""
    model, opt = _model()
    cpu0 = sum(os.times()[:2])
    h = _attach(tmp_path, model, opt, monitor={"flush_every": 4})
    x = torch.randn(8, 16)
    for _ in range(40):
        _train_step(model, opt, x)
    tid = h.monitor.thread.native_id
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        seen_ns = int(f.read().split()[0])
    h.close()
    used_s = sum(os.times()[:2]) - cpu0
    (end,) = [l for l in _lines(tmp_path) if l["type"] == "end" and l.get("source") == "monitor"]
    thread_s = end["monitor_thread_us_per_step"] * end["steps"] / 1e6
    assert end["steps"] == 40 and "monitor_thread_null" not in end, end
    assert seen_ns / 1e9 * 0.99 <= thread_s <= used_s + 0.01, (seen_ns, thread_s, used_s)


def test_the_end_event_says_why_the_monitor_thread_has_no_figure(tmp_path):
    h = _attach(tmp_path, *_model())
    h.close()  # no step: its thread ran (the stall watch runs from step 1) but has no step to share
    (end,) = [l for l in _lines(tmp_path) if l["type"] == "end" and l.get("source") == "monitor"]
    assert end["monitor_thread_us_per_step"] is None and end["monitor_thread_null"] == "no step was monitored", end


def test_wrapped_optimizers_are_found():
    model, opt = _model()

    class Wrapper:  # Megatron's MegatronOptimizer keeps the torch one as .optimizer
        def __init__(self, inner):
            self.optimizer = inner

    class Chained:
        def __init__(self, *inner):
            self.chained_optimizers = list(inner)

    assert torch_optimizer(opt) is opt
    assert torch_optimizer(Wrapper(opt)) is opt
    assert torch_optimizer(Chained(Wrapper(opt))) is opt
    assert torch_optimizer(object()) is None


def test_handle_step_takes_over_from_the_optimizer_hook(tmp_path):
    model, opt = _model()
    h = _attach(tmp_path, model, opt)
    x = torch.randn(8, 16)
    _train_step(model, opt, x)
    assert h.steps == 1
    for _ in range(3):
        _train_step(model, opt, x)  # the optimizer hook is gone after the first handle.step()
        h.step()
    assert h.steps == 4
    h.close()


def test_watch_measures_the_wait_for_data(tmp_path):
    class SlowIterable:
        def __iter__(self):
            for i in range(6):
                time.sleep(0.02)
                yield i

        def __len__(self):
            return 6

    h = _attach(tmp_path)
    watched = h.watch(SlowIterable())
    assert len(watched) == 6
    for _ in watched:
        h.step()
    h.close()
    steps = [l for l in _lines(tmp_path) if l["type"] == "step"]
    assert len(steps) == 6
    assert all(s["data_ms"] >= 19.0 for s in steps)
    assert all(s["data_ms"] <= s["step_ms"] for s in steps)
    # An iterator (not an iterable) works the same through next().
    h2 = _attach(tmp_path / "it")
    it = h2.watch(iter(SlowIterable()))
    next(it)
    h2.step()
    h2.close()
    assert [l["data_ms"] >= 19.0 for l in _lines(tmp_path / "it") if l["type"] == "step"] == [True]


def test_a_raising_observer_is_removed_with_one_warning_and_training_goes_on(tmp_path):
    good = []
    h = _attach(tmp_path, monitor={"flush_every": 1})
    h.add_observer(lambda r: 1 / 0)
    h.add_observer(good.append)
    for _ in range(5):
        h.step()
    h.close()
    assert len(good) == 5
    warnings = [l for l in _lines(tmp_path) if l["type"] == "warning" and "observer" in l["message"]]
    assert len(warnings) == 1 and "ZeroDivisionError" in warnings[0]["message"]


def test_comm_block_counts_as_communication(tmp_path):
    h = _attach(tmp_path)
    with h.comm():
        time.sleep(0.01)
    h.step()
    h.close()
    s = [l for l in _lines(tmp_path) if l["type"] == "step"][0]
    # the block's time is comm in flight; what main waited of it is comm wait, read against
    # main's schedstat (here taken at close, whose own CPU the reading holds: at most the block)
    assert s["comm_count"] == 1 and s["comm_inflight_ms"] >= 9.0 and s["comm_enter_t"] is not None
    assert 0.0 <= s["comm_ms"] <= s["comm_inflight_ms"]


def test_thread_roles_in_the_span_reading(tmp_path):
    """A thread named like PyTorch's pin-memory thread is sampled every step as pin_memory;
    an unnamed one appears as `other` in the span records only."""
    import ctypes

    stop = threading.Event()

    def named(name: bytes):
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
        while not stop.is_set():
            sum(range(2000))
            time.sleep(0.001)

    threads = [threading.Thread(target=named, args=(n,), daemon=True) for n in (b"pt_data_pin", b"helper")]
    for t in threads:
        t.start()
    time.sleep(0.05)
    try:
        # every due step a hand-over, each with its span (the floors apart are test_monitor_cadence's)
        # (a record a step: the span's step is its record's)
        h = _attach(tmp_path, monitor={"rescan_every": 5, "handover_min_s": 0.0, "record_min_s": 0})
        for _ in range(10):
            time.sleep(0.005)
            h.step()
        h.close()
    finally:
        stop.set()
        for t in threads:
            t.join()
    steps = [l for l in _lines(tmp_path) if l["type"] == "step"]
    pin = [s["roles"].get("pin_memory") for s in steps]
    assert all(p is not None and p["threads"] == 1 for p in pin)
    assert sum(p["cpu_ms"] or 0 for p in pin[1:]) > 0
    span = [s for s in steps if s["step"] in (5, 10)]
    assert all("other" in s["roles"] and s["roles"]["other"]["span_steps"] == 5 for s in span)
    assert all("other" not in s["roles"] for s in steps if s["step"] not in (5, 10))
    assert span[1]["roles"]["main"]["minflt"] is not None and span[1]["roles"]["pin_memory"]["nivcsw"] is not None


def test_close_restores_torch_distributed_and_a_second_attach_replaces_the_first(tmp_path):
    import torch.distributed as dist

    before = dist.all_reduce
    h1 = _attach(tmp_path / "a")
    assert dist.all_reduce is not before and dist.all_reduce.__wrapped__ is before
    h2 = _attach(tmp_path / "b")
    assert h1.closed and not h2.closed
    h2.close()
    assert dist.all_reduce is before
    h2.close()  # idempotent


def _each_step(lines: list[dict]) -> list[dict]:
    """Step lines a step each: a line of several (records/step.py) as its steps, each its own
    time, its end counted back from the line's by the times of the steps after it."""
    out = []
    for d in lines:
        each = d.get("each_ms", [d["step_ms"]])
        ends = [d["t"] - sum(each[i + 1:]) / 1e3 for i in range(len(each))]
        out += [{"step": s, "t": t, "step_ms": ms} for s, t, ms in zip(line_steps(d), ends, each)]
    return out


@pytest.mark.parametrize("record_min_s", [0.0, 0.1])  # a record a step; several steps a record (~5 ms steps)
def test_step_times_and_wall_stamps_follow_the_clocks(tmp_path, record_min_s):
    # Steps are stamped with perf_counter alone; their wall time is derived in the batch.
    h = _attach(tmp_path, monitor={"flush_every": 7, "rescan_every": 5, "record_min_s": record_min_s})
    # Each step() is bracketed by clock reads before and after it: its stamps must fall inside
    # the bracket (no absolute tolerance: a busy machine may preempt the test between reads).
    brackets = []  # (perf before, perf after, wall before, wall after)
    for i in range(23):
        time.sleep(0.004 + 0.002 * (i % 3))  # unequal steps
        wb, pb = time.time(), time.perf_counter()
        h.step()
        pa, wa = time.perf_counter(), time.time()
        brackets.append((pb, pa, wb, wa))
    h.close()
    lines = [l for l in _lines(tmp_path) if l["type"] == "step"]
    assert (len(lines) == 23) == (record_min_s == 0)
    steps = _each_step(lines)
    assert [s["step"] for s in steps] == list(range(1, 24))
    slack_s = 0.001  # the wall offset is sampled once per batch (two clock reads)
    for s, prev, cur in zip(steps[1:], brackets, brackets[1:]):
        assert cur[2] - slack_s <= s["t"] <= cur[3] + slack_s, (s["t"], cur)  # the step's end, on the wall clock
        shortest, longest = 1e3 * (cur[0] - prev[1]), 1e3 * (cur[1] - prev[0])
        assert shortest - 0.05 <= s["step_ms"] <= longest + 0.05, (s["step_ms"], shortest, longest)
    assert all(a["t"] < b["t"] for a, b in zip(steps, steps[1:]))
