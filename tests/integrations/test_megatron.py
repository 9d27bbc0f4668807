"""placement.integrations.megatron with real megatron-core objects built on CPU (gloo), and the
examples/megatron_gpt.py training run alone and under placerun.

What megatron-core 0.16 cannot build or run on a CPU torch (GPTModel.forward's attention, the
schedules, DDP, FP32Optimizer.__init__'s CUDA loss scale) is what examples/megatron_gpt.py's CPU
mode steps around; its CpuFP32Optimizer is megatron's FP32Optimizer minus that one CUDA tensor.
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is the optional extra [megatron]")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from placement.errors import ConfigError  # noqa: E402
from placement.integrations.megatron import attach_megatron, torch_optimizers, watch_data_iterator  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "megatron_gpt.py"
VENV_BIN = Path(sys.executable).parent


def _load_example():
    spec = importlib.util.spec_from_file_location("megatron_gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _load_example()


@pytest.fixture(scope="module")
def megatron_world():
    """A one-rank gloo world with Megatron's parallel groups, as the example sets up."""
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    yield parallel_state
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _small_args(example, **kw):
    argv = ["--steps", "5", "--hidden-size", "32", "--seq-length", "16", "--micro-batch-size", "2",
            "--vocab-size", "64", "--workers", "0"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return example.parse_args(argv)


def test_torch_optimizers_unwraps_megatron_wrappers(example, megatron_world):
    from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig

    cfg = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0)
    a = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    b = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    fa, fb = example.CpuFP32Optimizer(a, cfg), example.CpuFP32Optimizer(b, cfg)
    chained = ChainedOptimizer([fa, fb])
    assert torch_optimizers(chained) == [a, b]
    assert torch_optimizers(fa) == [a] and torch_optimizers(a) == [a]
    assert torch_optimizers(ChainedOptimizer([example.CpuFP32Optimizer(None, cfg)])) == []  # a stub rank
    with pytest.raises(ConfigError, match="not a Megatron optimizer.*valid: MegatronOptimizer"):
        torch_optimizers(object())


@pytest.mark.slow
def test_attach_megatron_records_every_step(example, megatron_world, tmp_path):
    """Real GPTModel, MockGPTDataset iterator and Megatron FP32Optimizer: one record per
    optimizer.step(), each with the time blocked on the data iterator."""
    args = _small_args(example)
    torch.manual_seed(0)
    model = example.build_model(args)
    optimizer = example.CpuFP32Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                         example.OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0))
    before = model.embedding.word_embeddings.weight.detach().clone()
    log_dir = tmp_path / "logs"
    pm = attach_megatron(optimizer, example.train_data_iterator(args), model=model,
                         policy="none", monitor={"log_dir": str(log_dir), "flush_every": 1})
    assert pm.torch_optimizers == [optimizer.optimizer]
    for _ in range(args.steps):
        optimizer.zero_grad()
        example.cpu_loss(model, next(pm.data_iterator)).backward()
        success, grad_norm, _ = optimizer.step()  # Megatron's own return value passes through
        assert success and grad_norm is None
    pm.close()
    pm.close()  # idempotent
    assert "step" not in vars(optimizer), "close() restores the class's step()"
    assert not torch.equal(before, model.embedding.word_embeddings.weight), "the model trained"
    records = [json.loads(line) for line in (log_dir / "rank0.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, args.steps + 1))
    assert all(r["data_ms"] > 0 and r["step_ms"] > 0 for r in steps)
    assert all(r["roles"]["main"]["threads"] == 1 for r in steps)


def test_step_wrapper_lets_an_lr_scheduler_wrap_it(tmp_path):
    """A torch optimizer (the innermost case) with an LR scheduler created after attach: both
    wrappers work, and close() leaves the scheduler's in place."""
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([param], lr=1.0)
    pm = attach_megatron(opt, None, policy="none", monitor={"log_dir": str(tmp_path), "flush_every": 1})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5 ** epoch)
    for _ in range(3):
        opt.zero_grad()
        param.sum().backward()
        opt.step()
        sched.step()
    assert pm.handle.steps == 3 and opt.param_groups[0]["lr"] == 0.125
    scheduler_wrapper = vars(opt)["step"]
    pm.close()
    assert vars(opt)["step"] is scheduler_wrapper
    opt.step()  # still works, records nothing more
    assert pm.handle.steps == 3


def test_data_iterator_shapes(megatron_world, tmp_path):
    """None (ranks that load no data), one iterator, or one per virtual pipeline stage."""
    import placement

    with placement.attach(policy="none", monitor={"log_dir": str(tmp_path)}) as handle:
        assert watch_data_iterator(handle, None) is None
        wrapped = watch_data_iterator(handle, [iter(range(3)), iter("ab")])
        assert [list(w) for w in wrapped] == [[0, 1, 2], ["a", "b"]]
        assert next(watch_data_iterator(handle, iter([7]))) == 7


@pytest.fixture
def rerun_machine(megatron_world, monkeypatch):
    """megatron-core's RerunStateMachine in validate_results mode (Megatron-LM's default), installed
    as the global that RerunDataIterator.__next__ and Megatron-LM's train_step read.

    megatron-core 0.16.1's machine touches CUDA in three places only (rerun_state_machine.py):
    `_reduce_any` builds its flag tensor on 'cuda' (258, 265), `_save_state` / `_restore_state`
    keep the CUDA RNG (958, 969), and the failure log names torch.cuda.current_device() (566, 612).
    On this CPU torch, the flags are all-reduced over gloo, the CUDA RNG is empty and the device
    is 0; every other line (the iterator check at 921-923, the states, the replay) is its own."""
    from megatron.core import rerun_state_machine as rsm

    class CpuRerunStateMachine(rsm.RerunStateMachine):
        def _reduce_any(self, value):  # rerun_state_machine.py:251-267 with device="cpu"
            flags = torch.tensor(value if isinstance(value, list) else [value], dtype=torch.int32)
            dist.all_reduce(flags)
            return tuple(x > 0 for x in flags.tolist()) if isinstance(value, list) else flags.item() > 0

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **k: torch.empty(0, dtype=torch.uint8))
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    rsm.destroy_rerun_state_machine()
    machine = CpuRerunStateMachine(mode=rsm.RerunMode.VALIDATE_RESULTS)
    rsm._set_rerun_state_machine(machine)
    yield machine
    rsm.destroy_rerun_state_machine()


