"""The throughput profiler's settings: its options -> the trainer's arguments -> the checked spec its workers run.

    from megatron_sat.profiling.settings import resolve
    spec = resolve(options)        # options: tools/profile_throughput.py's parsed command line; ValueError: exit 2

Arguments: the trainer's, as arguments.py resolves them (resolve_layers: the layers and each value's source) for --recipe NAME
(default debug_transformer) and/or --config FILE (the trainer's config file, over the recipe), or --scale S (a
paper scale: the recipe satformer_S; a recipes.SIZES shape: the trainer's defaults with that shape), then the
tool's flags over them (--tp is --tensor-model-parallel-size, --precision --bf16, --recompute
--recompute-granularity, ...). Where neither the recipe, the config file nor a flag says,
the profiler's own defaults (PROFILER_DEFAULTS; the global batch: micro-batch x DP, x 2 PP with a pipeline).
Each arch of --archs (a label: megatron_sat.archs.arch_label) replaces the recipe's arch.

Checked before any process is launched, every problem reported together (SettingsError: the tool prints them as
one line and exits 2): the tool's own options, and the trainer arguments each profiled arch resolves to by the
trainer's complete check (argument_checks.argument_errors, as `--print-config`, plan-layout and the dry run run it:
nothing on disk); then, as trainer.configure does once those pass, each arch's model config (training/setup.py, as
the trainer builds it) against the layout and the global batch (parallel.layout.validate).
"""

import argparse
import copy
import importlib.util
import os
from typing import List, Tuple

import recipes  # the repository's recipes/ package (the paper grid registers itself on import)
from megatron_sat import archs
from megatron_sat.archs import arch_label, arch_label_errors
from megatron_sat.model import args as model_args  # no torch
from megatron_sat.parallel.layout import validate
from megatron_sat.parallel.world import world_from_env
from megatron_sat.training.argument_checks import argument_errors, world_errors
from megatron_sat.training.arguments import resolve_layers
from megatron_sat.training.setup import model_config, precision_and_layout

# other spellings of the archs (the baselines'), for a hint: each arch module's aliases
ALIASES = {alias: a for a in archs.ARCHS for alias in archs.get(a).aliases}
SHAPE_KEYS = model_args.SHAPE  # the model's size (model/args.py)
# the tool's flags that set a trainer argument: tool dest -> trainer dest
TRAINER_FLAGS = dict({k: k for k in SHAPE_KEYS + ("seq_length", "micro_batch_size", "global_batch_size", "vocab_size",
                                                  "use_distributed_optimizer", "seed")},
                     tp="tensor_model_parallel_size", pp="pipeline_model_parallel_size",
                     vpp="num_virtual_stages_per_pipeline_rank", sp="sequence_parallel")
# where neither the recipe nor a flag gives them (a throughput measurement, not the trainer's debug defaults)
PROFILER_DEFAULTS = dict(seq_length=512, micro_batch_size=1, vocab_size=32000, lr=1e-4)
# the trainer's flags that the tool spells otherwise, for its problems
TOOL_SPELLING = {"--recompute-granularity": "--recompute", "--tensor-model-parallel-size": "--tp",
                 "--pipeline-model-parallel-size": "--pp", "--num-virtual-stages-per-pipeline-rank": "--vpp"}


class SettingsError(ValueError):
    """Bad settings: its args are the problems, one line each (the tool prints them as one line, exit 2)."""

    def __str__(self) -> str:
        return "; ".join(map(str, self.args))


def job_world() -> int:
    """World size of the distributed job this process is a rank of (torchrun or an srun step), 0 when alone."""
    return world_from_env(default=0)


