"""The parts of a step (placement/records/parts.py) on constructed steps with known answers: disjoint,
adding up to the step, in the records' summary, the report's table and columns, and the trace."""
import json
import math

from placement.cli import main as cli
from placement.events import EventLog
from placement.records.parts import record_parts, split_step
from placement.records.step import RoleSample, StepRecord
from placement.records.summary import summarize

T = 1_800_000_000.0


def test_a_step_splits_into_data_comm_cpu_stall_and_compute():
    p = split_step(20.0, 3.0, 5.0, 2.0)
    assert (p.data_ms, p.comm_ms, p.cpu_stall_ms, p.compute_ms) == (3.0, 5.0, 2.0, 10.0)


def test_parts_never_add_to_more_than_the_step():
    # A runqueue wait read every k steps is a per-step mean: on a short step it can exceed what the
    # step had left after its data and comm waits; it is clamped there, compute is then 0.
    p = split_step(10.0, 4.0, 5.0, 3.0)
    assert (p.data_ms, p.comm_ms, p.cpu_stall_ms, p.compute_ms) == (4.0, 5.0, 1.0, 0.0)
    # a comm time longer than the step (a collective timed on another clock) is clamped too
    p = split_step(10.0, 2.0, 12.0, 1.0)
    assert (p.data_ms, p.comm_ms, p.cpu_stall_ms, p.compute_ms) == (2.0, 8.0, 0.0, 0.0)


def test_an_unread_cpu_stall_is_unknown_not_zero():
    p = split_step(10.0, 1.0, None, None)
    assert p.cpu_stall_ms is None and (p.data_ms, p.comm_ms, p.compute_ms) == (1.0, 0.0, 9.0)
    assert split_step(10.0, 1.0, 2.0, float("nan")).cpu_stall_ms is None


def _records():
    """Three steps of a rank whose main thread waited in the runqueue and whose NCCL threads did too."""
    out = []
    for step, (ms, data, comm, runq) in enumerate([(20.0, 2.0, 8.0, 4.0), (10.0, 1.0, 8.0, 4.0), (30.0, 0.0, 10.0, 0.0)], 1):
        out.append(StepRecord(0, step, T + step, ms, data, comm, 1,
                              {"main": RoleSample(1, ms - data - comm - runq, runq), "nccl": RoleSample(2, 1.0, 7.0)}))
    return out


def test_the_summary_line_is_the_parts_and_adds_to_100():
    s = summarize(0, _records())
    # data 3, comm 26, CPU stall 4 + 1 (clamped) + 0 = 5, compute 6 + 0 + 20 = 26, of 60 ms; the
    # NCCL threads' 7 ms a step of runqueue wait is inside comm, not added to CPU stall
    assert math.isclose(s.data_pct, 5.0) and math.isclose(s.comm_pct, 100 * 26 / 60)
    assert math.isclose(s.stall_pct, 100 * 5 / 60) and math.isclose(s.compute_pct, 100 * 26 / 60)
    assert math.isclose(s.data_pct + s.comm_pct + s.stall_pct + s.compute_pct, 100.0)
    assert [record_parts(r).cpu_stall_ms for r in _records()] == [4.0, 1.0, 0.0]


def test_the_report_table_and_trace_use_the_same_parts(tmp_path, capsys):
    ev = EventLog(str(tmp_path / "rank0.jsonl"), 0, "r")
    ev.write_lines([r.to_json() for r in _records()])
    ev.close()
    assert cli(["report", str(tmp_path), "--trace", str(tmp_path / "t.json"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    parts = doc["job"]["parts_pct"]
    assert math.isclose(parts["cpu_stall"], 100 * 5 / 60) and math.isclose(parts["compute"], 100 * 26 / 60)
    assert math.isclose(sum(parts.values()), 100.0)
    (rank,) = doc["ranks"]
    assert math.isclose(rank["stall_pct"], parts["cpu_stall"]) and math.isclose(rank["compute_pct"], parts["compute"])
    trace = json.loads((tmp_path / "t.json").read_text())
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    got = [(e["args"]["data_ms"], e["args"]["comm_ms"], e["args"]["cpu_stall_ms"], e["args"]["compute_ms"]) for e in steps]
    assert got == [(2.0, 8.0, 4.0, 6.0), (1.0, 8.0, 1.0, 0.0), (0.0, 10.0, 0.0, 20.0)]


_ODD = (None, 0.0, -1.0, 0.5, 3.0, 7.5, 12.0, math.nan, math.inf)


def test_split_and_verdict_hold_their_definitions_for_every_kind_of_figure():
    """split_step and step_verdict are written out for the monitor thread's speed: for every mix of
    missing, zero, negative, NaN, infinite and ordinary figures they are the plain definitions
    (parts: each clamped to what the earlier ones left; verdict: the largest share over its
    threshold, the later one on a tie, else balanced)."""
    from placement.records.verdict import StepVerdict, step_verdict

    def within(v, left):
        return 0.0 if v is None or v != v else min(max(v, 0.0), left)

    for step in (10.0, 0.0, -2.0, math.nan):
        for data in _ODD:
            for comm in _ODD:
                for stall in _ODD:
                    left = max(step, 0.0) if step == step else 0.0
                    d = within(data, left)
                    c = within(comm, left - d)
                    s = None if stall is None or stall != stall else within(stall, left - d - c)
                    want = (d, c, s, left - d - c - (s or 0.0))
                    assert tuple(split_step(step, data, comm, stall)) == want, (step, data, comm, stall)
                    for pcts in ((10.0, 30.0, 10.0), (0.0, 30.0, 5.0), (10.0, 0.0, 0.0)):
                        best, ratio = StepVerdict.BALANCED, 1.0
                        if not step <= 0:
                            for verdict, ms, pct in ((StepVerdict.CPU_BOUND, stall, pcts[0]),
                                                     (StepVerdict.COMM_BOUND, comm, pcts[1]),
                                                     (StepVerdict.DATA_BOUND, data, pcts[2])):
                                if ms is not None and pct > 0 and (100.0 * ms / step) / pct >= ratio:
                                    best, ratio = verdict, (100.0 * ms / step) / pct
                        got = step_verdict(step, data, comm, stall, *pcts)
                        assert got is best, (step, data, comm, stall, pcts, got)
