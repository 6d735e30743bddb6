"""Model wrapping, the optimizer and one optimizer step, on Megatron-Core primitives.

The loss is a per-token sum: each micro-batch returns (sum of token losses, token count) and
Megatron divides the gradients by the total token count of the step over all micro-batches and
data-parallel ranks (config.calculate_per_token_loss). So the step's loss and gradients do not
depend on how the global batch is split into micro-batches or data-parallel ranks, which is what
makes every layout give the same numbers.
"""

from functools import partial
from typing import Iterator, List, Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_sat.parallel.grads import finalize_grads
from megatron_sat.parallel.pipeline import forward_backward


def wrap_ddp(chunks, config, use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False):
    """Megatron DDP around each chunk (gradient buffers, DP all-reduce) and the config hooks."""
    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = finalize_grads
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def build_optimizer(chunks, *, lr: float, min_lr: float = 0.0, weight_decay: float = 0.1,
                    clip_grad: float = 1.0, betas=(0.9, 0.95), eps: float = 1e-8,
                    bf16: bool = False, use_distributed_optimizer: bool = False):
    """Megatron's AdamW (Apex/TE fused when present, torch's otherwise) with gradient clipping."""
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
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, chunks)


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


def reduce_loss(loss_dicts: List[dict]) -> Optional[float]:
    """Mean token loss of the step over micro-batches and DP ranks (last stage; None elsewhere)."""
    if not loss_dicts:
        return None
    total = torch.stack([d["lm loss"] for d in loss_dicts]).sum(0)  # [2] = (sum, count)
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return (total[0] / total[1].clamp(min=1)).item()


def train_step(chunks, optimizer, config, data_iterator, *, num_microbatches: int, seq_length: int,
               micro_batch_size: int, forward_step_func=gpt_forward_step) -> Tuple[Optional[float], float, bool]:
    """One optimizer step: returns (loss on the last pipeline stage else None, grad norm, success)."""
    loss_dicts = run_forward_backward(chunks, optimizer, config, data_iterator, num_microbatches=num_microbatches,
                                      seq_length=seq_length, micro_batch_size=micro_batch_size,
                                      forward_step_func=forward_step_func)
    success, grad_norm, _ = optimizer.step()
    return reduce_loss(loss_dicts), grad_norm, success


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


def loss_sum_and_count(loss_dicts: List[dict], device, extra: float = 0.0) -> torch.Tensor:
    """[loss sum, token count, extra] summed over the whole world, the same on every rank.

    Only last-stage ranks of TP (and CP) rank 0 contribute, so the sum is over DP ranks only; `extra`
    is summed over all ranks (e.g. a stop flag), which costs nothing more than the one all-reduce.
    """
    out = torch.zeros(3, dtype=torch.float64, device=device)  # [sum, count, extra]
    contributes = (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                   and parallel_state.get_tensor_model_parallel_rank() == 0
                   and parallel_state.get_context_parallel_rank() == 0)
    if loss_dicts and contributes:
        out[:2] = torch.stack([d["lm loss"] for d in loss_dicts]).sum(0).double()
    out[2] = extra
    torch.distributed.all_reduce(out)
    return out
