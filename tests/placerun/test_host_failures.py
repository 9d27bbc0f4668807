"""What happens to hosts of a job (tests/hostbed.py: each host its own network, hostname and fate),
2 hosts x 2 ranks on gloo under placerun, torchrun's behaviour in the same bed the floor:

- frozen: every process of host1 stopped (SIGSTOP). Rank 0 names ranks 2 and 3 stalled, with
  host1 and its node rank, within its stall limit; resumed once host1 runs again; the job ends 0.
- killed under --max-restarts 1 (and a replacement agent started on host1, as a scheduler does):
  the job restarts and ends 0 on both hosts, as under torchrun; the new agent plans its host, the monitor
  re-attaches (a new `start`, the exchange names host1's slow rank again), every log holds each
  record it flushed before the kill and then the new attempt's.
- the store host (host0: rendezvous store and rank 0) killed: host1 fails at once with torchrun's
  exit code and error; its ranks' logs end with an `end` after the steps they flushed.
- host1's clock 5 s ahead (the monitor's clock hook; faketime breaks Python's sleep here): lateness of a slow rank on host0 is right within a few ms
  and host1's balanced ranks are never named.
- host1's log directory fills up (a tiny tmpfs): host1's ranks say so once each and count what
  they lost; host0's logs are whole.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from hostbed import wait_until
from test_hosts import err, host_logs, job_cmd, read_log

pytestmark = pytest.mark.slow

STEP_MS = 20.0


def _steps(log: list[dict]) -> list[int]:
    """The steps the log's step records hold (a record may hold several: records/step.py)."""
    return [n for e in log if e["type"] == "step" for n in range(e["step"] - e.get("steps", 1) + 1, e["step"] + 1)]


def _agent_failed(agents):
    def check():
        for proc, prefix in agents:
            if proc.poll() is not None:
                return f"agent exited {proc.returncode}:\n{err(prefix)}"
        return None
    return check


def _stepping(tmp_path: Path, rank: int, host: str, step: int):
    """True once `rank`'s log (on `host`) has flushed step `step`."""
    return lambda: any(s >= step for s in _steps(read_log(tmp_path / f"logs-{host}" / f"rank{rank}.jsonl")))


def _start(bed, tmp_path, out, steps, **kw):
    return [(h.start(job_cmd(bed, h.index, tmp_path, out, steps=steps, step_ms=STEP_MS, **kw), tmp_path / h.name,
                     cwd=tmp_path), tmp_path / h.name) for h in bed.hosts]


def test_a_frozen_host_is_named_stalled_with_its_host_and_resumed(hostbed, tmp_path):
    bed = hostbed(2)
    agents = _start(bed, tmp_path, tmp_path, 400, overrides=["placement.monitor.hang_min_s=2"])
    wait_until(_stepping(tmp_path, 0, "host0", 40), 180, "rank 0 at step 40", fail_if=_agent_failed(agents))
    frozen_at = time.time()
    assert bed.hosts[1].freeze()
    log0 = tmp_path / "logs-host0" / "rank0.jsonl"

    def named(phase):
        # stalled: "silent" (no post, no row while its peers wait in the collective), or "rows
        # stopped" (its row missing from the exchange in flight past the limit): a freeze that lands
        # between the two ranks' rows of one exchange names one each way, in the same look
        # (health/peers.py: the overdue exchange is peeked first, then the silent are named);
        # resumed: its rows, or its own post, come again
        return lambda: [e for e in read_log(log0) if e["type"] == "stall" and e.get("reported_by") == 0
                        and e["phase"] == phase and e.get("rank") in (2, 3)
                        and (phase == "resumed" or e.get("how") in ("silent", "rows stopped"))] or None
    try:
        stalled = wait_until(named("stalled"), 60, "rank 0 naming host1's ranks stalled")
        wait_until(lambda: len(named("stalled")() or []) >= 2, 10, "both of host1's ranks named")
    finally:
        thawed_at = time.time()
        bed.hosts[1].thaw()
    stalled = named("stalled")()
    assert sorted(e["rank"] for e in stalled) == [2, 3], stalled
    node1 = next(e["node_rank"] for e in read_log(tmp_path / "logs-host1" / "rank2.jsonl") if e["type"] == "start"
                 and e.get("source") == "monitor")
    for e in stalled:
        assert e["host"] == "host1" and e["node_rank"] == node1, e
        # named within its limit of its last sign of life (its last row, sent before the freeze)
        # + 2 s: the silence counts from the last row, not from when the others noticed they wait
        assert e["t"] - frozen_at <= e["threshold_s"] + 2.0, (e, frozen_at)
    # resumed: by their rows (with host and node rank); their own posts may say it first
    resumed = wait_until(lambda: (lambda got: got if {e["rank"] for e in got if e.get("host") == "host1"} == {2, 3}
                                  else None)(named("resumed")() or []), 60, "rank 0 naming host1's ranks resumed")
    assert all(e["t"] >= thawed_at for e in resumed)
    for proc, prefix in agents:
        assert proc.wait(timeout=180) == 0, err(prefix)


