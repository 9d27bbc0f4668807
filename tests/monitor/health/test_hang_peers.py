"""Rank 0 names hung peers in its own log, through the job's c10d store (monitor/health/peers.py,
crossrank/exchange.py):
- `hang`: 3 real gloo ranks, an all_reduce per step; rank 1's main thread blocks on a lock after
  step STOP_AT (so every rank then waits). Rank 0's log gets a `stall` event naming rank 1
  (reported_by 0, how "posted"), its last step and its main thread's wait channel, within
  2 x hang_min_s of rank 1's last step; then one saying it resumed. `placement report` over
  rank 0's log as the hung job left it puts rank 1 first; over the whole run, nobody.
- `frozen`: 3 ranks stepping without collectives; rank 1's whole process stops (SIGSTOP: its
  monitor thread cannot post). Rank 0 names it from its exchange rows that stopped arriving
  (how "rows stopped"), with the last step of its last row.

The file is also the worker: `python tests/monitor/health/test_hang_peers.py SCENARIO LOG_DIR` with
RANK/WORLD_SIZE/MASTER_* in the environment runs one rank.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: its helpers, when this file runs as a rank's script

from placerun_helpers import exit_without_gloo_teardown, free_port

WORLD = 3
EVERY = 10
STOP_AT = 28  # rank 1 stops after this step
HANG_MIN_S = 2.0
STEPS = 60


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def _read_line(line: str) -> list[dict]:
    try:
        return [json.loads(line)]
    except ValueError:
        return []


def _named_by_rank0(log: list[dict], phase: str = "stalled") -> list[dict]:
    return [e for e in log if e.get("type") == "stall" and e.get("reported_by") == 0 and e.get("rank") == 1
            and e.get("phase") == phase]


def _run(tmp_path: Path, scenario: str, on_named=None) -> dict[int, list[dict]]:
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                   LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, scenario, str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        if on_named is not None:
            deadline = time.monotonic() + 60
            while not _named_by_rank0(_read(tmp_path / "rank0.jsonl")) and time.monotonic() < deadline:
                time.sleep(0.1)
            on_named(procs)
        outputs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = {r: _read(tmp_path / f"rank{r}.jsonl") for r in range(WORLD)}
    return logs, [(p.returncode, out) for p, out in zip(procs, outputs)]


def _step_t(log: list[dict], step: int) -> float:
    """When `step` ended: a record of several steps (records/step.py) ends at its last; an
    earlier step of it ended the times of the steps after it before that."""
    e = next(e for e in log if e.get("type") == "step" and e["step"] - e.get("steps", 1) < step <= e["step"])
    return e["t"] - sum(e.get("each_ms", [])[len(e.get("each_ms", [])) - (e["step"] - step):]) / 1e3


@pytest.mark.slow
def test_rank0_names_a_peer_whose_main_thread_hangs_with_its_last_step_and_wait_channel(tmp_path, capsys):
    from placement.cli import main as cli

    logs, results = _run(tmp_path, "hang")
    for rank, (rc, out) in enumerate(results):
        assert rc == 0, f"rank {rank} failed:\n{out[-3000:]}"
    named = _named_by_rank0(logs[0])
    assert len(named) == 1, [e for e in logs[0] if e.get("type") == "stall"]
    e = named[0]
    assert e["how"] == "posted" and e["last_step"] == STOP_AT, e
    assert e["main"]["state"] == "S" and "futex" in (e["main"]["wchan"] or ""), e["main"]
    # Who holds whom: rank 1 stopped outside any collective; the ranks it holds wait inside one.
    assert e["in_collective"] is False, e
    waiting = [x for log in logs.values() for x in log
               if x.get("type") == "stall" and x.get("phase") == "stalled" and x.get("rank") in (0, 2)]
    assert waiting and all(x["in_collective"] is True for x in waiting), waiting
    assert "outside any collective" in e["message"], e["message"]
    assert any("_hung_in_a_lock" in line for line in e["main"]["stack"]), e["main"]
    after = e["t"] - _step_t(logs[1], STOP_AT)  # one host: one clock
    assert HANG_MIN_S <= after <= 2 * HANG_MIN_S, after
    assert _named_by_rank0(logs[0], "resumed"), "rank 0 did not say rank 1 resumed"
    assert all(x.get("reported_by") is None for r in (1, 2) for x in logs[r] if x.get("type") == "stall"), \
        "only rank 0 names peers"

    # The report over rank 0's log as the hung job left it (up to that event): rank 1 at the top,
    # where its main thread waits; over the whole run: nobody flagged (everyone resumed).
    lines = (tmp_path / "rank0.jsonl").read_text().splitlines()
    cut = next(i for i, l in enumerate(lines) if _named_by_rank0(_read_line(l)))
    hung = tmp_path.parent / (tmp_path.name + "-hung") / "rank0.jsonl"
    hung.parent.mkdir()
    hung.write_text("\n".join(lines[:cut + 1]) + "\n")
    capsys.readouterr()
    assert cli(["report", str(hung)]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("HUNG:") and f"rank 1 after step {STOP_AT} outside any collective" in first, out[:600]
    # Ranks stalled inside the all_reduce (rank 0 itself, rank 2 by its post) may be flagged by
    # then too: the one outside any collective comes first, whatever the last steps say.
    assert first.split("did not resume: ", 1)[1].startswith(f"rank 1 after step {STOP_AT}"), first
    assert "futex" in out and "named by rank 0" in out, out[:2000]
    assert cli(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert not out.startswith("HUNG") and not any(l.startswith("hung (") for l in out.splitlines()), out[:2000]


@pytest.mark.slow
def test_rank0_names_a_frozen_peer_from_its_exchange_rows(tmp_path):
    def unfreeze(procs):
        procs[1].kill()  # rank 0 named it (or the wait ran out): it has served its purpose

    logs, results = _run(tmp_path, "frozen", on_named=unfreeze)
    for rank in (0, 2):
        rc, out = results[rank]
        assert rc == 0, f"rank {rank} failed:\n{out[-3000:]}"
    named = _named_by_rank0(logs[0])
    assert len(named) == 1, [e for e in logs[0] if e.get("type") == "stall"]
    e = named[0]
    from placement.monitor.crossrank.exchange import exchange_steps

    last_row_step = exchange_steps((STOP_AT // EVERY) * EVERY, EVERY)[1]
    assert e["how"] == "rows stopped" and e["last_step"] == last_row_step, e
    assert e["stalled_s"] >= e["threshold_s"] >= HANG_MIN_S, e
    # Rank 0 sent the first exchange rank 1 missed at step (STOP_AT // EVERY + 1) * EVERY.
    sent_at = _step_t(logs[0], (STOP_AT // EVERY + 1) * EVERY)
    assert e["t"] - sent_at <= 2 * HANG_MIN_S, e["t"] - sent_at


# ---------------------------------------------------------------------------------- the worker
def _hung_in_a_lock(rank0_log: Path) -> None:
    """Block (a futex wait, as a hung collective's wait()) until rank 0 named this rank, at most 30 s."""
    import threading

    release = threading.Event()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _named_by_rank0(_read(rank0_log)):
        release.wait(timeout=0.3)


def worker(scenario: str, log_dir: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import placement
    from placement.monitor.crossrank.exchange import Exchange

    Exchange.WAIT_S = 2.0  # rank 0 waits this long at each exchange for a rank that froze
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank = dist.get_rank()
    handle = placement.attach(policy="none", tune={"enabled": False},
                              monitor={"log_dir": log_dir, "exchange_every": EVERY, "flush_every": 5,
                                       "summary_every": 0, "hang_min_s": HANG_MIN_S,
                                       # the frozen rank's last row is the window before it froze
                                       "handover_min_s": 0})
    dist.barrier()
    x = torch.ones(16)
    rank0_log = Path(log_dir) / "rank0.jsonl"
    step = 0
    while step < STEPS or (scenario == "frozen" and rank == 0 and not _named_by_rank0(_read(rank0_log))
                           and step < 3000):
        step += 1
        time.sleep(0.01)
        if scenario == "hang":
            dist.all_reduce(x)
        handle.step()
        if rank == 1 and step == STOP_AT:
            if scenario == "hang":
                _hung_in_a_lock(rank0_log)
            else:
                os.kill(os.getpid(), signal.SIGSTOP)  # the whole process: no thread of it runs
    handle.close()
    if scenario == "hang":
        dist.barrier()
    exit_without_gloo_teardown()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])


