"""Digests (placement/records/digest.py): a rank's steps summed per monitor.digest_every steps,
written by the monitor, merged exactly, and what `placement report` reads of a long job
(--read digests / auto) with the same figures the step lines give."""
import json
import time
import math
import random

import pytest
import torch

import placement
from placement.cli import main as cli
from placement.events import EventLog
from placement.records.digest import StepDigest
from placement.records.step import RoleSample, StepRecord
from placement.monitor.sinks.base import DigestSink
from placement.records.summary import summarize
from placement.report import logs as logs_mod
from placement.report.logs import ReadMode, expand, read_logs
from placement.roles import ThreadRole

T = 1_800_000_000.0


def _records(rank: int, n: int, seed: int) -> list[StepRecord]:
    """Steps of known, varied shape: a long tail, comm unmeasured on some, runq unread on others."""
    rng = random.Random(seed)
    out, t = [], T
    for step in range(1, n + 1):
        step_ms = 10.0 + rng.expovariate(0.5) + (40.0 if step % 97 == 0 else 0.0)
        t += step_ms / 1e3
        runq = None if step % 7 == 0 else rng.uniform(0.0, 3.0)
        out.append(StepRecord(rank=rank, step=step, t=t, step_ms=step_ms, data_ms=rng.uniform(0.0, 2.0),
                              comm_ms=None if step % 5 == 0 else rng.uniform(1.0, 6.0), comm_count=1,
                              roles={ThreadRole.MAIN: RoleSample(threads=1, cpu_ms=1.0, runq_ms=runq, cpus=[0])},
                              verdict=rng.choice(("comm-bound", "cpu-bound")), local_rank=rank, run="r1"))
    return out


def _close(a, b, rel):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


def test_digests_merge_to_the_figures_of_every_step():
    recs = _records(0, 2500, seed=1)
    parts = [StepDigest(0), StepDigest(0), StepDigest(0)]
    for i, r in enumerate(recs):  # three digests of uneven length, merged out of order
        parts[0 if i < 1000 else 1 if i < 1900 else 2].add(r)
    merged = StepDigest(0)
    for d in (parts[2], parts[0], parts[1]):
        merged.merge(StepDigest.from_dict({"type": "digest", **json.loads(json.dumps(d.fields()))}))
    want, got = summarize(0, recs), merged.summary()
    assert (got.steps, got.first_step, got.last_step) == (2500, 1, 2500)
    assert got.verdicts == want.verdicts
    for name in ("data_pct", "comm_pct", "stall_pct", "compute_pct"):
        assert _close(getattr(got, name), getattr(want, name), 1e-6), name
    assert _close(got.p50_ms, want.p50_ms, 0.01) and _close(got.p99_ms, want.p99_ms, 0.01)
    assert _close(got.data_pct + got.comm_pct + got.stall_pct + got.compute_pct, 100.0, 1e-9)


def test_a_digest_line_of_the_wrong_shape_is_refused():
    good = StepDigest(0)
    for r in _records(0, 10, seed=2):
        good.add(r)
    fields = {"type": "digest", **good.fields()}
    assert StepDigest.from_dict(fields) is not None
    for bad in ({"n": 11}, {"hist": {"x": 1}}, {"steps": [1]}, {"rank": "0"}, {"n": 0}):
        assert StepDigest.from_dict({**fields, **bad}) is None, bad


def _write_rank(path, rank: int, recs: list[StepRecord], every: int) -> None:
    """As the monitor writes: step lines batch by batch, a digest every `every` steps, the rest at close."""
    ev = EventLog(str(path), rank, "r1")
    sink = DigestSink(ev, rank, every)
    for i in range(0, len(recs), 20):
        batch = recs[i:i + 20]
        ev.write_lines([r.to_json() for r in batch])
        sink.write(batch)
    sink.close()
    ev.close()