def _kill_and_replace(bed, tmp_path, name, env):
    """A job of `name` (placerun or torchrun) under --max-restarts 1; host1 killed once every
    rank steps, and a new agent started on host1. Returns the agents' exit codes, host0's first."""
    out = tmp_path / name / "out"
    out.mkdir(parents=True)
    kw = dict(name=name, slow_rank=3, slow_ms=30, torch_flags=["--max-restarts", "1"])
    agents = [(h.start(job_cmd(bed, h.index, tmp_path / name, out, steps=150, step_ms=STEP_MS, **kw),
                       tmp_path / name / h.name, env=env, cwd=tmp_path / name), tmp_path / name / h.name)
              for h in bed.hosts]
    wait_until(lambda: all((out / f"attempt0.rank{r}.json").exists() for r in range(4)), 180, "every rank stepping",
               fail_if=_agent_failed(agents))
    if name == "placerun":  # 20 steps flushed by every rank before host1 dies (each rank flushes on its own clock)
        for rank in range(4):
            wait_until(lambda: any(_stepping(tmp_path / name, rank, h.name, 20)() for h in bed.hosts), 60,
                       f"rank {rank} at step 20", fail_if=_agent_failed(agents))
    (out / "killed").touch()
    bed.hosts[1].kill()
    again = bed.hosts[1].start(job_cmd(bed, 1, tmp_path / name, out, steps=150, step_ms=STEP_MS, **kw),
                               tmp_path / name / "host1-again", env=env, cwd=tmp_path / name)
    codes = [agents[0][0].wait(timeout=240), again.wait(timeout=240)]
    return codes, [agents[0][1], tmp_path / name / "host1-again"]


def test_a_killed_host_restarts_the_job_as_torchrun_does_and_logs_continue(hostbed, tmp_path):
    bed = hostbed(2)
    # workers' own store per attempt, as tests/placerun/test_placerun_elastic.py says why (pytorch/pytorch#135712)
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    torchrun_codes, _ = _kill_and_replace(bed, tmp_path, "torchrun", env)
    bed.close()
    bed = hostbed(2)
    codes, prefixes = _kill_and_replace(bed, tmp_path, "placerun", env)
    assert codes == torchrun_codes == [0, 0], [err(p) for p in prefixes]
    # the replacement agent planned for its host; host0's agent reuses the plan it made before it
    # started (placerun plans once per agent: restarts keep it, docs/placerun.md)
    assert err(prefixes[0], 0).count("placerun: host0: policy") == 1
    assert err(prefixes[1], 0).count("placerun: host1: policy") == 1
    logs = host_logs(tmp_path / "placerun", bed)
    assert sorted(logs) == [0, 1, 2, 3]
    for rank, log in logs.items():
        starts = [i for i, e in enumerate(log) if e["type"] == "start" and e.get("source") == "monitor"]
        assert len(starts) == 2, (rank, starts)  # attach, and attach again in the restarted worker
        first, second = _steps(log[:starts[1]]), _steps(log[starts[1]:])
        # every record flushed before the kill is there, in order, and the new attempt's after it
        assert first == list(range(1, len(first) + 1)) and len(first) >= 20, (rank, first[-3:])
        assert second == list(range(1, 151)), (rank, second[:3], second[-3:])
    # the monitor re-attached: rank 0 judges exchanges of the new attempt and names host1's slow rank
    after = logs[0][[i for i, e in enumerate(logs[0]) if e["type"] == "start" and e.get("source") == "monitor"][1]:]
    named = [e for e in after if e["type"] == "straggler" and any(s["ranks"] == [3] for s in e["stragglers"])]
    assert named and all(e["hosts"]["3"] == "host1" for e in named), [e for e in after if e["type"] == "straggler"]


