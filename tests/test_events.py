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