def test_the_report_by_digests_says_what_the_step_lines_say(tmp_path, capsys):
    for rank in range(3):
        _write_rank(tmp_path / f"rank{rank}.jsonl", rank, _records(rank, 1234, seed=10 + rank), every=500)
    lines = (tmp_path / "rank1.jsonl").read_text().splitlines()
    digests = [json.loads(l) for l in lines if '"type":"digest"' in l]
    assert [d["steps"] for d in digests] == [[1, 500], [501, 1000], [1001, 1234]]  # the last one at close

    steps, by_digest = read_logs([str(tmp_path)]), read_logs([str(tmp_path)], read=ReadMode.DIGESTS)
    assert not steps.from_digests and by_digest.from_digests and len(by_digest) == 0
    # Read by each log's event index (rank<R>.events: its lines but the step lines), not the log.
    assert by_digest.indexed == 3 and by_digest.step_lines == 0
    assert by_digest.step_count() == steps.step_count() == 3 * 1234
    events = {r: [l for l in (tmp_path / f"rank{r}.jsonl").read_text().splitlines() if '"type":"step"' not in l]
              for r in range(3)}
    assert all((tmp_path / f"rank{r}.events").read_text().splitlines() == events[r] for r in range(3))
    # A log without its index (written before indexes, or the index lost): the log's own lines, counted.
    for r in range(3):
        (tmp_path / f"rank{r}.events").unlink()
    old = read_logs([str(tmp_path)], read=ReadMode.DIGESTS)
    assert old.indexed == 0 and old.step_lines == old.step_count() == 3 * 1234
    assert {r: d.fields() for r, d in old.digests.items()} == {r: d.fields() for r, d in by_digest.digests.items()}
    assert by_digest.ranks() == steps.ranks() == [0, 1, 2] and by_digest.run.records == 3 * 1234
    assert cli(["report", str(tmp_path), "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    assert cli(["report", str(tmp_path), "--json", "--read", "digests"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["job"]["read_by_digests"] and not want["job"]["read_by_digests"]
    assert got["job"]["step_records"] == want["job"]["step_records"]
    for part, pct in want["job"]["parts_pct"].items():
        assert _close(got["job"]["parts_pct"][part], pct, 1e-6), part
    assert _close(got["job"]["median_step_ms"], want["job"]["median_step_ms"], 0.01)
    for g, w in zip(got["ranks"], want["ranks"], strict=True):
        assert g["rank"] == w["rank"] and g["steps"] == w["steps"] and g["verdicts"] == w["verdicts"]
        assert _close(g["p99_ms"], w["p99_ms"], 0.01) and _close(g["stall_pct"], w["stall_pct"], 1e-6)
    assert cli(["report", str(tmp_path), "--read", "digests"]) == 0
    text = capsys.readouterr().out
    assert "read by digests" in text and f"{3 * 1234} steps of the {3 * 1234} step lines" in text


def test_auto_reads_digests_only_past_the_size_and_pictures_need_the_steps(tmp_path, capsys, monkeypatch):
    _write_rank(tmp_path / "rank0.jsonl", 0, _records(0, 300, seed=3), every=100)
    assert not read_logs([str(tmp_path)], read=ReadMode.AUTO).from_digests  # small: every line
    monkeypatch.setattr(logs_mod, "DIGESTS_FROM", 100)  # as if the logs were long
    assert read_logs([str(tmp_path)], read=ReadMode.AUTO).from_digests
    assert cli(["report", str(tmp_path), "--heatmap", str(tmp_path / "h.png")]) == 0  # pictures: every step read
    assert (tmp_path / "h.png").stat().st_size > 0
    capsys.readouterr()
    assert cli(["report", str(tmp_path), "--read", "digests", "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--plot" in err[0] and "--read steps" in err[0]
    with pytest.raises(SystemExit) as e:  # argparse's own exit, one line (placement/cli.py)
        cli(["report", str(tmp_path), "--read", "everything"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "everything" in err and "digests" in err and len(err.splitlines()) == 1


def test_auto_without_digests_parses_every_line_and_says_so(tmp_path, capsys, monkeypatch):
    _write_rank(tmp_path / "rank0.jsonl", 0, _records(0, 300, seed=4), every=0)  # monitor.digest_every=0
    monkeypatch.setattr(logs_mod, "DIGESTS_FROM", 100)
    assert cli(["report", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "no digests" in out.err and "300 step records" in out.out


def test_the_monitor_writes_digests_of_its_steps(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    h = placement.attach(model, opt, policy="none", tune={"enabled": False},
                         monitor={"log_dir": str(tmp_path), "summary_every": 0, "digest_every": 25})
    x = torch.randn(4, 8)
    for _ in range(60):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    h.close()
    lines = [json.loads(l) for l in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    steps = [l for l in lines if l["type"] == "step"]
    digests = [l for l in lines if l["type"] == "digest"]
    # a digest once 25 steps are in (at a record's end: a record may hold several steps), the
    # rest at close: together every step once, in order
    spans = [d["steps"] for d in digests]
    assert spans[0][0] == 1 and spans[-1][1] == 60 and all(a[1] + 1 == b[0] for a, b in zip(spans, spans[1:]))
    assert all(last - first + 1 >= 25 for first, last in spans[:-1]) and sum(d["n"] for d in digests) == 60
    assert all(d["run"] == steps[0]["run"] and d["rank"] == 0 for d in digests)
    # each digest's sum is written to the microsecond (digest.fields): at most 0.0005 ms off apiece
    assert math.isclose(sum(d["step_ms"] for d in digests), sum(sum(s.get("each_ms", [s["step_ms"]])) for s in steps),
                        rel_tol=0.0, abs_tol=0.0005 * len(digests) + 1e-9)


@pytest.mark.parametrize("value", ["-1", "abc"])
def test_a_bad_digest_every_is_one_line(value, capsys):
    from placement.config import load_config
    from placement.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config([f"placement.monitor.digest_every={value}"])
    assert "digest_every" in str(e.value) and "\n" not in str(e.value)


def test_a_rotated_log_is_read_by_digests_from_its_event_index_alone(tmp_path):
    """The index is never rotated: it holds the events of every piece, so the rotated pieces (some
    compressed) are left unread, and a glob of the logs never takes the index for a log."""
    recs = _records(0, 3000, seed=3)
    ev = EventLog(str(tmp_path / "rank0.jsonl"), 0, "r1", rotate_bytes=200_000)
    sink = DigestSink(ev, 0, 500)
    for i in range(0, len(recs), 20):
        ev.write_lines([r.to_json() for r in recs[i:i + 20]])
        sink.write(recs[i:i + 20])
        ev.flush()
    sink.close()
    ev.close()
    deadline = time.monotonic() + 60  # the rotated pieces are compressed on threads of their own
    while (list(tmp_path.glob("rank0.0*.jsonl")) or list(tmp_path.glob("*.tmp"))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob("rank0.0*.jsonl.gz")), "the log rotated"
    by_digest = read_logs([str(tmp_path)], read=ReadMode.DIGESTS)
    assert by_digest.indexed == 1 and by_digest.step_count() == 3000
    assert read_logs([str(tmp_path)]).step_count() == 3000  # every piece, step by step
    assert not [p for p in expand([str(tmp_path)]) if p.endswith(".events")]
