"""The rank's JSONL stream: lines land once, even when a child is forked with lines unflushed."""
import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from placement.events import EventLog, open_rank_log


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
        from placement.events import EventLog, open_rank_log
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
    piece = str(tmp_path / "rank0.0001.jsonl")
    assert compress_rotated(os.open(piece, os.O_RDONLY), piece, 0) == str(rotated[0])
    assert not (tmp_path / "rank0.0001.jsonl").exists()


# ---- one writer per file; nothing followed, nothing another user can redirect ------------------
def _steps(path) -> dict:
    """run id -> the step numbers of its step lines, over a log dir's files (rotated ones too)."""
    import gzip
    out: dict = {}
    for f in sorted(path.iterdir()):
        if f.name.endswith(".jsonl.gz"):
            text = gzip.decompress(f.read_bytes()).decode()
        elif f.name.endswith(".jsonl"):
            text = f.read_text()
        else:
            continue
        for line in text.splitlines():
            rec = json.loads(line)
            if rec.get("type") == "step":
                out.setdefault(rec["run"], []).append(rec["step"])
    return out


def _wait_compressed(path, timeout_s: float = 30.0) -> None:
    import time
    deadline = time.monotonic() + timeout_s
    while list(path.glob("*.gz.tmp")) or list(path.glob("rank*.0*.jsonl")):
        assert time.monotonic() < deadline, sorted(p.name for p in path.iterdir())
        time.sleep(0.01)


def test_two_jobs_in_one_directory_each_keep_every_record_with_rotation(tmp_path, capfd):
    """Two writers of rank 0's log in one directory (two jobs started from one working directory):
    the second finds the first's lock and writes rank0-2.jsonl, said once; each rotates only its
    own file; every step of both runs is in the directory once."""
    a = open_rank_log(str(tmp_path), 0, "run-a", rotate_mb=0.01)
    b = open_rank_log(str(tmp_path), 0, "run-b", rotate_mb=0.01)
    assert a.path == str(tmp_path / "rank0.jsonl") and b.path == str(tmp_path / "rank0-2.jsonl")
    err = capfd.readouterr().err
    assert err.count("being written by another job") == 1 and "rank0-2.jsonl" in err
    for step in range(1, 601):
        for ev, run in ((a, "run-a"), (b, "run-b")):
            ev.write_lines([json.dumps({"type": "step", "step": step, "run": run, "pad": "x" * 40})])
        if step % 20 == 0:
            a.flush()
            b.flush()
    a.close()
    b.close()
    _wait_compressed(tmp_path)
    got = _steps(tmp_path)
    assert sorted(got["run-a"]) == list(range(1, 601)) and sorted(got["run-b"]) == list(range(1, 601))
    assert len(list(tmp_path.glob("rank0.0*.jsonl.gz"))) >= 2 and len(list(tmp_path.glob("rank0-2.0*.jsonl.gz"))) >= 2
    assert stat.S_IMODE(os.stat(tmp_path / "rank0.jsonl").st_mode) == 0o600