def trainer_args(options: argparse.Namespace) -> Tuple[argparse.Namespace, str]:
    """(the trainer's arguments of --recipe / --scale with the tool's flags over them, where they came from); no
    global batch default yet (it needs the world size). ValueError for an unknown recipe or scale, or one
    without a model shape."""
    config = getattr(options, "config", None)
    if options.scale and config:
        raise ValueError("give --config FILE with --recipe (or alone), not with --scale")
    if options.scale:
        if f"satformer_{options.scale}" in recipes.RECIPES:
            recipe, given, source = f"satformer_{options.scale}", None, f"recipe satformer_{options.scale}"
        elif options.scale in recipes.SIZES:
            recipe, given, source = None, dict(recipes.SIZES[options.scale]), f"size {options.scale}"
        else:
            known = list(getattr(getattr(recipes, "paper", None), "SCALES", ())) + list(recipes.SIZES)
            raise ValueError(f"unknown --scale {options.scale!r}; known: {', '.join(known)}")
    else:
        recipe, given = options.recipe or (None if config else "debug_transformer"), None
        source = " + ".join(([f"recipe {recipe}"] if recipe else []) + ([f"config {config}"] if config else []))
    # the trainer's layered resolver (recipe < config file); a size is the trainer's defaults with that shape (a
    # profile measures steps: the run's length, which the trainer requires, is one step here)
    flags = ["--config", config] if config else []
    if given is not None:
        # a size names no arch, which the trainer requires without a recipe: the transformer's arguments (each
        # profiled arch then sets its own, as with a recipe)
        flags = [w for k, v in given.items() for w in (f"--{k.replace('_', '-')}", str(v))] + [
            "--train-iters", "1", "--arch", archs.REFERENCE]
    resolution = resolve_layers(recipe, flags)  # ValueError: an unknown recipe, an unreadable config file, no shape
    args = resolution.args
    if given is None:  # what the recipe and the config file set (the profiler's defaults fill the rest)
        given = resolution.given("recipe", "config")
    for key, value in PROFILER_DEFAULTS.items():
        if given.get(key) is None:
            setattr(args, key, value)
    if given.get("global_batch_size") is None:
        args.global_batch_size = None  # micro-batch x DP (x 2 PP), once the world size is known
    for flag, dest in TRAINER_FLAGS.items():
        if getattr(options, flag) is not None:
            setattr(args, dest, getattr(options, flag))
    if options.precision:
        args.bf16 = options.precision == "bf16"
    if options.recompute:
        args.recompute_granularity = None if options.recompute == "none" else options.recompute
    if any(given.get(k) is None and getattr(options, k) is None for k in model_args.REQUIRED):
        raise ValueError(f"{source} sets no model shape; give --num-layers, --hidden-size and --num-attention-heads")
    return args, source


def arch_args(args: argparse.Namespace, label: str) -> argparse.Namespace:
    """`args` for one --archs label: its arch and the label's switches (e.g. satformer:separate)."""
    name, fields = arch_label(label)
    out = copy.copy(args)
    out.arch = name
    vars(out).update(fields)
    return out


def _option_errors(options: argparse.Namespace, args: argparse.Namespace, world: int, env_world: int) -> List[str]:
    """The tool's own options (steps, traces, modes) and the values that must be positive."""
    errors = []
    checks = (("--steps", options.steps), ("--repeats", options.repeats), ("--nproc", world),
              ("--tp", args.tensor_model_parallel_size), ("--pp", args.pipeline_model_parallel_size),
              ("--micro-batch-size", args.micro_batch_size),
              ("--vocab-size", args.vocab_size), ("--threads", 1 if options.threads is None else options.threads))
    errors += [f"{name} must be >= 1 (got {v})" for name, v in checks if v < 1]
    if options.warmup < 0:
        errors.append(f"--warmup must be >= 0 (got {options.warmup})")
    if options.trace_steps:
        try:
            first, _, last = options.trace_steps.partition("-")
            trace = [int(first), int(last or first)]
        except ValueError:
            errors.append(f"--trace-steps wants A-B or A (measured steps, 1-based), got {options.trace_steps!r}")
        else:
            if not 1 <= trace[0] <= trace[1] <= options.steps:
                errors.append(f"--trace-steps {options.trace_steps} is outside the measured steps 1-{options.steps}")
    if not 0 <= options.trace_rank < world:
        errors.append(f"--trace-rank {options.trace_rank} is not a rank of a world of {world}")
    if options.mode == "per-arch" and env_world:
        errors.append("--mode per-arch launches its own processes: run it outside torchrun/srun (with --nproc)")
    return errors


def _model_errors(options: argparse.Namespace, args: argparse.Namespace, world: int) -> List[str]:
    """Each arch's model config against the layout and the global batch, as the trainer checks them."""
    run = precision_and_layout(args)
    errors = []
    for label in options.archs:
        try:
            config = model_config(arch_args(args, label), run.layout, run.dtype, training=True)
            validate(run.layout, config, world, seq_length=args.seq_length, backend=options.backend or "local",
                     micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size)
        except ValueError as e:
            lines = str(e).splitlines()
            errors += [line.strip() for line in (lines[1:] if lines[0].startswith("invalid parallel layout") else lines)]
    return list(dict.fromkeys(errors))  # the same shape refuses a layout once, not once per arch