def test_killing_the_store_host_fails_as_torchrun_does_quickly(hostbed, tmp_path):
    results = {}
    for name in ("torchrun", "placerun"):
        bed = hostbed(2)
        out = tmp_path / name / "out"
        out.mkdir(parents=True)
        agents = [(h.start(job_cmd(bed, h.index, tmp_path / name, out, steps=400, step_ms=STEP_MS, name=name),
                           tmp_path / name / h.name, cwd=tmp_path / name), tmp_path / name / h.name)
                  for h in bed.hosts]
        wait_until(lambda: all((out / f"attempt0.rank{r}.json").exists() for r in range(4)), 180,
                   "every rank stepping", fail_if=_agent_failed(agents))
        if name == "placerun":
            wait_until(_stepping(tmp_path / name, 2, "host1", 20), 60, "rank 2 at step 20",
                       fail_if=_agent_failed(agents))
        killed_at = time.monotonic()
        bed.hosts[0].kill()
        code = agents[1][0].wait(timeout=120)
        results[name] = (code, time.monotonic() - killed_at, err(agents[1][1]))
        bed.close()
    (code, took, text), (t_code, t_took, t_text) = results["placerun"], results["torchrun"]
    assert code == t_code == 1, (results["placerun"][2], results["torchrun"][2])
    # torchrun's own error: its failure summary of host1's ranks when the agent sees its workers
    # fail first, else the rendezvous' RendezvousConnectionError when its store op fails first
    # (a race in torch elastic: both seen here, under either launcher)
    for said in (text, t_text):
        last = said.strip().splitlines()[-1] if "ChildFailedError" not in said else "ChildFailedError"
        assert last == "ChildFailedError" and "hosts_job.py FAILED" in said and "host      : host1" in said \
            or last.startswith("torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: "), said
    assert took <= 2 * t_took + 10.0, (took, t_took)  # as quick as torchrun (a busy machine's margin)
    for rank in (2, 3):
        log = read_log(tmp_path / "placerun" / "logs-host1" / f"rank{rank}.jsonl")  # every line whole
        steps = _steps(log)
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 20, (rank, steps[-3:])
        # Its `end` line is there only when the rank reached its exit path: a rank blocked inside a
        # gloo collective on the dead host runs no Python signal handler (handlers run between
        # bytecodes) and torch's agent then SIGKILLs it (seen 1 in 2 under two spinners). What was
        # flushed is there, whole and in order, either way.
        ends = [i for i, e in enumerate(log) if e["type"] == "end"]
        assert not ends or ends == [len(log) - 1], log[-3:]  # an end line is the last, written once


