"""The one log reader of `placement report` (placement/report/logs.py): every file is read and
parsed once, the columns and the StepRecords follow one rule for corrupt lines and for runs,
and the StepRecords are kept for a few ranks only."""
import json

import placement.report.logs as logs
from placement.cli import main as cli
from placement.events import EventLog
from placement.records.step import RoleSample, StepRecord
from placement.records.summary import stall_ms
from placement.report.logs import RANK_TABLE_MAX, read_logs


def _rank_log(path, rank: int, runs: list[list[float]]):
    """One rank's log holding `runs` (each a list of step times, steps numbered from 1)."""
    ev = EventLog(str(path), rank)
    t = 1_800_000_000.0
    for run in runs:
        for step, ms in enumerate(run, 1):
            t += ms / 1e3
            ev.write_lines([StepRecord(rank, step, t, ms, 0.5, 2.0, 1,
                                       {"main": RoleSample(1, 5.0, 0.25 * rank), "nccl": RoleSample(2, 1.0, 0.5)},
                                       comm_enter_t=t - 0.003).to_json()])
    ev.close()


def test_report_reads_each_file_once(tmp_path, monkeypatch, capsys):
    for rank in range(3):
        _rank_log(tmp_path / f"rank{rank}.jsonl", rank, [[10.0] * 5])
    reads = []
    real = logs.read_bounded

    def counting(path, limit):
        reads.append(path)
        return real(path, limit)

    monkeypatch.setattr(logs, "read_bounded", counting)
    assert cli(["report", str(tmp_path)]) == 0
    assert "rank  steps" in capsys.readouterr().out  # the per-rank table, from the same reading
    assert sorted(reads) == sorted(str(tmp_path / f"rank{r}.jsonl") for r in range(3))


def test_columns_and_records_agree_on_runs_corrupt_lines_and_cpu_stall(tmp_path):
    _rank_log(tmp_path / "rank0.jsonl", 0, [[50.0] * 4, [10.0] * 3])  # a relaunch appended to the log
    _rank_log(tmp_path / "rank1.jsonl", 1, [[12.0] * 3])
    line = StepRecord(1, 4, 1_800_000_001.0, 12.0, roles={"main": RoleSample(1, 5.0, 1.0)}).to_json()
    bad = json.loads(line)
    bad["roles"]["main"]["runq_ms"] = "1.0"  # CPU stall of the wrong type: the whole line is corrupt
    with open(tmp_path / "rank1.jsonl", "a") as f:
        f.write(json.dumps(bad) + "\n")
    log = read_logs([str(tmp_path)])
    assert log.skipped == 1 and log.earlier_runs == {0: 1}
    assert len(log) == 6 and sorted(log.records) == [0, 1]
    for rank, sl in log.rank_slices().items():
        recs = log.records[rank]
        assert list(log.step[sl]) == [r.step for r in recs] == [1, 2, 3]
        assert list(log.step_ms[sl]) == [r.step_ms for r in recs]
        # CPU stall is main's runqueue wait (records/parts.py), not the NCCL threads' (inside comm)
        assert list(log.stall_ms[sl]) == [stall_ms(r) for r in recs] == [0.25 * rank] * 3
    assert set(log.step_ms[log.rank_slices()[0]]) == {10.0}  # the last run of rank 0


def test_records_are_kept_for_a_few_ranks_only(tmp_path):
    for rank in range(RANK_TABLE_MAX + 1):
        _rank_log(tmp_path / f"rank{rank}.jsonl", rank, [[10.0] * 2])
    many = read_logs([str(tmp_path)])
    assert many.records is None and len(many) == 2 * (RANK_TABLE_MAX + 1)
    few = read_logs([str(tmp_path / f"rank{r}.jsonl") for r in range(RANK_TABLE_MAX)])
    assert sorted(few.records) == list(range(RANK_TABLE_MAX))
    # One file more than ranks that stepped: a rank that wrote its start and died before step 1.
    (tmp_path / f"rank{RANK_TABLE_MAX}.jsonl").unlink()
    ev = EventLog(str(tmp_path / f"rank{RANK_TABLE_MAX}.jsonl"), RANK_TABLE_MAX)
    ev.event("start", source="monitor", host="h0")
    ev.close()
    late = read_logs([str(tmp_path)])
    assert len(late.files) == RANK_TABLE_MAX + 1 and sorted(late.records) == list(range(RANK_TABLE_MAX))
    assert len(late) == 2 * RANK_TABLE_MAX


