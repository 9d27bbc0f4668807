"""Lightning and Transformers callbacks and an Accelerate loop, each in its example run as a real
2-process CPU job on gloo: Lightning under placerun and under its own launcher (it starts the second
process itself; attach binds each), a Transformers Trainer under placerun and under torchrun, the
Accelerate script under placerun and under `accelerate launch` (torchrun inside; attach binds each).
Each reads the rank logs back: one step record per optimizer step (gradient accumulation: 2
batches a step) with data wait and the DDP all-reduce time, and the binding read back from /proc
(bind events: applied == planned)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from placement.records.step import line_steps
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
        # every optimizer step once, in order (a record may hold several: records/step.py)
        assert [n for s in steps for n in line_steps(s)] == list(range(1, STEPS + 1)), "one step per optimizer step"
        assert all(s["data_ms"] > 0 for s in steps)
        assert all(s["comm_count"] >= 1 and s["comm_inflight_ms"] > 0 for s in steps), "the DDP all-reduces are timed"
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
def test_lightning_ddp_under_placerun(tmp_path):
    """placerun's workers carry torchrun's environment (TORCHELASTIC_RUN_ID among it), so Lightning picks
    TorchElasticEnvironment (lightning/fabric/plugins/environments/torchelastic.py:56-59, chosen first in
    lightning/pytorch/trainer/connectors/accelerator_connector.py:386-398), whose processes are created
    externally: its launcher starts no process of its own (lightning/pytorch/strategies/launchers/
    subprocess_script.py:100; lightning 2.6.6). The callback's attach() joins each rank's placerun Session:
    the example's --log-dir is placerun's, so the step records go to the log stage 1 opened."""
    pytest.importorskip("lightning", reason="the optional extra [lightning]")
    logs = tmp_path / "logs"
    p = _run([*launcher("placerun"), "--standalone", "--nproc-per-node", "2", f"placement.monitor.log_dir={logs}",
              str(EXAMPLES / "lightning_ddp.py"), "--steps", str(STEPS), "--log-dir", str(logs)], tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    _check_rank_logs(logs, entry="placerun")


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


@pytest.mark.slow
def test_accelerate_script_under_placerun(tmp_path):
    pytest.importorskip("accelerate", reason="the optional extra [accelerate]")
    logs = tmp_path / "logs"
    p = _run([*launcher("placerun"), "--standalone", "--nproc-per-node", "2", f"placement.monitor.log_dir={logs}",
              str(EXAMPLES / "accelerate_train.py"), "--steps", str(STEPS)], tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    _check_rank_logs(logs, entry="placerun")


@pytest.mark.slow
def test_accelerate_script_under_accelerate_launch(tmp_path):
    """`accelerate launch --multi_gpu` is torch.distributed.run underneath (accelerate/commands/launch.py,
    multi_gpu_launcher); the script's Accelerator(cpu=True) runs gloo there on a machine without GPUs.
    attach() plans and binds each process from inside it."""
    pytest.importorskip("accelerate", reason="the optional extra [accelerate]")
    logs = tmp_path / "logs"
    # accelerate's own module for `accelerate launch`: no console script needed on PATH.
    p = _run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
              str(EXAMPLES / "accelerate_train.py"), "--steps", str(STEPS), "--log-dir", str(logs)], tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    _check_rank_logs(logs, entry="attach")


@pytest.mark.parametrize("preset", [None, "3"])
@pytest.mark.parametrize("fails", [False, True])
def test_lightning_callback_puts_local_world_size_back(tmp_path, monkeypatch, preset, fails):
    """The callback sets LOCAL_WORLD_SIZE for attach() when no launcher did (Lightning's own launcher
    does not); after fit, or a fit that raised, the environment is as it was."""
    pytest.importorskip("lightning", reason="the optional extra [lightning]")
    import torch
    from lightning.pytorch import LightningModule, Trainer

    from placement.integrations.lightning import PlacementCallback

    if preset is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", preset)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    seen = []

    class Tiny(LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            seen.append(os.environ.get("LOCAL_WORLD_SIZE"))
            if fails:
                raise RuntimeError("boom")
            return self.net(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callback = PlacementCallback(policy="none", tune={"enabled": False}, monitor={"log_dir": str(tmp_path)})
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[callback], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
    if fails:
        with pytest.raises(RuntimeError, match="boom"):
            trainer.fit(Tiny(), loader)
    else:
        trainer.fit(Tiny(), loader)
    assert seen and set(seen) == {preset or "1"}, "set for attach() during the fit, a value given kept"
    assert os.environ.get("LOCAL_WORLD_SIZE") == preset
    assert callback.handle is None


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


def test_lightning_dispatches_no_hook_of_the_callback_at_a_step(tmp_path):
    """Lightning wraps each callable hook of each callback in its profiler; the callback's unused
    hooks are None, and it uses none at a step: a record still ends at each optimizer step, with
    the time the fetches took (a dataset that sleeps in __getitem__) as its data wait."""
    pytest.importorskip("lightning", reason="the optional extra [lightning]")
    import time

    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.profilers import Profiler
    from torch.utils.data import dataloader

    from placement.integrations.lightning import PlacementCallback

    class Names(Profiler):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def start(self, action_name):
            self.names.append(action_name)

        def stop(self, action_name):
            pass

        def summary(self):
            return ""

    class Tiny(LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    nap_s = 0.02

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            time.sleep(nap_s / 2)  # two items a batch
            return torch.ones(4)

    own = dataloader._BaseDataLoaderIter.__next__, dataloader.DataLoader.__iter__
    steps = 6
    callback = PlacementCallback(policy="none", tune={"enabled": False}, monitor={"log_dir": str(tmp_path)})
    profiler = Names()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[callback], logger=False, profiler=profiler,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(Slow(), batch_size=2))
    ours = [n.rsplit(".", 1)[1] for n in profiler.names if n.startswith("[Callback]PlacementCallback")]
    assert "on_fit_start" in ours and "on_fit_end" in ours
    assert not [h for h in ours if "batch" in h or "backward" in h or "optimizer" in h or "zero_grad" in h], ours
    events = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    steps_logged = [e for e in events if e["type"] == "step"]
    assert [n for s in steps_logged for n in line_steps(s)] == list(range(1, steps + 1)), "a step per optimizer step"
    assert all(s["data_ms"] >= 0.9 * nap_s * 1e3 for s in steps_logged), [s["data_ms"] for s in steps_logged]
    assert (dataloader._BaseDataLoaderIter.__next__, dataloader.DataLoader.__iter__) == own, "put back at fit end"


def test_fetch_wait_times_the_training_threads_fetches_only(tmp_path):
    """FetchWait adds the calling thread's fetches to the data wait, not another thread's; stop()
    puts the classes' own methods back, and one patched over it is left alone."""
    import threading

    import torch
    from torch.utils.data import dataloader

    from placement.integrations._steps import FetchWait

    class Counter:
        data_ns = 0

    monitor = Counter()
    own_next = dataloader._BaseDataLoaderIter.__next__
    wait = FetchWait(monitor)
    loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
    other = threading.Thread(target=lambda: list(loader))
    other.start()
    other.join(timeout=60)
    assert not other.is_alive() and monitor.data_ns == 0, "another thread's fetches are not timed"
    assert len(list(loader)) == 4 and monitor.data_ns > 0
    wait.stop()
    assert dataloader._BaseDataLoaderIter.__next__ is own_next
    seen = monitor.data_ns
    list(loader)
    assert monitor.data_ns == seen

    wait = FetchWait(monitor)
    ours = dataloader._BaseDataLoaderIter.__next__
    def over(it):
        return ours(it)
    dataloader._BaseDataLoaderIter.__next__ = over
    try:
        wait.stop()
        assert dataloader._BaseDataLoaderIter.__next__ is over, "a method patched over ours is left"
        list(loader)
        assert monitor.data_ns == seen, "ours passes straight through once stopped"
    finally:
        dataloader._BaseDataLoaderIter.__next__ = own_next
        dataloader.DataLoader.__iter__ = wait._patches[1][2]


@pytest.mark.parametrize("automatic", [True, False])
def test_lightning_without_an_optimizer_makes_a_batch_a_step(tmp_path, automatic):
    """configure_optimizers returns None: Lightning's automatic optimization steps a stand-in
    optimizer (its post-step hook ends the record), manual optimization steps nothing, and the
    callback ends a record at each batch's end instead. One record per batch either way."""
    pytest.importorskip("lightning", reason="the optional extra [lightning]")
    import torch
    from lightning.pytorch import LightningModule, Trainer

    from placement.integrations.lightning import PlacementCallback

    class NoOptimizer(LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.automatic_optimization = automatic

        def training_step(self, batch, batch_idx):
            return self.net(batch).sum()

        def configure_optimizers(self):
            return None

    callback = PlacementCallback(policy="none", tune={"enabled": False}, monitor={"log_dir": str(tmp_path)})
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=5, callbacks=[callback],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(NoOptimizer(), torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=2))
    events = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [n for e in events if e["type"] == "step" for n in line_steps(e)] == [1, 2, 3, 4, 5]
