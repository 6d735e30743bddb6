"""Smoke test: a tiny megatron-core GPTModel trained for a few steps (CPU/gloo without a GPU, NCCL with one).

    python -m megatron_sat.compat.smoke [--steps 5] [--tp 1] [--pp 1]
    torchrun --nproc-per-node 2 -m megatron_sat.compat.smoke --tp 2

Runs megatron's DistributedDataParallel, get_megatron_optimizer (Adam, clip_grad=1.0) and
get_forward_backward_func on a fixed random batch, printing the loss of every step (it should fall).
"""

from __future__ import annotations

import argparse
import os
import socket
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)

    from megatron_sat import compat

    compat.ensure_cpu_compat()
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        dist.init_process_group(backend=compat.dist_backend(), rank=rank, world_size=world)

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)

    vocab, seq, mbs, n_mb = 128, 32, 2, 2
    config = TransformerConfig(
        num_layers=2 * args.pp, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        pipeline_dtype=torch.float32, sequence_parallel=args.tp > 1,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
        max_sequence_length=seq, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
    )
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True), model
    )
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0, use_distributed_optimizer=True), [model]
    )

    dev = compat.device()
    g = torch.Generator().manual_seed(args.seed + ps.get_data_parallel_rank())
    data = [torch.randint(0, vocab, (mbs, seq + 1), generator=g).to(dev) for _ in range(n_mb)]
    pos = torch.arange(seq, device=dev).unsqueeze(0).expand(mbs, seq)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        out = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:])

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    fwd_bwd = get_forward_backward_func()
    is_report_rank = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and (
        ps.get_data_parallel_rank() == 0
    )
    loss = float("nan")
    for step in range(args.steps):
        t = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = fwd_bwd(
            forward_step_func=forward_step, data_iterator=iter(data), model=[model], num_microbatches=n_mb,
            seq_length=seq, micro_batch_size=mbs, forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        if is_report_rank:
            loss = torch.stack([x["loss"] for x in losses]).mean().item()
            print(
                f"step {step}  loss {loss:.4f}  grad_norm {grad_norm:.3f}  "
                f"({time.perf_counter() - t:.2f} s, device {dev.type}, backend {dist.get_backend()})",
                flush=True,
            )
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return loss


if __name__ == "__main__":
    main()