def test_many_files_parsed_by_a_pool_read_as_one_by_one(tmp_path, monkeypatch):
    """Beyond RANK_TABLE_MAX files they are parsed by a pool of processes, one per CPU: the
    columns, events, runs, nodes and skipped lines are those a one-by-one reading gives."""
    ranks = RANK_TABLE_MAX + 8
    for rank in range(ranks):
        _rank_log(tmp_path / f"node{rank // 8}" / f"rank{rank}.jsonl", rank, [[10.0 + rank] * 3, [5.0] * 2])
        with open(tmp_path / f"node{rank // 8}" / f"rank{rank}.jsonl", "a") as f:
            f.write('{"type":"step","rank":' + str(rank) + ',"step":"x"}\n{"torn')
    pooled = read_logs([str(tmp_path)])
    monkeypatch.setattr(logs, "PARALLEL_FROM", 10 ** 9)
    serial = read_logs([str(tmp_path)])
    for name in ("rank", "step") + logs.FIGURES:
        a, b = getattr(pooled, name), getattr(serial, name)
        assert a.tolist() == b.tolist() or all(x == y or (x != x and y != y) for x, y in zip(a.tolist(), b.tolist())), name
    assert pooled.events == serial.events and pooled.node == serial.node and pooled.skipped == serial.skipped == 2 * ranks
    assert pooled.earlier_runs == serial.earlier_runs == {r: 1 for r in range(ranks)}
    assert [(r.id, r.records, sorted(r.ranks)) for r in pooled.runs] == [(r.id, r.records, sorted(r.ranks)) for r in serial.runs]
    assert len(pooled) == 2 * ranks


# ---- what the report reads is input: bounded, not followed, escaped -----------------------------
def _good_log(path, steps: int = 31):
    path.write_text("".join('{"type":"step","rank":0,"step":%d,"t":%d.0,"step_ms":10.0,"data_ms":0.0,"run":"r1"}\n'
                            % (s, 1700000000 + s) for s in range(1, steps + 1)))


def _report(*argv):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "placement.cli", "report", *argv], capture_output=True, text=True,
                          timeout=120)