def test_a_planted_log_link_is_never_written_through(tmp_path, capfd):
    """rank0.jsonl planted as a link to another user's file: refused with one line, the rank runs
    on without a log, the victim untouched."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.jsonl").symlink_to(victim)
    ev = open_rank_log(str(logs), 0, "r")
    ev.event("warning", message="x" * 100)
    ev.close()
    assert victim.read_text() == "precious\n"
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "symbolic link" in err[0] and "runs on without it" in err[0], err


def test_a_world_writable_log_dir_is_refused(tmp_path, capfd):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    ev = open_rank_log(str(shared), 0, "r")
    ev.event("warning", message="x")
    ev.close()
    assert list(shared.iterdir()) == []
    err = capfd.readouterr().err
    assert "writable by every user" in err and "runs on without it" in err


def test_rotation_and_compression_follow_no_planted_link(tmp_path):
    """A `.gz.tmp` planted as a link (the next rotation number is predictable): its target is never
    overwritten; a rotated piece swapped for a link to a 0600 file: no copy of that file is made
    (the compression reads the descriptor the writer held), the link is not removed."""
    secret = tmp_path / "secret"
    secret.write_text("secret\n")
    os.chmod(secret, 0o600)
    target = tmp_path / "target"
    target.write_text("keep\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.0001.jsonl.gz.tmp").symlink_to(target)
    ev = EventLog(str(logs / "rank0.jsonl"), 0, "r1", rotate_bytes=5_000)
    for step in range(1, 200):
        ev.write_lines([json.dumps({"type": "step", "step": step, "run": "r1", "pad": "y" * 40})])
        if step % 20 == 0:
            ev.flush()
    ev.close()
    import time
    deadline = time.monotonic() + 30
    while not list(logs.glob("rank0.0002.jsonl.gz")):
        assert time.monotonic() < deadline, sorted(p.name for p in logs.iterdir())
        time.sleep(0.01)
    assert target.read_text() == "keep\n"
    assert (logs / "rank0.0001.jsonl").exists()  # its compression refused: the piece stays, uncompressed
    # a piece swapped for a link before its compression: what is compressed is the writer's file
    from placement.events import compress_rotated
    piece = logs / "rank0.0009.jsonl"
    piece.write_text('{"type":"step","step":1}\n')
    fd = os.open(piece, os.O_RDONLY)
    piece.unlink()
    piece.symlink_to(secret)
    done = compress_rotated(fd, str(piece), 0)
    import gzip
    assert gzip.decompress((logs / "rank0.0009.jsonl.gz").read_bytes()) == b'{"type":"step","step":1}\n'
    assert done and piece.is_symlink() and secret.read_text() == "secret\n"
    assert stat.S_IMODE(os.stat(done).st_mode) == 0o600


def test_a_shared_place_is_used_only_when_it_is_ours_alone(tmp_path):
    """private_dir (the Ray CPU shares' directory in /dev/shm, the flight recorder's socket
    directory in /tmp): created 0700, taken when lstat shows our own 0700 directory, refused when
    it is a link, another user's, or open to others."""
    from placement.events import UnsafePlace, private_dir

    fresh = tmp_path / "fresh"
    assert private_dir(str(fresh)) == str(fresh)
    assert stat.S_IMODE(os.lstat(fresh).st_mode) == 0o700
    assert private_dir(str(fresh)) == str(fresh)  # found as made: taken
    open_ = tmp_path / "open"
    open_.mkdir()
    os.chmod(open_, 0o755)
    link = tmp_path / "link"
    link.symlink_to(fresh)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 4242, 4242)
    for bad, why in ((open_, "open to other users"), (link, "not a directory of ours"), (foreign, "uid 4242")):
        with pytest.raises(UnsafePlace, match=why):
            private_dir(str(bad))


def test_ray_shares_refuse_a_directory_another_user_made(tmp_path, capfd):
    from placement.events import UnsafePlace
    from placement.integrations.ray import SharedCpus

    shares = SharedCpus(2, root=str(tmp_path))
    os.mkdir(shares.dir, 0o700)
    os.chown(shares.dir, 4242, 4242)  # planted by uid 4242 before any worker of ours ran
    with pytest.raises(UnsafePlace, match="uid 4242"):
        shares.claim()
    ours = SharedCpus(2, root=str(tmp_path / "ok"))
    os.mkdir(tmp_path / "ok")
    os.mkdir(ours.dir, 0o700)
    (tmp_path / "victim").write_text("x")
    os.symlink(tmp_path / "victim", os.path.join(ours.dir, "cpu-2-0.lock"))
    with pytest.raises(UnsafePlace, match="symbolic link"):
        ours.claim()
    assert (tmp_path / "victim").read_text() == "x"


def test_close_counts_the_lines_it_could_not_write(tmp_path, monkeypatch, capfd):
    """close() gives up on a lock another thread holds past CLOSE_WAIT_S: the lines still buffered
    are counted as lost and said, not dropped in silence."""
    import threading

    import placement.events as events_mod

    monkeypatch.setattr(events_mod, "CLOSE_WAIT_S", 0.2)
    ev = EventLog(str(tmp_path / "rank0.jsonl"), 0)
    ev.write_lines(['{"type":"step","step":1}', '{"type":"step","step":2}', '{"type":"step","step":3}'])
    held, release = threading.Event(), threading.Event()

    def hold():
        with ev._lock:  # a writer stuck inside the log (a full pipe, a hung NFS server)
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    try:
        ev.close()
    finally:
        release.set()
        t.join(10)
    assert ev.dropped == 3
    assert "3 record(s) could not be written" in capfd.readouterr().err


def test_a_compression_cut_short_by_exit_leaves_no_temporary(tmp_path):
    """The log's compression runs on a daemon thread: an exit while it writes leaves no
    `.gz.tmp` behind (removed at exit), and the rotated piece stays whole, uncompressed."""
    piece = tmp_path / "rank0.0001.jsonl"
    script = textwrap.dedent(f"""
        import os, sys, time
        from placement.events import compress_rotated
        from placement.roles import OWN_THREADS
        path = {str(piece)!r}
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 20) * 48)  # ~48 MB that compresses slowly: the thread is mid-write at exit
        OWN_THREADS.start(compress_rotated, "placement_gzip", (os.open(path, os.O_RDONLY), path, 0))
        deadline = time.monotonic() + 30
        while not os.path.exists(path + ".gz.tmp") and time.monotonic() < deadline:
            time.sleep(0.001)
        sys.exit(0 if os.path.exists(path + ".gz.tmp") else 3)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert not (tmp_path / "rank0.0001.jsonl.gz.tmp").exists()
    assert piece.stat().st_size == 48 << 20
