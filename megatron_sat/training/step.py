"""Model wrapping, the optimizer and one optimizer step, on Megatron-Core primitives.

The loss is a per-token sum: each micro-batch returns (sum of token losses, token count) and
Megatron divides the gradients by the total token count of the step over all micro-batches and
data-parallel ranks (config.calculate_per_token_loss). So the step's loss and gradients do not
depend on how the global batch is split into micro-batches or data-parallel ranks, which is what
makes every layout give the same numbers.
"""

import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Iterator, List, Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_sat.model.gpt import build_model
from megatron_sat.parallel.grads import finalize_grads
from megatron_sat.parallel.pipeline import forward_backward
from megatron_sat.training import optimizer_resume


def wrap_ddp(chunks, config, use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False,
             overlap_param_gather: bool = False, grad_reduce_in_fp32: bool = True):
    """Megatron DDP around each chunk (gradient buffers, DP all-reduce) and the config hooks. overlap_param_gather
    (distributed optimizer only) is DistributedDataParallelConfig's; grad_reduce_in_fp32: the gradient buffer
    (micro-batch accumulation and the DP reduction) in fp32, else in the parameters' dtype (--grad-reduce-in-bf16)."""
    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = finalize_grads
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather and use_distributed_optimizer,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def build_optimizer(chunks, *, lr: float, min_lr: float = 0.0, weight_decay: float = 0.1,
                    clip_grad: float = 1.0, betas=(0.9, 0.95), eps: float = 1e-8,
                    bf16: bool = False, use_distributed_optimizer: bool = False, weight_decay_params: str = "matrices",
                    fp16: Optional[dict] = None, decoupled_lr: Optional[float] = None,
                    decoupled_min_lr: Optional[float] = None):
    """Megatron's AdamW (Apex/TE fused when present, torch's otherwise) with gradient clipping.

    weight_decay_params: 'matrices' is Megatron's rule (1-D tensors and biases are not decayed); 'all' decays
    every tensor, as the SATFormer authors' AdamW(model.parameters(), weight_decay=0.1) does (norms, QK-norms,
    ResFormer's lambdas, the baselines' connection weights).
    fp16: train fp16 parameters with loss scaling, {loss_scale, initial_loss_scale, min_loss_scale,
    loss_scale_window, hysteresis} (Megatron-LM's flags; loss_scale None: megatron-core's DynamicGradScaler)."""
    if weight_decay_params not in ("matrices", "all"):
        raise ValueError(f"weight_decay_params must be 'matrices' or 'all', not {weight_decay_params!r}")
    if use_distributed_optimizer:
        optimizer_resume.apply()  # torch's AdamW under the distributed optimizer resumes exactly (CPU or GPU)
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=eps,
        clip_grad=clip_grad,
        bf16=bf16,
        fp16=fp16 is not None,
        params_dtype=torch.bfloat16 if bf16 else torch.float16 if fp16 is not None else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
        **(fp16 or {}),
        decoupled_lr=decoupled_lr,  # the embedding's and output layer's own peak and minimum LR (None: --lr's)
        decoupled_min_lr=decoupled_min_lr,
    )
    # Megatron-Core's standard overrides are exactly its no-decay rule; an empty set of overrides decays everything
    return get_megatron_optimizer(config, chunks, config_overrides={} if weight_decay_params == "all" else None)


def count_chunk_parameters(chunks) -> int:
    """The model's parameters over all ranks, each counted once (shared embeddings and TP duplicates too)."""
    local = sum(p.numel() for c in chunks for p in c.parameters()
                if not getattr(p, "shared", False) and param_is_not_tensor_parallel_duplicate(p))
    total = torch.tensor([float(local if parallel_state.get_data_parallel_rank() == 0 else 0)], dtype=torch.float64)
    torch.distributed.all_reduce(total)  # every (TP, PP) rank of data-parallel replica 0, once each
    return int(total.item())