def _sizes_ok(args: argparse.Namespace) -> bool:
    """Whether the layout's sizes and the micro-batch can size a world (each >= 1)."""
    return min(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size,
               args.micro_batch_size) >= 1


def _argument_errors(options: argparse.Namespace, args: argparse.Namespace, world: int) -> List[str]:
    """The trainer's complete check (argument_checks.argument_errors; nothing on disk) of the arguments each arch of
    --archs resolves to, with the tool's flag names; the world size is left out while the layout's sizes or the
    micro-batch are below 1 (_option_errors reports them)."""
    te = False if importlib.util.find_spec("transformer_engine") is None else None  # as the trainer's parse_args
    checked = world if _sizes_ok(args) else None
    errors = []
    for label in options.archs:
        errors += argument_errors(arch_args(args, label), checked, inputs=False, te=te)
    for trainer, tool in TOOL_SPELLING.items():
        errors = [e.replace(trainer, tool) for e in errors]
    return list(dict.fromkeys(errors))  # a problem of every arch once


def resolve(options: argparse.Namespace) -> dict:
    """The spec of a profile (what tools/profile_throughput.py launches and reports) from the tool's parsed
    options; SettingsError (a ValueError) with every problem found (the tool prints them as one line, exit 2)."""
    bad = arch_label_errors(options.archs)
    if bad:
        hints = [f"{a}: did you mean {ALIASES[a.lower()]}?" for a in options.archs if a.lower() in ALIASES]
        raise SettingsError(*bad, *hints)
    if len(set(options.archs)) != len(options.archs):
        raise SettingsError(f"--archs lists an arch twice: {' '.join(options.archs)}")
    if options.baseline not in options.archs:
        raise SettingsError(f"--baseline {options.baseline} must be one of --archs ({' '.join(options.archs)}): "
                            "ratios divide by it")
    args, source = trainer_args(options)
    env_world = job_world()
    world = options.nproc or env_world or 1
    if options.nproc and env_world and options.nproc != env_world:
        raise SettingsError(f"--nproc {options.nproc} inside a job of world size {env_world}: drop --nproc")
    errors = _option_errors(options, args, world, env_world)
    if args.global_batch_size is None and _sizes_ok(args) and not world_errors(args, world):
        pp = args.pipeline_model_parallel_size  # the default: micro-batch x DP (x 2 PP with a pipeline)
        dp = world // (args.tensor_model_parallel_size * pp * args.context_parallel_size)
        args.global_batch_size = args.micro_batch_size * dp * (2 * pp if pp > 1 else 1)
    errors += _argument_errors(options, args, world)
    if not errors:  # as trainer.configure after the argument checks: the model against the layout
        errors += _model_errors(options, args, world)
    if errors:
        raise SettingsError(*errors)
    run = precision_and_layout(args)  # bf16 and the distributed optimizer: the recipe's or flags', else on a GPU
    args.bf16, args.use_distributed_optimizer = run.bf16, run.distributed_optimizer
    trace = None
    if options.trace_steps:
        first, _, last = options.trace_steps.partition("-")
        trace = [int(first), int(last or first)]
    layout = run.layout
    return dict(
        archs=list(options.archs), baseline=options.baseline, source=source,
        sizes={k: getattr(args, k) for k in SHAPE_KEYS}, arguments=vars(args),
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        vocab_size=args.vocab_size, layout=dict(tp=layout.tp, pp=layout.pp, vpp=layout.vpp, cp=layout.cp, sp=layout.sp),
        world_size=world, recompute=args.recompute_granularity or "none",
        precision="bf16" if run.bf16 else "fp32", bf16=run.bf16, use_distributed_optimizer=run.distributed_optimizer,
        backend=options.backend, warmup=options.warmup, steps=options.steps, seed=options.seed, trace_steps=trace,
        trace_rank=options.trace_rank, flops_profile=options.flops_profile, out_dir=os.path.abspath(options.out),
        mode=options.mode or ("shared" if env_world else "per-arch"), repeats=options.repeats,
        peak_tflops=options.peak_tflops, threads=options.threads, lr=args.lr, rotary_base=args.rotary_base,
    )
