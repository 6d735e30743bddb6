"""Parsed trainer arguments -> the objects they describe: the one path from a flag to the model config, the
precision, the parallel layout and the LR scheduler.

    from megatron_sat.training import setup
    run = setup.precision_and_layout(args)                  # bf16, distributed optimizer, dtype, Layout
    config = setup.model_config(args, run.layout, run.dtype, training=True)
    scheduler = setup.scheduler(optimizer, args)

The trainer, the planner, the HF importer, the lm-eval backend, the throughput profiler and the test workers all
build from here. A new model flag is added once, to MODEL_CONFIG_KEYS (training/arguments.py) under its SATConfig
field name, and reaches every one of them.
"""

import argparse
from typing import NamedTuple, Optional

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_sat.model.config import SATConfig, make_config
from megatron_sat.parallel.layout import Layout
from megatron_sat.training import megatron_lm_flags, schedule
from megatron_sat.training.arguments import model_config_fields


class PrecisionAndLayout(NamedTuple):
    """What --bf16, --use-distributed-optimizer and the layout flags resolve to."""

    bf16: bool
    distributed_optimizer: bool
    dtype: torch.dtype  # of the parameters: bfloat16 with bf16, else float32
    layout: Layout


def precision_and_layout(args: argparse.Namespace, gpu: Optional[bool] = None) -> PrecisionAndLayout:
    """--bf16 and --use-distributed-optimizer (default: on with a GPU, off on CPU) and the parallel layout.
    gpu: whether the run is on GPUs (default: whether this process sees one; the planner passes its target's)."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    bf16 = gpu if args.bf16 is None else args.bf16
    dist_opt = gpu if args.use_distributed_optimizer is None else args.use_distributed_optimizer
    layout = Layout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                    vpp=args.num_virtual_stages_per_pipeline_rank, cp=args.context_parallel_size,
                    sp=args.sequence_parallel)
    return PrecisionAndLayout(bf16, dist_opt, torch.bfloat16 if bf16 else torch.float32, layout)


def recompute_fields(args: argparse.Namespace) -> dict:
    """TransformerConfig's activation-recompute fields for --recompute-granularity / -method / -num-layers."""
    if args.recompute_granularity == "full":
        return dict(recompute_granularity="full", recompute_method=args.recompute_method or "uniform",
                    recompute_num_layers=args.recompute_num_layers)
    if args.recompute_granularity == "selective":
        return dict(recompute_granularity="selective")
    return {}


def model_config(args: argparse.Namespace, layout: Optional[Layout] = None, dtype: Optional[torch.dtype] = None, *,
                 training: bool = False) -> SATConfig:
    """The model config of trainer arguments `args`: the shape and the arch switches (MODEL_CONFIG_KEYS); with
    `layout` its TransformerConfig fields; with `dtype` the parameters' dtype (bf16 when bfloat16); training=True
    also what only a training step uses (--fp8-format, --recompute-*: the trainer's and the profiler's config;
    the planner counts recompute itself, evaluation runs no backward). ValueError for what the config refuses."""
    fields = model_config_fields(args)
    if dtype is not None:
        fields.update(bf16=dtype == torch.bfloat16, params_dtype=dtype)
    if layout is not None:
        fields.update(layout.config_fields(dtype or torch.float32))
    if training:
        fields.update(fp8=args.fp8_format, **recompute_fields(args))
    fields.update(megatron_lm_flags.config_fields(args, gpu=torch.cuda.is_available()))
    return make_config(args.arch, num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                       ffn_hidden_size=args.ffn_hidden_size, **fields)


def scheduler(optimizer, args: argparse.Namespace, mode: str = schedule.OVERRIDE) -> OptimizerParamScheduler:
    """Megatron-Core's OptimizerParamScheduler from the command's schedule flags (schedule.wanted); on load it keeps
    the command's values (schedule.OVERRIDE) or takes the checkpoint's (schedule.CHECKPOINT: schedule.choose
    says which a resume follows)."""
    now = schedule.wanted(args)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=now["max_lr"], min_lr=now["min_lr"], lr_warmup_steps=now["lr_warmup_steps"],
        lr_decay_steps=now["lr_decay_steps"], lr_decay_style=now["lr_decay_style"], start_wd=now["start_wd"],
        end_wd=now["start_wd"], wd_incr_steps=args.train_iters, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=mode == schedule.CHECKPOINT,
        override_opt_param_scheduler=mode == schedule.OVERRIDE)