def setup_model_and_optimizer(config, *, vocab_size: int, max_sequence_length: int, rotary_base: int = 10000,
                              backend: Optional[str] = None, use_distributed_optimizer: bool = False,
                              overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                              grad_reduce_in_fp32: bool = True, share_embeddings_and_output_weights: bool = True,
                              **optimizer_kwargs):
    """The model (its chunks on this rank) wrapped as it trains, and its optimizer.

    Returns (chunks, parameter count over all ranks, optimizer): GPTModel -> Float16Module under BF16 ->
    Megatron DDP (grad_reduce_in_fp32: see wrap_ddp). optimizer_kwargs go to build_optimizer (lr, min_lr,
    weight_decay, clip_grad, betas, eps)."""
    chunks = build_model(config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                         rotary_base=rotary_base, backend=backend,
                         share_embeddings_and_output_weights=share_embeddings_and_output_weights)
    num_params = count_chunk_parameters(chunks)
    if config.bf16 or config.fp16:
        chunks = [Float16Module(config, c) for c in chunks]
    chunks = wrap_ddp(chunks, config, use_distributed_optimizer=use_distributed_optimizer,
                      overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
                      grad_reduce_in_fp32=grad_reduce_in_fp32)
    fp16 = optimizer_kwargs.pop("fp16", None)
    if config.fp16 and fp16 is None:
        fp16 = {}  # megatron-core's loss-scale defaults (Megatron-LM's): the profilers build without the trainer's flags
    optimizer = build_optimizer(chunks, bf16=config.bf16, use_distributed_optimizer=use_distributed_optimizer,
                                fp16=fp16, **optimizer_kwargs)
    if config.fp16:  # the schedules multiply each micro-batch's loss by the loss scale before its backward
        config.grad_scale_func = optimizer.scale_loss
        make_optimizer_state(optimizer)
    return chunks, num_params, optimizer


def make_optimizer_state(optimizer) -> None:
    """Give every parameter the optimizer state its first step would make (zero moments; torch's Adam also step 0).

    Under fp16 the first steps are skipped until the loss scale fits, and Adam makes its state only at its first
    update: a checkpoint saved before it held no moments, and its resume failed (megatron-core's sharded state
    expects them). megatron-core's own init_state_fn makes the moments; torch's Adam also needs its `step`, which
    no library call makes (written here: the value torch makes lazily, so the first real update is unchanged)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner, init = opt.optimizer, getattr(opt, "init_state_fn", None)
        if init is None:
            continue
        fresh = [p for group in inner.param_groups for p in group["params"] if not inner.state[p]]
        init(inner, opt.config)
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for p in fresh:
                inner.state[p]["step"] = torch.tensor(0.0)


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)  # [b*s] per-token cross entropy
    mask = loss_mask.float().view(-1)
    total = torch.sum(losses * mask)
    count = mask.sum().to(torch.int)
    return total, count, {"lm loss": torch.stack([total.detach(), mask.sum()])}


def this_cp_rank(batch: dict) -> dict:
    """Context parallelism: this rank's share of every sequence (Megatron's zigzag split into
    2 x CP chunks, which balances causal attention work); the batch itself without CP."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return batch
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    return get_batch_on_this_cp_rank({**{k: batch[k] for k in keys}, "cu_seqlens": None}, is_hybrid_cp=False,
                                     cp_group=parallel_state.get_context_parallel_group())


def gpt_forward_step(data_iterator: Iterator, model):
    """Megatron forward_step_func for a batch dict with tokens, labels, loss_mask, position_ids."""
    batch = this_cp_rank(next(data_iterator))
    device = next(model.parameters()).device
    tokens = batch["tokens"].to(device, non_blocking=True)  # [b, s]
    labels = batch["labels"].to(device, non_blocking=True)  # [b, s]
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    output = model(tokens, position_ids, None, labels=labels)  # [b, s] losses (last stage)
    return output, partial(_loss_func, batch["loss_mask"].to(device))


class NonFiniteLoss(RuntimeError):
    """The step's loss or gradient norm is NaN/Inf (raised before the optimizer touches the weights)."""


@dataclass
class StepResult:
    """One training step, the same on every rank."""

    loss: float                 # mean token loss over the step's micro-batches and data-parallel ranks
    grad_norm: Optional[float]  # after the optimizer's all-reduce, before clipping
    lr: float                   # the learning rate this step used
    success: bool               # the optimizer took the step
    stop_signals: int           # ranks that asked to stop (a signal), summed over the world
    time_up: bool               # some rank passed its time limit
    forward_backward_s: float = 0.0  # this rank's wall time in forward-backward (data loading inside it included)
    optimizer_s: float = 0.0         # in the optimizer step (clipping, the distributed optimizer's gathers)