def test_a_host_clock_seconds_ahead_changes_no_lateness(hostbed, tmp_path):
    bed = hostbed(2)
    slow, delay_ms, skew_s = 1, 40.0, 5.0
    # host1's ranks stamp their steps 5 s ahead: the monitor's wall clock (monitor/clock.py) is
    # shifted by its test hook. faketime (libfaketime 0.9.10) cannot run these processes here:
    # Python 3.11's time.sleep fails with EINVAL under it (hangs when the monotonic clock is faked too).
    agents = []
    for h in bed.hosts:
        cmd = job_cmd(bed, h.index, tmp_path, tmp_path, steps=80, step_ms=STEP_MS, slow_rank=slow, slow_ms=delay_ms)
        env = {"PLACEMENT_TEST_CLOCK_OFFSET_S": str(skew_s)} if h.index == 1 else None
        agents.append((h.start(cmd, tmp_path / h.name, env=env), tmp_path / h.name))
    for proc, prefix in agents:
        assert proc.wait(timeout=240) == 0, err(prefix)
    logs = host_logs(tmp_path, bed)
    # the skew is real: the same step ends ~5 s later on host1's clock than on host0's
    t = {r: {e["step"]: e["t"] for e in log if e["type"] == "step"} for r, log in logs.items()}
    ahead = statistics.median(t[2][s] - t[0][s] for s in t[0] if s in t[2])
    assert abs(ahead - skew_s) < 1.0, ahead
    events = [e for e in logs[0] if e["type"] == "straggler" and e["steps"][0] > 10]
    named = [s for e in events for s in e["stragglers"]]
    assert all(s["ranks"] == [slow] for s in named), named  # host1's ranks are never named
    late = [s["lateness_ms"] for s in named if s["kind"] == "data-slow"]
    assert len(late) >= 4, events  # windows 11-20 .. 71-80; a busy machine may cost one or two
    assert abs(statistics.median(late) - delay_ms) <= 8.0, late


def test_a_hosts_full_log_dir_is_said_once_and_counted_others_whole(hostbed, tmp_path):
    logs1 = tmp_path / "logs-host1"
    logs1.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(logs1)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for host1's log dir: {mounted.stderr.decode().strip()}")
    try:
        bed = hostbed(2)
        # a record a step: 300 steps' lines never fit host1's 64 KB (records of several steps, as the
        # budget makes them at short steps on a busy machine, once fitted them all on one rank)
        agents = _start(bed, tmp_path, tmp_path, 300, overrides=["placement.monitor.record_min_s=0"])
        for proc, prefix in agents:
            assert proc.wait(timeout=240) == 0, err(prefix)
        said = [line for line in err(tmp_path / "host1", 0).splitlines() if "cannot write" in line]
        total = [line for line in err(tmp_path / "host1", 0).splitlines() if "could not be written" in line]
        assert len(said) == 2 and all("ENOSPC" in line for line in said), said  # once per rank of host1
        assert sorted(line.split(":")[1].strip() for line in total) == ["rank 2", "rank 3"], total
        assert not [line for line in err(tmp_path / "host0", 0).splitlines() if "cannot write" in line]
        # An event index that a write to failed is removed, said once (a report then reads the log); one
        # that stayed (its writes fit the tmpfs' last page) is whole: every line parses.
        dropped = [line for line in err(tmp_path / "host1", 0).splitlines() if "event index beside" in line]
        assert len(dropped) == len({line.split(":")[1] for line in dropped}) <= 2, dropped
        for rank in (2, 3):
            index = logs1 / f"rank{rank}.events"
            assert (f"rank {rank}:" in " ".join(dropped)) != index.exists()
            if index.exists():
                assert all(json.loads(line) for line in index.read_text().splitlines())
        assert len(list((tmp_path / "logs-host0").glob("rank*.events"))) == 2
        for rank in (0, 1):  # whole: every line parses, every step is there
            assert _steps(read_log(tmp_path / "logs-host0" / f"rank{rank}.jsonl")) == list(range(1, 301)), rank
        for rank in (2, 3):
            assert len(_steps(read_log(logs1 / f"rank{rank}.jsonl", strict=False))) < 300
    finally:
        subprocess.run(["umount", "-l", str(logs1)], capture_output=True)
