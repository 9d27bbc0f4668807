"""Train a small GPT built from megatron-core under placerun, with per-step placement records.

    placerun --standalone --nproc-per-node 8 examples/megatron_gpt.py --steps 200      # GPUs
    placerun --standalone --nproc-per-node 2 examples/megatron_gpt.py --steps 50       # CPU, gloo
    python examples/megatron_gpt.py --steps 20                                         # one rank

One line hooks placement into the loop: attach_megatron(optimizer, data_iterator, model=model).

On GPUs it is megatron-core's own training loop: GPTModel with the local layer spec, Megatron's
DistributedDataParallel, get_megatron_optimizer and the forward/backward schedule over NCCL.

On CPU (torch CPU build, gloo) megatron-core 0.16 stops short of a full GPT step:
GPTModel.forward needs CUDA (DotProductAttention allocates its score buffer on
torch.cuda.current_device()), and so do the schedules (get_forward_backward_func),
DistributedDataParallel, FP32Optimizer.__init__ (its loss scale is a CUDA tensor) and gradient
clipping. So the CPU mode trains the same GPTModel's embedding, per-layer pre-MLP layernorm and
MLP, final layernorm, output layer and Megatron's language-model loss (self-attention skipped),
averages gradients over the data-parallel group in one gloo all-reduce, and steps megatron-core's
FP32Optimizer (built without the CUDA line). Data comes from megatron-core's MockGPTDataset.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

# megatron-core says at import which optional kernels (Transformer Engine, Apex) it falls back from.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
warnings.filterwarnings("ignore", message="full scope is deprecated")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer import FP32Optimizer, MegatronOptimizer, OptimizerConfig  # noqa: E402
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from placement.integrations.megatron import attach_megatron  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=1, help="gradient accumulation steps (GPU schedule)")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="CPU mode even when CUDA is available")
    args = p.parse_args(argv)
    for name in ("steps", "micro_batch_size", "microbatches", "seq_length", "num_layers", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} is not valid; valid: an integer >= 1")
    if args.workers < 0:
        p.error(f"--workers={args.workers} is not valid; valid: an integer >= 0")
    return args


def initialize_distributed(use_cuda: bool, tp: int) -> None:
    """torch.distributed from placerun/torchrun's env (or a one-rank group), then Megatron's groups."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(args: argparse.Namespace) -> GPTModel:
    config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                               num_attention_heads=args.num_attention_heads, use_cpu_initialization=True,
                               pipeline_dtype=torch.float32,
                               tensor_model_parallel_size=args.tensor_model_parallel_size)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=args.vocab_size, max_sequence_length=args.seq_length)


def train_data_iterator(args: argparse.Namespace):
    """megatron-core's MockGPTDataset, sharded over the data-parallel ranks by a DataLoader."""
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    samples = args.steps * args.microbatches * args.micro_batch_size * dp_size
    config = GPTDatasetConfig(random_seed=0, sequence_length=args.seq_length, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False,
                              tokenizer=NullTokenizer(vocab_size=args.vocab_size - 1),
                              mid_level_dataset_surplus=0.005)
    train, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [samples, None, None], lambda: True, config).build()
    sampler = torch.utils.data.distributed.DistributedSampler(train, num_replicas=dp_size, rank=dp_rank, seed=0)
    loader = torch.utils.data.DataLoader(train, batch_size=args.micro_batch_size, sampler=sampler,
                                         num_workers=args.workers, persistent_workers=args.workers > 0,
                                         drop_last=True)
    return iter(loader)