def train_step(chunks, optimizer, config, data_iterator, *, num_microbatches: int, seq_length: int,
               micro_batch_size: int, scheduler=None, forward_step_func=gpt_forward_step,
               stop_requested: bool = False, time_up: bool = False, scheduler_increment: float = 1,
               sync_timers: bool = False) -> StepResult:
    """One optimizer step: forward/backward over the schedule, one world all-reduce of the loss and the stop
    flags, the NaN/Inf check, the optimizer step (clipping inside), the LR scheduler step.

    scheduler_increment: how far the LR schedule advances, in steps of the full global batch (below 1 while
    --rampup-batch-size ramps: Megatron-LM's schedule counts samples). The trainer, the profiler and the tests all
    step through here. sync_timers: synchronise the GPU around the phases so that their times are the kernels'
    (--log-timers-to-tensorboard; the CPU needs none)."""
    sync = torch.cuda.synchronize if sync_timers and torch.cuda.is_available() else (lambda: None)
    t0 = time.perf_counter()
    loss_dicts = run_forward_backward(chunks, optimizer, config, data_iterator, num_microbatches=num_microbatches,
                                      seq_length=seq_length, micro_batch_size=micro_batch_size,
                                      forward_step_func=forward_step_func)
    device = next(p for c in chunks for p in c.parameters()).device
    loss_sum, count, signals, late = loss_sum_and_count(loss_dicts, device, (float(stop_requested), float(time_up)))
    loss = loss_sum / max(count, 1.0)
    if not math.isfinite(loss):
        raise NonFiniteLoss(f"loss is {loss}")
    lr = optimizer.param_groups[0]["lr"]
    sync()
    t1 = time.perf_counter()
    success, grad_norm, _ = optimizer.step()  # fp16: success False when the scaled gradients overflowed
    sync()
    t2 = time.perf_counter()
    if grad_norm is not None and not math.isfinite(grad_norm):
        raise NonFiniteLoss(f"gradient norm is {grad_norm}")
    if scheduler is not None and success:  # a skipped step does not advance the schedule (as Megatron-LM)
        scheduler.step(increment=scheduler_increment)
    return StepResult(loss=loss, grad_norm=grad_norm, lr=lr, success=bool(success), stop_signals=int(signals),
                      time_up=late > 0, forward_backward_s=t1 - t0, optimizer_s=t2 - t1)


def evaluate(chunks, optimizer, config, data_iterator, *, iterations: int, num_microbatches: int, seq_length: int,
             micro_batch_size: int, progress=None) -> float:
    """Mean token loss of `iterations` forward-only steps (the same on every rank); progress(i) before pass i
    (the trainer's hang watchdog)."""
    for c in chunks:
        c.eval()
    total = torch.zeros(2, dtype=torch.float64)
    device = next(p for c in chunks for p in c.parameters()).device
    with torch.no_grad():
        for i in range(iterations):
            if progress is not None:
                progress(i)
            dicts = run_forward_backward(chunks, optimizer, config, data_iterator, num_microbatches=num_microbatches,
                                         seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=True)
            total += torch.tensor(loss_sum_and_count(dicts, device)[:2], dtype=torch.float64)
    for c in chunks:
        c.train()
    return (total[0] / total[1]).item()


def run_forward_backward(chunks, optimizer, config, data_iterator, *, num_microbatches: int, seq_length: int,
                         micro_batch_size: int, forward_step_func=gpt_forward_step, forward_only: bool = False):
    """The forward (and backward) passes of one step, without the optimizer step; Megatron's loss dicts."""
    if not forward_only:
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
    return forward_backward(
        chunks, config,
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def loss_sum_and_count(loss_dicts: List[dict], device, extras: Sequence[float] = ()) -> torch.Tensor:
    """[loss sum, token count, *extras] summed over the whole world, the same on every rank.

    Only last-stage ranks of TP (and CP) rank 0 contribute the loss, so its sum is over DP ranks only;
    `extras` (e.g. stop flags) are summed over all ranks, at no cost beyond the one all-reduce.
    """
    out = torch.zeros(2 + len(extras), dtype=torch.float64, device=device)
    contributes = (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                   and parallel_state.get_tensor_model_parallel_rank() == 0
                   and parallel_state.get_context_parallel_rank() == 0)
    if loss_dicts and contributes:
        out[:2] = torch.stack([d["lm loss"] for d in loss_dicts]).sum(0).double()
    if extras:
        out[2:] = torch.tensor(list(extras), dtype=torch.float64)
    torch.distributed.all_reduce(out)
    return out.tolist()
