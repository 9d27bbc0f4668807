"""placerun's automatic monitor: programs that never import placement get step records.

StepFinder's rule on constructed event sequences with known answers, then real 2-rank gloo jobs
under placerun (tests/placerun_jobs/auto_loops.py and the framework examples with their callback
off), each rank log read back: as many step records as the loop's iterations (within one: step 1
begins at the first optimizer step), data wait where the loader blocks, parts within the step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from placement.auto.steps import StepFinder
from placement.records.step import line_steps
from placerun_helpers import JOBS, REPO, launcher

# ---- the rule ---------------------------------------------------------------------------------


def _run(events: str) -> list:
    """Feed a sequence: F = a fetch (f = an iterator's first), a/b = optimizer fires, S = a
    GradScaler's (outer) fire; the monitor begins at the first fire. Returns the events at which
    a step ended ('fire' or 'fetch'), in order."""
    ends: list = []
    finder = StepFinder(lambda: ends.append("fire"), lambda stamp: ends.append("fetch"))
    begun = seen_fetch = False
    for i, ev in enumerate(events.replace(" ", "")):
        if ev in "Ff":
            if begun:
                finder.fetched(i, first=ev == "f")
            seen_fetch = True
        elif not begun:
            finder.begin(ev, outer=ev == "S", seen_fetch=seen_fetch)
            begun = True
        else:
            finder.fire(ev, outer=ev == "S")
    return ends


def test_one_optimizer_one_step_per_fire():
    assert _run("Fa" + "Fa" * 9) == ["fire"] * 9


def test_two_optimizers_an_iteration_are_one_step_ending_at_the_second():
    ends = []
    finder = StepFinder(lambda: ends.append("fire"), lambda stamp: ends.append("fetch"))
    finder.begin("d", seen_fetch=True)
    finder.fire("g")
    finder.fetched(1)
    finder.fire("d")
    assert ends == []  # the first of two fires does not end the step
    finder.fire("g")
    assert ends == ["fire"] and finder.fires_per_step == 2


def test_chained_optimizers_and_containers_count_once():
    assert _run("F a b c" + " F a b c" * 9) == ["fire"] * 9


def test_gradient_accumulation_counts_optimizer_steps():
    assert _run("FFFFa" + "FFFFa" * 5) == ["fire"] * 5


def test_a_skipped_iteration_is_still_a_step():
    # GradScaler: the optimizer fires inside scaler.step, the scaler after; on inf only the scaler.
    assert _run("F a S  F a S  F S  F a S  F a S") == ["fire", "fetch", "fire", "fire"]
    # No fire at all (Megatron's found_inf): the k-th fetch without one ends the step.
    assert _run("F a  F a  F  F a  F a") == ["fire", "fetch", "fire", "fire"]


def test_a_prefetching_loader_starting_an_epoch_is_not_a_skipped_step():
    # Accelerate's DataLoaderShard and Lightning's fetcher fetch batch 2 before handing out batch 1.
    assert _run("f F a  F a  F a  f F a  F a") == ["fire"] * 4


def test_without_a_dataloader_the_lead_optimizer_ends_each_step():
    assert _run("a b" + " a b" * 6) == ["fire"] * 6
    assert _run("a S" + " a S" * 3 + " S" + " a S") == ["fire"] * 5  # the scaler leads: skips counted


# ---- real jobs under placerun -------------------------------------------------------------------

ITERS = 30


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLACEMENT_", "OMP_NUM_THREADS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _placerun(tmp_path: Path, script: list[str], keys: tuple[str, ...] = (), timeout: int = 300):
    logs = tmp_path / "logs"
    cmd = [*launcher("placerun"), "--standalone", "--nproc-per-node", "2", f"placement.monitor.log_dir={logs}",
           *keys, *script]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout)
    return p, logs


def _log(logs: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (logs / f"rank{rank}.jsonl").read_text().splitlines()]


def _steps(log: list[dict]) -> list[dict]:
    return [e for e in log if e["type"] == "step"]


def _check_steps(logs: Path, iterations: int, data_wait: bool = True) -> None:
    for rank in (0, 1):
        log = _log(logs, rank)
        steps = _steps(log)
        covered = [n for s in steps for n in line_steps(s)]  # (a record may hold several steps)
        assert iterations - 1 <= len(covered) <= iterations, (rank, len(covered), iterations)
        assert covered == list(range(1, len(covered) + 1)), "each step once, in order"
        for s in steps:
            assert s["step_ms"] > 0 and s["comm_ms"] is not None and s["comm_ms"] >= 0, s
            # The parts are within the step: data wait and comm are times inside it.
            assert s["data_ms"] + s["comm_ms"] <= s["step_ms"] * 1.001 + 0.01, s
        if data_wait:
            assert all(s["data_ms"] > 0 for s in steps), "the loader blocks every step"
        starts = [e for e in log if e["type"] == "start" and e.get("source") == "monitor"]
        assert len(starts) == 1, "one monitor a process"
        assert starts[0]["steps"] == "auto" and starts[0]["ddp_hook"] and starts[0]["exchange"], starts[0]


def _loop(tmp_path, loop: str, *args: str, keys: tuple[str, ...] = ()):
    p, logs = _placerun(tmp_path, [str(JOBS / "auto_loops.py"), loop, "--iters", str(ITERS), *args], keys)
    assert p.returncode == 0, p.stderr[-4000:]
    assert f"iterations {ITERS}" in p.stdout, p.stdout[-2000:]
    return p, logs


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["plain", "two_opt", "accum", "scaler"])
def test_an_unmodified_loop_gets_a_record_per_iteration(tmp_path, loop):
    p, logs = _loop(tmp_path, loop)
    _check_steps(logs, ITERS)
    if loop == "scaler":
        assert "skipped 6" in p.stdout  # GradScaler skipped 6 optimizer steps: each is still a step


@pytest.mark.slow
def test_a_megatron_core_chained_optimizer_loop_without_attach_megatron(tmp_path):
    pytest.importorskip("megatron.core", reason="the optional extra [megatron]")
    _loop(tmp_path, "chained")
    _check_steps(tmp_path / "logs", ITERS)


@pytest.mark.slow
def test_megatron_lms_iteration_is_said_where_step_1_begins(tmp_path):
    _, logs = _loop(tmp_path, "plain", "--megatron-lm-from", "500")
    for rank in (0, 1):
        (start,) = [e for e in _log(logs, rank) if e["type"] == "start" and e.get("source") == "monitor"]
        # The monitor starts at iteration 500's optimizer step: step s runs iteration 500 + s.
        assert start["megatron_iteration"] == 500, start


@pytest.mark.slow
def test_a_program_that_attaches_itself_has_one_monitor(tmp_path):
    p, logs = _loop(tmp_path, "attach")
    for rank in (0, 1):
        log = _log(logs, rank)
        steps = _steps(log)
        assert [n for s in steps for n in line_steps(s)] == list(range(1, ITERS + 1)), "attach()'s records, none twice"
        starts = [e for e in log if e["type"] == "start" and e.get("source") == "monitor"]
        assert [s["steps"] for s in starts] == ["attach"], starts


@pytest.mark.slow
def test_a_program_without_an_optimizer_is_told_once_and_exits_as_it_would(tmp_path):
    p, logs = _placerun(tmp_path, [str(JOBS / "auto_loops.py"), "noopt", "--iters", "5"])
    assert p.returncode == 0, p.stderr[-4000:]
    assert "evaluated 5" in p.stdout
    for rank in (0, 1):
        log = _log(logs, rank)
        assert not _steps(log) and not [e for e in log if e.get("source") == "monitor" and e["type"] == "start"]
        said = [line for line in p.stderr.splitlines() if line.startswith(f"placement: rank {rank}: no optimizer step")]
        assert len(said) == 1, p.stderr[-3000:]
        (warning,) = [e for e in log if e["type"] == "warning" and e.get("source") == "monitor"]
        assert warning["batches_fetched"] == 5
    # The program's own exit code passes through as torchrun passes it (any failure: 1).
    p, _ = _placerun(tmp_path, [str(JOBS / "auto_loops.py"), "noopt", "--iters", "2", "--exit-code", "3"])
    assert p.returncode == 1 and "exitcode  : 3" in p.stderr, p.stderr[-3000:]


@pytest.mark.slow
def test_monitor_auto_false_keeps_binding_and_records_nothing(tmp_path):
    p, logs = _loop(tmp_path, "plain", keys=("placement.monitor.auto=false",))
    log = _log(logs, 0)
    assert not _steps(log)
    assert [e for e in log if e["type"] == "bind" and e.get("role") == "main" and e["ok"]]


@pytest.mark.slow
def test_an_unmodified_loop_names_a_rank_slowed_30_percent_with_its_cost(tmp_path):
    # On a host busy with other work rank 0 is itself preempted for milliseconds now and then, and
    # rank 1 is then not late at the 90% of steps the precision filter asks of two windows in a row
    # (benchmarks/precision.py measures that filter): 75% here, over 12 windows.
    p, logs = _placerun(tmp_path, [str(JOBS / "auto_loops.py"), "plain", "--iters", "240", "--delay", "0",
                                   "--work-ms", "10", "--slow-rank", "1", "--slow-ms", "3"],
                        keys=("placement.monitor.straggler_steady_pct=75",))
    assert p.returncode == 0, p.stderr[-4000:]
    named = [s for e in _log(logs, 0) if e["type"] == "straggler" for s in e["stragglers"]]
    assert named and {r for s in named for r in s["ranks"]} == {1}, named[:3]
    # its extra busy loop is compute; on a busy host its runqueue wait may explain it instead
    assert all(s["kind"] in ("compute-slow", "cpu-slow") and s["cost_ms_per_step"] > 0 for s in named), named[:3]


@pytest.mark.slow
def test_an_unmodified_loop_names_a_hung_rank(tmp_path):
    p, logs = _placerun(tmp_path, [str(JOBS / "auto_loops.py"), "plain", "--iters", "40", "--hang-rank", "1",
                                   "--hang-at", "20", "--hang-s", "9"], keys=("placement.monitor.hang_min_s=3",))
    assert p.returncode == 0, p.stderr[-4000:]
    log = _log(logs, 0)
    named = [e for e in log if e["type"] == "stall" and e.get("reported_by") == 0 and e.get("rank") == 1]
    phases = [e["phase"] for e in named]
    assert phases and phases[0] == "stalled" and phases[-1] == "resumed", named
    (posted,) = [e for e in named if e["phase"] == "stalled" and e["how"] == "posted"]
    # Its own post: where its main thread waits (the sleep), and the last step it completed.
    assert posted["in_collective"] is False and "nanosleep" in posted["main"]["wchan"], posted
    assert 18 <= posted["last_step"] <= 20, posted


def _example(tmp_path, name: str, *args: str, extra: str):
    pytest.importorskip(extra, reason=f"the optional extra [{extra}]")
    p, logs = _placerun(tmp_path, [str(REPO / "examples" / name), *args, "--callback", "off"])
    assert p.returncode == 0, p.stderr[-4000:]
    return logs


@pytest.mark.slow
def test_a_lightning_trainer_without_the_callback(tmp_path):
    logs = _example(tmp_path, "lightning_ddp.py", "--steps", "12", "--log-dir", str(tmp_path / "unused"),
                    extra="lightning")
    _check_steps(logs, 12, data_wait=False)


@pytest.mark.slow
def test_a_transformers_trainer_without_the_callback(tmp_path):
    logs = _example(tmp_path, "transformers_trainer.py", "--steps", "12", "--output-dir", str(tmp_path / "out"),
                    extra="transformers")
    _check_steps(logs, 12, data_wait=False)


def test_a_ranks_line_reaches_stderr_in_one_write(monkeypatch):
    """The ranks of a job share stderr: print() wrote the text and its newline apart, and two
    ranks' no-optimizer lines once ran together on one line."""
    from placement.errors import say

    class Stream:
        writes: list = []

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Stream())
    say("placement: rank 0: one line")
    assert Stream.writes == ["placement: rank 0: one line\n"]