def masked_mean(losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    loss_mask = loss_mask.view(-1).float()
    return torch.sum(losses.view(-1).float() * loss_mask) / loss_mask.sum()


# ---------------------------------------------------------------------------- GPU: megatron's loop


def train_gpu(args: argparse.Namespace, model: GPTModel, log) -> None:
    from functools import partial

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    model.cuda()
    ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=False))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, clip_grad=1.0), [ddp])
    data = train_data_iterator(args)
    forward_backward = get_forward_backward_func()

    def forward_step(data_iterator, model):
        batch = {k: v.cuda(non_blocking=True) for k, v in next(data_iterator).items()}
        out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

        def loss_func(output_tensor):
            loss = masked_mean(output_tensor, batch["loss_mask"])
            return loss, {"lm loss": loss.detach()}

        return out, partial(loss_func)

    with attach_megatron(optimizer, data, model=ddp) as pm:
        for step in range(1, args.steps + 1):
            optimizer.zero_grad()
            ddp.zero_grad_buffer()
            losses = forward_backward(forward_step_func=forward_step, data_iterator=pm.data_iterator, model=ddp,
                                      num_microbatches=args.microbatches, seq_length=args.seq_length,
                                      micro_batch_size=args.micro_batch_size, forward_only=False)
            finalize_model_grads([ddp])
            optimizer.step()  # also ends this step's placement record
            if step % args.log_every == 0 and losses:
                log(step, sum(float(x["lm loss"]) for x in losses) / len(losses))


# ---------------------------------------------------------------------------- CPU: as far as it goes


class CpuFP32Optimizer(FP32Optimizer):
    """megatron-core's FP32Optimizer (prepare_grads, step_with_ready_grads, step, state_dict, ...)
    built without its __init__'s one CUDA tensor, the constant loss scale 1.0."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig):
        MegatronOptimizer.__init__(self, optimizer, config, lambda _: None)
        self._scale = torch.tensor([1.0])
        self.is_stub_optimizer = optimizer is None


def cpu_loss(model: GPTModel, batch: dict) -> torch.Tensor:
    """GPTModel.forward without self-attention, through the model's own modules."""
    hidden = model.embedding(input_ids=batch["tokens"], position_ids=batch["position_ids"])
    for layer in model.decoder.layers:
        out, bias = layer.mlp(layer.pre_mlp_layernorm(hidden))
        hidden = hidden + out + (bias if bias is not None else 0)
    logits, _ = model.output_layer(model.decoder.final_layernorm(hidden))
    return masked_mean(model.compute_language_model_loss(batch["labels"], logits), batch["loss_mask"])


def average_gradients(model: GPTModel) -> None:
    """What Megatron's DistributedDataParallel does on GPUs: one all-reduce of the flat gradients
    over the data-parallel group, divided by its size."""
    group = parallel_state.get_data_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def train_cpu(args: argparse.Namespace, model: GPTModel, log) -> None:
    torch.manual_seed(1234)
    # clip_grad=0: Megatron's gradient-norm code allocates on CUDA.
    optimizer = CpuFP32Optimizer(torch.optim.Adam(model.parameters(), lr=args.lr),
                                 OptimizerConfig(optimizer="adam", lr=args.lr, clip_grad=0.0))
    data = train_data_iterator(args)
    with attach_megatron(optimizer, data, model=model) as pm:
        for step in range(1, args.steps + 1):
            optimizer.zero_grad()
            loss = cpu_loss(model, next(pm.data_iterator))
            loss.backward()
            average_gradients(model)
            optimizer.step()  # also ends this step's placement record
            if step % args.log_every == 0:
                log(step, loss.item())


def main(argv=None) -> int:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available() and not args.cpu
    if not use_cuda and args.tensor_model_parallel_size != 1:
        print(f"megatron_gpt.py: --tensor-model-parallel-size={args.tensor_model_parallel_size} needs CUDA; "
              "valid on CPU: 1", file=sys.stderr)
        return 2
    initialize_distributed(use_cuda, args.tensor_model_parallel_size)
    rank = dist.get_rank()
    t0 = time.perf_counter()

    def log(step: int, loss: float) -> None:
        if rank == 0:
            print(f"step {step:5d}  loss {loss:.4f}  {(time.perf_counter() - t0) / step * 1e3:.1f} ms/step", flush=True)

    if rank == 0:
        mode = "GPU: megatron-core schedule, DDP and optimizer" if use_cuda else (
            "CPU: GPT without self-attention (megatron-core needs CUDA for it), gloo, megatron FP32Optimizer")
        print(f"megatron_gpt: {dist.get_world_size()} ranks, {mode}", flush=True)
    try:
        model = build_model(args)
        (train_gpu if use_cuda else train_cpu)(args, model, log)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
