"""Lightning and Transformers callbacks, each in its example run as a real 2-process CPU job on gloo:
Lightning's own launcher (it starts the second process itself; attach binds each), a Transformers
Trainer under placerun and under torchrun. Each reads the rank logs back: one step record per
optimizer step (gradient accumulation: 2 batches a step) with data wait and the DDP all-reduce time,
and the binding read back from /proc (bind events: applied == planned)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from placerun_helpers import REPO, launcher

EXAMPLES = REPO / "examples"
STEPS = 6


def _run(cmd: list[str], cwd: Path, timeout: int = 400) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLACEMENT_", "OMP_NUM_THREADS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _check_rank_logs(log_dir: Path, entry: str) -> None:
    for rank in (0, 1):
        events = [json.loads(line) for line in (log_dir / f"rank{rank}.jsonl").read_text().splitlines()]
        steps = [e for e in events if e["type"] == "step"]
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), "one record per optimizer step"
        assert all(s["data_ms"] > 0 for s in steps)
        assert all(s["comm_count"] >= 1 and s["comm_ms"] > 0 for s in steps), "the DDP all-reduces are timed"
        monitor = next(e for e in events if e["type"] == "start" and e.get("source") == "monitor")
        assert monitor["ddp_hook"], "the DDP model was found and hooked"
        (stage1,) = [e for e in events if e["type"] == "start" and e.get("entry")]
        assert stage1["entry"] == entry
        mains = [e for e in events if e["type"] == "bind" and e.get("role") == "main"]
        assert mains and all(e["ok"] and e["applied"] == e["planned"] for e in mains)
        assert set(mains[0]["applied"]) == set(stage1["plan"]["roles"]["main"]["cpus"])


@pytest.mark.slow
def test_lightning_ddp_under_lightnings_own_launcher(tmp_path):
    pytest.importorskip("lightning", reason="the optional extra [lightning]")
    logs = tmp_path / "logs"
    p = _run([sys.executable, str(EXAMPLES / "lightning_ddp.py"), "--steps", str(STEPS), "--log-dir", str(logs)],
             tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    _check_rank_logs(logs, entry="attach")


@pytest.mark.slow
def test_transformers_trainer_under_placerun(tmp_path):
    pytest.importorskip("transformers", reason="the optional extra [transformers]")
    logs = tmp_path / "logs"
    p = _run([*launcher("placerun"), "--standalone", "--nproc-per-node", "2", f"placement.monitor.log_dir={logs}",
              str(EXAMPLES / "transformers_trainer.py"), "--steps", str(STEPS), "--output-dir", str(tmp_path / "out")],
             tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    _check_rank_logs(logs, entry="placerun")


@pytest.mark.slow
def test_transformers_trainer_under_torchrun_logs_in_its_output_dir(tmp_path):
    pytest.importorskip("transformers", reason="the optional extra [transformers]")
    out = tmp_path / "out"
    p = _run([*launcher("torchrun"), "--standalone", "--nproc-per-node", "2",
              str(EXAMPLES / "transformers_trainer.py"), "--steps", str(STEPS), "--output-dir", str(out)], tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    _check_rank_logs(out / "placement_logs", entry="attach")


@pytest.mark.parametrize("module, extra", [("lightning", "lightning"), ("transformers", "transformers")])
def test_a_missing_framework_is_one_line_naming_the_extra(module, extra):
    """`import placement` never imports a framework; the integration without it says what to install."""
    blocked = "lightning", "pytorch_lightning", "transformers"
    code = ("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked) +
            "import placement, placement.attach_api, placement.integrations.megatron\n"
            f"import placement.integrations.{module}\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (
        f"ImportError: placement.integrations.{module} needs "
        f"{'PyTorch Lightning' if module == 'lightning' else 'Hugging Face Transformers'}: "
        f"pip install 'placement[{extra}]'")