def test_a_gzip_bomb_beside_a_real_log_is_skipped_with_one_line_within_bounds(tmp_path):
    """A 64 MiB run of short lines compressed to ~65 KB (a bomb, ~1000x) beside a real log: the
    report stops inflating it at 64x its size (never the 1 GiB per-file cap), says one line and
    reports the real log; its peak memory stays far under the bomb's size."""
    import gzip
    import subprocess
    import sys

    _good_log(tmp_path / "rank0.jsonl")
    (tmp_path / "rank1.0001.jsonl.gz").write_bytes(gzip.compress(b"{}\n" * ((64 << 20) // 3), 9))
    # VmHWM, not ru_maxrss: Linux keeps a process's maxrss across exec, so a child of a big
    # pytest reports its parent's peak; VmHWM is this program's own memory's.
    script = ("import sys; from placement.cli import main; rc = main(['report', sys.argv[1]]); "
              "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]; "
              "print('peak_kb', hwm.split()[1], file=sys.stderr); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "31 step records" in p.stdout
    assert sum("skipped file" in line and "rank1.0001.jsonl.gz" in line for line in p.stdout.splitlines()) == 1
    peak_kb = int(p.stderr.split("peak_kb")[1].split()[0])
    assert peak_kb < 200 * 1024, peak_kb  # inflated to 64x its size at most, never its 64 MiB as line objects


def test_a_link_loop_is_not_followed_and_each_file_read_once(tmp_path):
    _good_log(tmp_path / "rank0.jsonl")
    (tmp_path / "loop").symlink_to(tmp_path)
    (tmp_path / "again.jsonl").symlink_to(tmp_path / "rank0.jsonl")
    p = _report(str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "31 step records" in p.stdout and "1 file(s)" in p.stdout, p.stdout
    assert "skipped 2 link(s)" in p.stdout


def test_an_unreadable_file_is_skipped_and_the_rest_reported(tmp_path):
    _good_log(tmp_path / "rank0.jsonl")
    (tmp_path / "rank1.0001.jsonl.gz").write_bytes(b"not gzip at all")
    p = _report(str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "31 step records" in p.stdout and "skipped file" in p.stdout and "not a gzip file" in p.stdout


def test_a_logs_escape_codes_never_reach_the_terminal(tmp_path):
    _good_log(tmp_path / "rank0.jsonl")
    with open(tmp_path / "rank0.jsonl", "a") as f:
        f.write('{"type":"warning","rank":0,"t":1700000040.0,"message":"\\u001b[2J\\u001b]0;owned\\u0007 cleared","run":"r1"}\n')
    p = _report(str(tmp_path / "rank0.jsonl"))
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\x07" not in p.stdout
    assert "\\x1b[2J" in p.stdout and "cleared" in p.stdout


def test_hostile_field_types_are_read_as_unknown_never_a_traceback(tmp_path):
    """Events whose fields have the wrong type (a log is input): the report reads them as
    unknown and goes on."""
    _good_log(tmp_path / "rank0.jsonl")
    hostile = [
        '{"type":"straggler","rank":0,"t":1700000010.0,"steps":7,"stragglers":[{"kind":"cpu-slow","ranks":[1],'
        '"cost_by_cause":[1,2],"cost_pct":"much","lateness_ms":"late"}],"run":"r1"}',
        '{"type":"straggler","rank":0,"t":1700000011.0,"steps":[1,"x"],"stragglers":[],"job_wide":[3],"run":"r1"}',
        '{"type":"stall","rank":1,"t":1700000012.0,"phase":"stalled","reported_by":0,"main":{"stack":5,"state":[1]},'
        '"in_collective":"yes","run":"r1"}',
        '{"type":"memory","rank":0,"t":1700000013.0,"planned":5,"applied":"x","resident":7,"run":"r1"}',
        '{"type":"end","rank":0,"t":1700000014.0,"source":"monitor","steps":{},"monitor_us_per_step":[],'
        '"placement_cpu_us_per_step":"x","run":"r1"}',
    ]
    with open(tmp_path / "rank0.jsonl", "a") as f:
        f.write("\n".join(hostile) + "\n")
    for argv in ([str(tmp_path)], [str(tmp_path), "--json"]):
        p = _report(*argv)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        assert "31 step records" in p.stdout or '"steps"' in p.stdout


def test_a_log_from_before_comm_wait_reads_and_its_comm_is_said_to_be_in_flight(tmp_path, capsys):
    """A step line without comm_inflight_ms was written when comm_ms was the collectives' time in
    flight: it reads as before, and the report says once what its comm is; a newer log's does not."""
    from placement.report.text import IN_FLIGHT_LINE

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    _rank_log(new / "rank0.jsonl", 0, [[10.0] * 5])
    lines = []
    for line in (new / "rank0.jsonl").read_text().splitlines():
        d = json.loads(line)
        if d["type"] == "step":
            assert "comm_inflight_ms" in d
            del d["comm_inflight_ms"]
        lines.append(json.dumps(d))
    (old / "rank0.jsonl").write_text("\n".join(lines) + "\n")
    said = IN_FLIGHT_LINE.split("{n}")[0]
    assert cli(["report", str(old)]) == 0
    out = capsys.readouterr().out
    assert "rank  steps" in out and out.count(said) == 1 and IN_FLIGHT_LINE.format(n=5) in out
    assert read_logs([str(old)]).comm_in_flight == 5
    assert cli(["report", str(new)]) == 0
    assert said not in capsys.readouterr().out
