"""The rank's JSONL stream: lines land once, even when a child is forked with lines unflushed."""
import json
import subprocess
import sys
import textwrap

from placement.events import EventLog


def test_events_and_batches_round_trip(tmp_path):
    path = tmp_path / "logs" / "rank3.jsonl"
    ev = EventLog(str(path), rank=3)
    ev.event("bind", tid=1, planned=frozenset({2, 0}))
    ev.write_lines(['{"type":"step","step":1}', '{"type":"step","step":2}'])
    ev.close()
    recs = [json.loads(l) for l in path.read_text().splitlines()]
    assert [r["type"] for r in recs] == ["bind", "step", "step"]
    assert recs[0]["rank"] == 3 and recs[0]["planned"] == [0, 2]
    ev.event("warning", msg="after close")  # dropped quietly, never raised


def test_forked_child_does_not_write_the_ranks_lines_again(tmp_path):
    path = tmp_path / "rank0.jsonl"
    script = textwrap.dedent(f"""
        import os, sys
        from placement.events import EventLog
        ev = EventLog({str(path)!r}, rank=0)
        for i in range(3):
            ev.event("warning", i=i)          # buffered, not yet flushed
        pid = os.fork()
        if pid == 0:
            sys.exit(0)                       # normal shutdown: io buffers would be flushed
        os.waitpid(pid, 0)
        ev.close()
    """)
    subprocess.run([sys.executable, "-c", script], check=True)
    lines = path.read_text().splitlines()
    assert [json.loads(l)["i"] for l in lines] == [0, 1, 2]


def test_a_log_past_its_size_is_rotated_compressed_and_read_whole(tmp_path, capsys):
    """monitor.log_rotate_mb: the file so far becomes rank0.0001.jsonl, compressed aside to
    .jsonl.gz by a thread of its own, writing goes on in rank0.jsonl; `placement report` reads
    every record once, in step order, whatever stage the compression is at."""
    import gzip
    import time

    from placement.events import compress_rotated
    from placement.records.step import StepRecord
    from placement.report.logs import read_logs

    ev = EventLog(str(tmp_path / "rank0.jsonl"), 0, "r1", rotate_bytes=20_000)
    for step in range(1, 401):
        ev.write_lines([StepRecord(0, step, 1_800_000_000.0 + step, 10.0, run="r1").to_json()])
        if step % 20 == 0:
            ev.flush()
    ev.close()
    deadline = time.monotonic() + 30
    while list(tmp_path.glob("*.jsonl.gz.tmp")) or len(list(tmp_path.glob("rank0.*.jsonl.gz"))) < 2:
        assert time.monotonic() < deadline, sorted(p.name for p in tmp_path.iterdir())
        time.sleep(0.01)
    while list(tmp_path.glob("rank0.0*.jsonl")):  # the original goes once its .gz is whole
        assert time.monotonic() < deadline, sorted(p.name for p in tmp_path.iterdir())
        time.sleep(0.01)
    rotated = sorted(tmp_path.glob("rank0.*.jsonl.gz"))
    assert [p.name for p in rotated][:2] == ["rank0.0001.jsonl.gz", "rank0.0002.jsonl.gz"]
    plain = sum(len(gzip.decompress(p.read_bytes())) for p in rotated)
    assert plain >= 20_000 * len(rotated) and sum(p.stat().st_size for p in rotated) < plain / 4  # compressed
    log = read_logs([str(tmp_path)])
    assert list(log.step) == list(range(1, 401)) and log.skipped == 0 and not log.earlier_runs
    # While a rotated file is being compressed both may be listed: it is read once.
    first = gzip.decompress(rotated[0].read_bytes())
    (tmp_path / "rank0.0001.jsonl").write_bytes(first)
    assert list(read_logs([str(tmp_path)]).step) == list(range(1, 401))
    assert compress_rotated(str(tmp_path / "rank0.0001.jsonl"), 0) == str(rotated[0])
    assert not (tmp_path / "rank0.0001.jsonl").exists()