def test_many_peers_posting_at_once_are_named_in_a_few_events_and_reported(tmp_path, capsys):
    """One hang at scale: every rank waits in the next collective and posts. Rank 0 names the
    NAMED_PEERS lowest last steps one event each, groups the rest; the report reads them all."""
    from placement.cli import main as cli
    from placement.events import EventLog
    from placement.monitor.health.peers import NAMED_PEERS, peer_events, write_peer_hang

    def post(rank, last_step, wchan):
        return {"phase": "stalled", "rank": rank, "last_step": last_step, "stalled_s": 31.0, "threshold_s": 30.0,
                "main": {"tid": 100 + rank, "state": "S", "wchan": wchan, "stack": ['File "t.py", line 3 in f']}}

    posts = [post(r, 28, "futex_do_wait" if r % 2 else "do_epoll_wait") for r in range(1, 200)]
    posts[40] = post(41, 27, "pipe_read")  # the rank that stopped first
    fields = peer_events(posts)
    single = [f for f in fields if "rank" in f]
    grouped = [f for f in fields if "ranks" in f]
    assert len(single) == NAMED_PEERS and single[0]["rank"] == 41 and single[0]["main"]["wchan"] == "pipe_read"
    assert len(grouped) == 2 and sum(f["count"] for f in grouped) == 199 - NAMED_PEERS
    assert {f["main"]["wchan"] for f in grouped} == {"futex_do_wait", "do_epoll_wait"}
    log = EventLog(str(tmp_path / "rank0.jsonl"), 0)
    log.event("step", step=1, step_ms=10.0, data_ms=0.0, comm_ms=1.0, comm_count=1, roles={})
    for f in fields:
        write_peer_hang(log, f)
    log.close()
    capsys.readouterr()
    assert cli(["report", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("HUNG: 199 rank(s)") and first.split(": ", 2)[2].startswith("rank 41 after step 27"), first


def test_rank0_stops_waiting_for_a_peer_it_named_stalled_and_judges_it_again_when_its_rows_come():
    """In process, over a real TCPStore: rank 1 of 2 sends nothing. Rank 0's first judgement
    waits WAIT_S for it and names it stalled ("rows stopped"); later exchanges no longer wait
    for it (a frozen peer must not cost WAIT_S per exchange, nor, through the monitor's
    backlog, hold training back). When its row comes again it is judged and named resumed."""
    import torch.distributed as dist

    from placement.monitor.crossrank.exchange import Exchange, StoreTransport
    from placement.monitor.crossrank.rows import encode_row
    from placement.monitor.health.peers import PeerLiveness, PeerWatch
    from placement.monitor.stragglers.figures import RankFigures

    def figs(rank, last):
        comm = tuple(5.0 for _ in range(EVERY))
        return RankFigures(rank, EVERY, last - EVERY + 1, last, 20.0, 0.5, 5.0, 0.1, 0.05, 10.0, None, comm)

    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    reports = []
    written = []
    ex = Exchange(0, 2, store, lambda key, msg: None, slots=EVERY, liveness=PeerLiveness(2))
    ex.WAIT_S = 1.0
    watch = PeerWatch(ex, lambda: 0.5, written.append, poll_s=1.0)  # rank 0's hang limit: 0.5 s
    watch.poll()  # its first look sets the limit the exchange's judgement names by
    _keep(reports, ex.submit([figs(0, 10)]))
    t0 = time.monotonic()
    _keep(reports, ex.submit([figs(0, 20)]))  # judges exchange 10 first: waits WAIT_S for rank 1
    waited_first = time.monotonic() - t0
    assert reports[-1]["missing"] == [1]
    watch.poll()
    assert [(f["phase"], f["rank"], f["how"]) for f in written] == [("stalled", 1, "rows stopped")]
    t0 = time.monotonic()
    _keep(reports, ex.submit([figs(0, 30)]))  # judges exchange 20: rank 1 is named, not waited for
    waited_named = time.monotonic() - t0
    assert reports[-1]["missing"] == [1]
    assert waited_first >= ex.WAIT_S * 0.9 and waited_named < waited_first * 0.3, (waited_first, waited_named)
    StoreTransport(store, 1, 2).send(30, encode_row(30, 0, figs(1, 30), EVERY))  # rank 1 is back
    _keep(reports, ex.collect(block=True))
    assert reports[-1]["missing"] == [] and reports[-1]["ranks_judged"] == 2
    written.clear()
    watch.poll()
    assert [(f["phase"], f["rank"]) for f in written] == [("resumed", 1)]


def test_rows_that_come_after_their_exchange_was_judged_leave_no_keys_in_the_store():
    """In process, over a real TCPStore: rank 1's row of exchange 10 comes after rank 0 judged
    10 without it; its append and add re-create 10's keys. Rank 0 removes them at its next
    judgement: nothing of the job's exchanges stays in the store."""
    import torch.distributed as dist

    from placement.monitor.crossrank.exchange import PREFIX, Exchange, StoreTransport
    from placement.monitor.crossrank.rows import encode_row
    from placement.monitor.stragglers.figures import RankFigures

    def figs(rank, last):
        comm = tuple(5.0 for _ in range(EVERY))
        return RankFigures(rank, EVERY, last - EVERY + 1, last, 20.0, 0.5, 5.0, 0.1, 0.05, 10.0, None, comm)

    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    keys = dist.PrefixStore(PREFIX, store)
    reports = []
    ex = Exchange(0, 2, store, lambda key, msg: None, slots=EVERY)
    ex.WAIT_S = 0.3
    _keep(reports, ex.submit([figs(0, 10)]))
    _keep(reports, ex.submit([figs(0, 20)]))  # judges 10 without rank 1
    assert reports[-1]["missing"] == [1] and not keys.check(["10/rows"]) and not keys.check(["10/n"])
    late = StoreTransport(store, 1, 2)
    late.send(10, encode_row(10, 0, figs(1, 10), EVERY))  # too late: its keys are made anew
    assert keys.check(["10/rows"]) and keys.check(["10/n"])
    late.send(20, encode_row(20, 0, figs(1, 20), EVERY))
    _keep(reports, ex.submit([figs(0, 30)]))  # judges 20 (both rows), then sweeps 10
    assert reports[-1]["missing"] == [] and reports[-1]["ranks_judged"] == 2
    assert not keys.check(["10/rows"]) and not keys.check(["10/n"]) and not keys.check(["20/rows"])


def _keep(reports: list, verdicts) -> None:
    """What rank 0's exchange judged (its WindowJudgements), as the fields the tests read."""
    for verdict in verdicts:
        reports.append({"missing": verdict.missing, "ranks_judged": verdict.ranks_judged})


# ---- rank 0's reading of hangs outside any collective (health/peers.py PeerWatch.hang_events) ----
def _post(rank, inside, phase="stalled"):
    return {"phase": phase, "rank": rank, "last_step": 40, "in_collective": inside,
            "main": {"state": "S", "wchan": "futex_do_wait", "stack": []}}


def test_every_rank_pausing_together_is_one_job_event_and_a_rank_others_wait_for_is_named():
    from placement.monitor.health.peers import PeerWatch

    now = [0.0]
    own = [None]
    w = PeerWatch(None, lambda: 7.0, lambda f: None, 1.0, own=lambda: own[0], clock=lambda: now[0])
    assert w.hang_events([_post(1, False)], 3) == []  # held: hung, or a shared pause?
    own[0] = _post(0, False)
    out = w.hang_events([_post(2, False)], 3)
    assert len(out) == 1 and out[0]["scope"] == "job" and "not a hung rank" in out[0]["message"], out
    own[0] = None
    out = w.hang_events([_post(1, False, "resumed"), _post(2, False, "resumed")], 3)
    assert [f["phase"] for f in out] == ["resumed"] and out[0]["scope"] == "job", out

    # A hang: rank 1 outside, its peers inside a collective waiting for it: rank 1 named at once.
    w = PeerWatch(None, lambda: 7.0, lambda f: None, 1.0, own=lambda: _post(0, True), clock=lambda: now[0])
    out = w.hang_events([_post(1, False), _post(2, True)], 3)
    named = [f for f in out if f.get("rank") == 1]
    assert len(named) == 1 and named[0]["in_collective"] is False and "scope" not in named[0], out
    # Alone outside with nobody waiting (no collective per step): named after HOLD_POLLS polls.
    w = PeerWatch(None, lambda: 7.0, lambda f: None, 1.0, clock=lambda: now[0])
    assert w.hang_events([_post(1, False)], 3) == []
    now[0] += 3.5
    assert [f["rank"] for f in w.hang_events([], 3)] == [1]


def test_the_peer_watch_looks_half_as_often_while_the_monitors_budget_stretches_its_floor():
    """Rank 0's peer watch looks every poll_s / 2 (a wake-up and a round trip each); while the
    monitor's budget stretches its hand-overs (probes/budget.py PacedFloor) every poll_s."""
    from types import SimpleNamespace

    from placement.monitor.health.peers import PeerWatch

    stretched = [False]
    watch = PeerWatch(SimpleNamespace(enabled=False), lambda: 1.0, lambda fields: None, poll_s=1.0,
                      stretched=lambda: stretched[0])
    waits: list[float] = []
    watch._stop = SimpleNamespace(wait=lambda s: waits.append(s) or False)  # (the thread's timed wait)
    watch._run()  # one wait, then a look: the exchange is off, the watch ends
    stretched[0] = True
    watch._run()
    assert waits == [0.5, 1.0]
