"""A record of several steps (records/step.py): its line reads back, a line that lies about its
steps is refused, and every reader (the run summary, the digest, the exchange's figures, the
tuner's window, the report's columns) gives what it gives for the same steps a record each."""
import json
import math

import pytest

from placement.monitor.stragglers.figures import figures_from_records
from placement.records.digest import StepDigest
from placement.records.step import RoleSample, StepRecord, line_steps, record_steps, step_times, valid_step
from placement.records.summary import summarize
from placement.report.logs import read_logs
from placement.roles import ThreadRole
from placement.tune.window import summarize as window

EACH = (4.0, 6.0, 5.0, 9.0, 6.0, 5.0, 4.0, 5.0)  # each step's time, ms


def _roles(cpu: float, runq: float) -> dict:
    return {ThreadRole.MAIN: RoleSample(threads=1, cpu_ms=cpu, runq_ms=runq, cpus=[2])}


def _singles() -> list[StepRecord]:
    """Steps 1-8, a record each: data 10% and comm 20% of each step, main's CPU and runqueue
    wait as shares of it too, so that a group's per-step means are the same shares."""
    return [StepRecord(0, s, 100.0 + s, ms, 0.1 * ms, 0.2 * ms, 1, _roles(0.5 * ms, 0.05 * ms), comm_enter_t=99.0 + s,
                       placement_cpu_ms=0.01) for s, ms in enumerate(EACH, start=1)]


def _groups(n: int) -> list[StepRecord]:
    """The same steps, n a record, as monitor/build.py makes them: per-step means, each kept."""
    out = []
    for first in range(1, len(EACH) + 1, n):
        each = EACH[first - 1:first - 1 + n]
        ms = sum(each) / len(each)
        out.append(StepRecord(0, first + len(each) - 1, 100.0 + first + len(each) - 1, ms, 0.1 * ms, 0.2 * ms,
                              len(each), _roles(0.5 * ms, 0.05 * ms), comm_enter_t=99.0 + first + len(each) - 1,
                              placement_cpu_ms=0.01, steps=len(each), each_ms=each if len(each) > 1 else None))
    return out


def test_a_record_of_several_steps_reads_back_as_it_was_written():
    for rec in _groups(4):
        d = json.loads(rec.to_json())
        assert valid_step(d) and d["steps"] == 4 and d["each_ms"] == list(rec.each_ms)
        back = StepRecord.from_dict(d)
        assert back == rec and list(record_steps(back)) == list(line_steps(d)) == list(range(rec.step - 3, rec.step + 1))
        assert step_times(back) == rec.each_ms


@pytest.mark.parametrize("bad", [{"steps": 0}, {"steps": True}, {"steps": 3}, {"steps": 10**6},
                                 {"each_ms": [1.0, 2.0, 3.0]}, {"each_ms": [1.0, 2.0, "3", 4.0]}, {"each_ms": None},
                                 {"each_ms": [1.0, 2.0, 3.0, 1e400]}])
