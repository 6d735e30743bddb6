"""Parsed trainer arguments -> the objects they describe: the one path from a flag to the model config, the
precision, the parallel layout and the LR scheduler.

    from megatron_sat.training import setup
    run = setup.precision_and_layout(args)                  # bf16, distributed optimizer, dtype, Layout
    config = setup.model_config(args, run.layout, run.dtype, training=True)
    scheduler = setup.scheduler(optimizer, args)

The trainer, the planner, the HF importer, the lm-eval backend, the throughput profiler and the test workers all
build from here. A new model switch is added once, as a field of ModelArgs (model/args.py), and reaches every one
of them.
"""

import argparse
from typing import NamedTuple, Optional

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_sat.model.args import model_args, record
from megatron_sat.model.config import SATConfig, make_config
from megatron_sat.parallel.layout import Layout
from megatron_sat.training import megatron_lm_flags, schedule
from megatron_sat.training.argument_checks import bf16_on


class PrecisionAndLayout(NamedTuple):
    """What --bf16, --use-distributed-optimizer and the layout flags resolve to."""

    bf16: bool
    distributed_optimizer: bool
    dtype: torch.dtype  # of the parameters: bfloat16 with bf16, float16 with --fp16, else float32
    layout: Layout


def precision_and_layout(args: argparse.Namespace, gpu: Optional[bool] = None) -> PrecisionAndLayout:
    """--bf16 and --use-distributed-optimizer (default: on with a GPU, off on CPU) and the parallel layout.
    gpu: whether the run is on GPUs (default: whether this process sees one; the planner passes its target's).
    The arguments are checked by argument_checks.argument_errors (--fp16 with --bf16 is refused there)."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    fp16 = getattr(args, "fp16", False)
    bf16 = bf16_on(args, gpu)
    dist_opt = gpu if args.use_distributed_optimizer is None else args.use_distributed_optimizer
    layout = Layout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                    vpp=args.num_virtual_stages_per_pipeline_rank, cp=args.context_parallel_size,
                    sp=args.sequence_parallel)
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    return PrecisionAndLayout(bf16, dist_opt, dtype, layout)


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
    """The model config of trainer arguments `args`: their ModelArgs (model/args.py: the shape and the arch
    switches); with `layout` its TransformerConfig fields; with `dtype` the parameters' dtype (bf16 when bfloat16);
    training=True also what only a training step uses (--fp8-format, --recompute-*: the trainer's and the
    profiler's config; the planner counts recompute itself, evaluation runs no backward). ValueError for what the
    config refuses."""
    extra = dict(fp8=args.fp8_format, **recompute_fields(args)) if training else {}
    extra.update(megatron_lm_flags.config_fields(args, gpu=torch.cuda.is_available()))  # --init-method-std, fusions
    return described_config(model_args(args), layout, dtype, **extra)


def described_config(model, layout: Optional[Layout] = None, dtype: Optional[torch.dtype] = None,
                     **extra) -> SATConfig:
    """The model config of a ModelArgs (or anything with its fields: the conversion's ModelSpec of a checkpoint),
    with `layout`'s and `dtype`'s fields as model_config adds them and `extra` TransformerConfig fields."""
    fields = record(model)
    if dtype is not None:
        fields.update(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype)
    if layout is not None:
        fields.update(layout.config_fields(dtype or torch.float32))
    fields.update(extra)
    return make_config(**fields)


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
