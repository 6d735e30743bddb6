"""Gradient finalisation: Megatron's, plus ResFormer's lambdas, which Megatron cannot know about.

Tensor parallelism: each TP rank mixes only its own KV heads, so the gradient of a lambda
(replicated on every TP rank) is a partial sum over heads; parameters flagged `tp_partial_grad`
are summed over the TP group. (Megatron sums replicated weights over TP only for sequence
parallelism and QK-norm, by name.)

Pipeline parallelism:
ResFormer's learned lambda1 = s * softmax(logits) couples every layer, so (logits, s) has a replica
on every model chunk (megatron_sat.model.gpt.ResFormerLambdas). Each replica's gradient covers only
its own chunk's layers; the true gradient is their sum over chunks and pipeline ranks, which is
written back to every replica so that the optimizer keeps them identical. Megatron-Core does this
only for embeddings; this is the same idea for any parameter flagged `pipeline_replicated`.
"""

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads


def _grad(p):
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def _sum_dtype(grads):
    """Sum in float32 at least (bf16 gradients), in float64 when the gradients are float64."""
    dtype = torch.float32
    for g in grads:
        if g is not None:
            dtype = torch.promote_types(dtype, g.dtype)
    return dtype


def _flagged(model_chunks, flag):
    return [p for chunk in model_chunks for p in chunk.parameters() if getattr(p, flag, False) and p.requires_grad]


def sync_tp_partial_grads(model_chunks) -> None:
    tp_group = parallel_state.get_tensor_model_parallel_group()
    params = [p for p in _flagged(model_chunks, "tp_partial_grad") if _grad(p) is not None]
    if tp_group.size() == 1 or not params:
        return
    grads = [_grad(p) for p in params]
    dtype = _sum_dtype(grads)
    flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
    torch.distributed.all_reduce(flat, group=tp_group)
    for g, synced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(synced.view_as(g))


def sync_pipeline_replicated_grads(model_chunks) -> None:
    groups = {}
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if getattr(p, "pipeline_replicated", False) and p.requires_grad:
                groups.setdefault(name.split("module.")[-1], []).append(p)
    if not groups:
        return
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    for params in groups.values():
        grads = [_grad(p) for p in params]
        total = torch.zeros_like(params[0], dtype=_sum_dtype(grads))
        for g in grads:
            if g is not None:
                total += g
        if pp_group.size() > 1:
            torch.distributed.all_reduce(total, group=pp_group)
        for p, g in zip(params, grads):
            if g is None:
                g = torch.zeros_like(p, dtype=total.dtype)
                p.grad = g
            g.copy_(total)


def finalize_grads(model_chunks, *args, **kwargs):
    """config.finalize_model_grads_func for megatron-sat models."""
    finalize_model_grads(model_chunks, *args, **kwargs)
    sync_tp_partial_grads(model_chunks)
    sync_pipeline_replicated_grads(model_chunks)