def test_a_line_whose_steps_and_times_disagree_is_refused(bad):
    d = json.loads(_groups(4)[0].to_json())
    assert valid_step(d)
    d.update(bad)
    assert not valid_step(d)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_every_reader_gives_for_a_record_of_several_steps_what_it_gives_for_them_one_by_one(n, tmp_path):
    singles, groups = _singles(), _groups(n)
    a, b = summarize(0, singles), summarize(0, groups)
    assert (a.steps, a.first_step, a.last_step, a.p50_ms, a.p99_ms) == (b.steps, b.first_step, b.last_step, b.p50_ms,
                                                                         b.p99_ms)
    for name in ("stall_pct", "comm_pct", "data_pct", "compute_pct"):
        assert getattr(a, name) == pytest.approx(getattr(b, name)), name
    assert sum(a.verdicts.values()) == sum(b.verdicts.values()) == len(EACH)

    da, db = StepDigest(0), StepDigest(0)
    for r in singles:
        da.add(r)
    for r in groups:
        db.add(r)
    assert (da.first_step, da.last_step, da.steps, da.hist) == (db.first_step, db.last_step, db.steps, db.hist)
    assert da.step_ms == pytest.approx(db.step_ms) and da.comm_ms == pytest.approx(db.comm_ms)
    assert da.stall_ms == pytest.approx(db.stall_ms)

    fa, fb = figures_from_records(0, singles, 1, 8), figures_from_records(0, groups, 1, 8)
    assert fa.steps == fb.steps == len(EACH) and len(fb.comm_steps) == len(EACH)
    # as built, a record keeps each step's comm wait: the exchange's steps are each step's own
    for g in groups:
        g.each_comm_ms = tuple(0.2 * ms for ms in step_times(g)) if g.steps > 1 else None
    assert figures_from_records(0, groups, 1, 8).comm_steps == pytest.approx(fa.comm_steps)
    for name in ("step_ms", "data_ms", "comm_ms", "cpu_stall_ms", "main_cpu_ms", "placement_cpu_ms"):
        assert getattr(fa, name) == pytest.approx(getattr(fb, name)), name

    wa, wb = window(singles), window(groups)
    assert wa.step_ms == wb.step_ms and (wa.first_step, wa.last_step) == (wb.first_step, wb.last_step)
    assert wa.spikes() == wb.spikes() and wa.median_ms == wb.median_ms
    assert wa.data_share_pct == pytest.approx(wb.data_share_pct) and wa.comm_share_pct == pytest.approx(wb.comm_share_pct)
    main_a, main_b = wa.role(ThreadRole.MAIN), wb.role(ThreadRole.MAIN)
    assert main_a.cpu_share_pct == pytest.approx(main_b.cpu_share_pct)
    assert main_a.runq_share_pct == pytest.approx(main_b.runq_share_pct)

    (tmp_path / "rank0.jsonl").write_text("".join(r.to_json() + "\n" for r in groups))
    log = read_logs([str(tmp_path / "rank0.jsonl")])
    assert list(log.step) == list(range(1, len(EACH) + 1)) and list(log.step_ms) == list(EACH)
    # each row's end counted back from its line's, by the times of the steps after it
    ends = [r.t - sum(r.each_ms[i + 1:] if r.each_ms else ()) / 1e3 for r in groups for i in range(r.steps)]
    assert list(log.t) == pytest.approx(ends)
    assert list(log.comm_ms) == pytest.approx([0.2 * r.step_ms for r in groups for _ in range(r.steps)])
    # a row's first-collective entry is its line's last step's alone
    assert [not math.isnan(v) for v in log.enter_t] == [s % n == 0 for s in range(1, len(EACH) + 1)]


@pytest.mark.parametrize("n", [1, 4, 8])
@pytest.mark.parametrize("each_comm", [True, False])
def test_a_window_one_record_holds_exactly_is_read_off_it_as_the_steps_one_by_one_would_give(n, each_comm):
    """figures_from_records reads a window that one record holds, no more and no less (every
    window at short steps), off the record itself: the same figures as the pass over records
    (here forced by a record of the next window beside it, which that pass leaves out)."""
    groups = _groups(n)
    for g in groups:
        g.each_comm_ms = tuple(0.2 * ms for ms in step_times(g)) if each_comm and g.steps > 1 else None
    g, after = groups[0], StepRecord(0, groups[0].step + 1, 200.0, 1.0, 0.1, 0.2, 1, _roles(0.5, 0.05))
    first, last = g.step - g.steps + 1, g.step
    fast, walked = figures_from_records(0, [g], first, last), figures_from_records(0, [g, after], first, last)
    assert (fast.rank, fast.steps, fast.first_step, fast.last_step) == (walked.rank, walked.steps, first, last)
    assert fast.steps == n and fast.comm_steps == pytest.approx(walked.comm_steps) and len(fast.comm_steps) == n
    for name in ("step_ms", "data_ms", "comm_ms", "cpu_stall_ms", "nccl_runq_ms", "main_cpu_ms", "main_mhz",
                 "placement_cpu_ms"):
        assert getattr(fast, name) == pytest.approx(getattr(walked, name)), name
    # a window the record does not hold exactly goes the long way (a record counts whole where its last step is)
    assert figures_from_records(0, [g], first + 1, last).steps == (0 if n == 1 else n)