class CountingBatches:
    """The inner iterator Megatron-LM's RerunDataIterator wraps: counts the batches fetched."""

    def __init__(self, width: int):
        self.width = width
        self.fetched = 0

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        self.fetched += 1
        return torch.full((2, self.width), float(self.fetched))


def megatron_lm_train_step(machine, data_iterator, model, optimizer, microbatches: int, reject: bool) -> list:
    """Megatron-LM's train_step (megatron/training/training.py:3010-3200 at NVIDIA/Megatron-LM
    d98e8a64): `while rerun_state_machine.should_run_forward_backward(data_iterator)` around the
    forward-backward of every microbatch of every virtual-pipeline chunk, pretrain_gpt.py's loss_func
    validating each loss, then should_checkpoint_and_exit and optimizer.step. The batches taken
    are returned (a rerun takes them again)."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    chunks = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    taken = []
    while machine.should_run_forward_backward(data_iterator):
        optimizer.zero_grad()
        for _ in range(microbatches):
            for chunk in chunks:
                assert isinstance(chunk, RerunDataIterator)
                batch = next(chunk)
                taken.append(batch)
                loss = model(batch).pow(2).mean()
                machine.validate_result(result=loss, rejection_func=lambda _: reject, message="spiky loss",
                                        tolerance=0.0, fatal=False)
                loss.backward()
    should_checkpoint, should_exit, _ = machine.should_checkpoint_and_exit()
    assert not should_checkpoint and not should_exit
    optimizer.step()
    return taken


@pytest.mark.parametrize("chunks", [1, 2], ids=["one-iterator", "virtual-pipeline-list"])
def test_attach_megatron_under_megatron_lm_rerun_state_machine(rerun_machine, tmp_path, chunks):
    """Megatron-LM passes RerunDataIterators (one, or one per virtual pipeline chunk) to train_step;
    megatron-core's state machine asserts they are RerunDataIterators unless its mode is DISABLED.
    attach_megatron hands back the same objects with their inner iterators watched: the machine
    accepts them, a rejected loss reruns the step on the replayed microbatches (no new fetch), every
    optimizer step is one record with its data wait, and close() puts the inner iterators back."""
    from megatron.core.rerun_state_machine import RerunDataIterator, RerunState

    sources = [CountingBatches(4) for _ in range(chunks)]
    given = [RerunDataIterator(src) for src in sources]
    given_arg = given if chunks > 1 else given[0]
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    log_dir = tmp_path / "logs"
    chunk_list = [model] * chunks  # Megatron-LM's `model`: a list of chunks, several with a virtual pipeline
    pm = attach_megatron(optimizer, given_arg, model=chunk_list, policy="none",
                         monitor={"log_dir": str(log_dir), "flush_every": 1})
    microbatches, steps, rejected_step = 2, 4, 2
    per_step = []
    for step in range(1, steps + 1):
        per_step.append(megatron_lm_train_step(rerun_machine, pm.data_iterator, model, optimizer, microbatches,
                                               reject=step == rejected_step))
    handed_back = pm.data_iterator if chunks > 1 else [pm.data_iterator]
    assert all(a is b for a, b in zip(handed_back, given, strict=True)), \
        "the RerunDataIterator(s) Megatron-LM built come back as they were"
    assert all(d.iterable is not src for d, src in zip(given, sources)), "their inner iterators are watched"
    pm.close()

    per_run = microbatches * chunks
    assert [len(t) for t in per_step] == [per_run * (2 if s == rejected_step else 1) for s in range(1, steps + 1)]
    rerun = per_step[rejected_step - 1]
    assert all(a is b for a, b in zip(rerun[:per_run], rerun[per_run:])), "the rerun replayed the same microbatches"
    assert [src.fetched for src in sources] == [microbatches * steps] * chunks, "a replay fetches nothing new"
    assert rerun_machine.current_iteration == steps - 1 and rerun_machine.state == RerunState.NOT_RUNNING_YET
    assert [d.iterable for d in given] == sources, "close() puts the inner iterators back"
    records = _step_records(log_dir / "rank0.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1)), "one record per optimizer step, reruns included"
    assert all(r["data_ms"] > 0 for r in records)


def _run(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}", PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _step_records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "step"]


SMALL = ["--hidden-size", "64", "--seq-length", "32", "--micro-batch-size", "4", "--vocab-size", "128",
         "--workers", "1", "--log-every", "3"]


@pytest.mark.slow
def test_example_trains_alone_and_binds(tmp_path):
    """`python examples/megatron_gpt.py` without placerun: attach plans and binds this rank."""
    proc = _run([sys.executable, str(EXAMPLE), "--steps", "6", *SMALL], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step     6  loss" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "placement_logs" / "rank0.jsonl").read_text().splitlines()]
    assert len([r for r in records if r["type"] == "step"]) == 6
    main_binds = [r for r in records if r["type"] == "bind" and r.get("role") == "main"]
    assert main_binds and all(r["ok"] and r["applied"] == r["planned"] for r in main_binds)


@pytest.mark.slow
def test_example_under_placerun_two_ranks(tmp_path):
    """2 ranks under placerun on gloo: every rank records every step, with the gradient
    all-reduce timed as communication."""
    proc = _run([str(VENV_BIN / "placerun"), "--standalone", "--nproc-per-node", "2",
                 f"placement.monitor.log_dir={tmp_path / 'logs'}", str(EXAMPLE), "--steps", "6", *SMALL], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        steps = _step_records(tmp_path / "logs" / f"rank{rank}.jsonl")
        assert [r["step"] for r in steps] == list(range(1, 7))
        assert all(r["comm_count"] >= 1 and r["comm_inflight_ms"] > 0 for r in steps)


@pytest.mark.slow
def test_example_rejects_bad_arguments(tmp_path):
    proc = _run([sys.executable, str(EXAMPLE), "--steps", "0"], tmp_path)
    assert proc.returncode == 2 and "--steps=0 is not valid; valid: an integer >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr
    if not torch.cuda.is_available():
        proc = _run([sys.executable, str(EXAMPLE), "--tensor-model-parallel-size", "2"], tmp_path)
        assert proc.returncode == 2 and "needs CUDA; valid on CPU: 1" in proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: megatron-core's GPT forward, "
                    "schedules, DDP and optimizer run on CUDA only")
def test_example_gpu_schedule_records_steps(tmp_path):
    """The full megatron-core path: GPTModel.forward, DDP, get_megatron_optimizer, the schedule."""
    nproc = min(2, torch.cuda.device_count())
    proc = _run([str(VENV_BIN / "placerun"), "--standalone", "--nproc-per-node", str(nproc),
                 f"placement.monitor.log_dir={tmp_path / 'logs'}", str(EXAMPLE), "--steps", "6",
                 "--microbatches", "2", "--log-every", "3"], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GPU: megatron-core schedule" in proc.stdout
    for rank in range(nproc):
        assert [r["step"] for r in _step_records(tmp_path / "logs" / f"rank{rank}.jsonl")] == list(range(1, 7))
