"""The trainer's argument checks, all of them: every problem of resolved arguments, one line each, without importing
megatron or torch or writing to the disk (training/arguments.py parses and resolves; this module says what is wrong
and how to fix it, so bad input exits 2 in about a second and leaves no checkpoint behind).

One entry point, `argument_errors`, run by the trainer (twice: at parse time with what is known without torch, and
in trainer.configure with the target's GPU and Transformer Engine), by `--print-config`, plan-layout and the dry run
(inputs=False: nothing on disk, no data needed; the target GPU they plan for). `refusal` writes the problems as the
one short line a refusal prints.
"""

import argparse
import importlib.util
import os
import re
from typing import List, Optional, Sequence

from megatron_sat import archs
from megatron_sat.model.args import rope_scaling_errors
from megatron_sat.outputs import check_output
from megatron_sat.training import megatron_lm_flags
from megatron_sat.training.run_folder import holds_run  # no megatron


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Raise ValueError listing every problem found (megatron is not imported)."""
    errors = argument_errors(args, world_size)
    if errors:
        raise ValueError("invalid arguments:\n  " + "\n  ".join(errors))


def refusal(prog: str, errors: Sequence[str]) -> str:
    """The one line a refusal prints: `PROG: error: PROBLEM`, or `PROG: error: N problems: (1) A; (2) B` (a
    problem's own line breaks, a layout's list, folded in)."""
    lines = [_fold(str(e)) for e in errors]
    if len(lines) == 1:
        return f"{prog}: error: {lines[0]}"
    return f"{prog}: error: {len(lines)} problems: " + "; ".join(f"({i}) {x}" for i, x in enumerate(lines, 1))


def _fold(problem: str) -> str:
    """A problem on one line: 'invalid parallel layout X:\n  a\n  b' -> 'invalid parallel layout X: a, b'."""
    lines = [" ".join(x.split()) for x in problem.splitlines() if x.strip()]
    out = lines[0] if lines else ""
    for x in lines[1:]:
        out += (" " if out.endswith(":") else ", ") + x
    return out


def problems(line: str) -> List[str]:
    """The problems of a `refusal` line (its inverse, for tests and tools that list them)."""
    text = line.split(": error: ", 1)[1].strip()
    if not re.match(r"\d+ problems: \(1\) ", text):
        return [text]
    body = text.split(": ", 1)[1]
    return [p.rstrip("; ") for p in re.split(r"(?:^|; )\(\d+\) ", body) if p]


def argument_errors(args: argparse.Namespace, world_size: Optional[int], *, inputs: bool = True,
                    gpu: Optional[bool] = None, te: Optional[bool] = None) -> List[str]:
    """Every problem of the resolved arguments, one line each (neither megatron nor torch is imported).

    world_size: the processes of the run (None: not checked here; the planner checks the layout against its
    cluster). inputs=False leaves out what needs the disk or the data (a data source, datasets, --load, --save,
    packages): `--print-config`, plan-layout and the dry run. gpu, te: whether the run is on GPUs and has
    Transformer Engine there (None: not known yet; the checks that need them wait for trainer.configure)."""
    errors = shape_errors(args) + arch_flag_errors(args)
    world = world_errors(args, world_size) if world_size is not None else []
    errors += world
    if world_size is not None and not world:
        dp = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                            * args.context_parallel_size)
        if args.micro_batch_size < 1 or args.global_batch_size < 1:
            errors.append(f"--micro-batch-size ({args.micro_batch_size}) and --global-batch-size "
                          f"({args.global_batch_size}) must be >= 1")
        elif args.global_batch_size % (args.micro_batch_size * dp):
            errors.append(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                          f"x data-parallel size = {args.micro_batch_size} x {dp}")
    for name in ("train_iters", "seq_length", "log_interval", "eval_iters"):
        if getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("save_interval", "eval_interval", "exit_interval", "save_retain_interval", "eval_samples"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0 or args.min_lr < 0 or args.min_lr > args.lr:
        errors.append(f"need 0 <= --min-lr ({args.min_lr}) <= --lr ({args.lr}) and --lr > 0")
    if (args.distributed_timeout_minutes is not None and args.distributed_timeout_minutes <= 0) \
            or (args.hang_timeout_minutes or 0) < 0:
        errors.append("--distributed-timeout-minutes must be > 0 and --hang-timeout-minutes >= 0 (0 turns the "
                      "watchdog off)")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        errors.append("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other: "
                      "pass one (the command's LR schedule, or the checkpoint's)")
    decay = args.lr_decay_iters or args.train_iters
    negative = [f for f in ("lr_warmup_samples", "lr_decay_samples") if (getattr(args, f, None) or 0) < 0]
    # a negative sample count has its own line, and so has a decay length that is a refused --train-iters
    no_decay = not args.lr_decay_iters and args.train_iters < 1 and args.lr_warmup_iters >= 0
    if not negative and not no_decay and not 0 <= args.lr_warmup_iters < decay:
        given = (f"--lr-warmup-samples {args.lr_warmup_samples} ({args.lr_warmup_iters:g} steps of "
                 f"{args.global_batch_size} samples)" if args.lr_warmup_samples is not None
                 else f"--lr-warmup-iters {args.lr_warmup_iters}")
        errors.append(f"{given} must be >= 0 and below the decay length {decay:g} steps (--lr-decay-iters or "
                      "--lr-decay-samples, default --train-iters)")
    if args.lr_warmup_fraction is not None and not 0 <= args.lr_warmup_fraction < 1:
        errors.append(f"--lr-warmup-fraction {args.lr_warmup_fraction} must be in [0, 1) (a fraction of the decay "
                      "length)")
    errors += megatron_lm_errors(args) + megatron_lm_flag_errors(args) + target_errors(args, gpu, te)
    try:
        parse_split(args.split)
    except ValueError as e:
        errors.append(str(e))
    if args.ckpt_step is not None and not args.load:
        errors.append("--ckpt-step needs --load")
    if args.mock_data and not args.vocab_size and not args.tokenizer_model:
        errors.append("--mock-data needs --vocab-size N or --tokenizer-model (whose vocabulary the tokens use)")
    errors += eval_tasks_errors(args, inputs)
    if inputs:
        errors += input_errors(args)
    return errors


def bf16_on(args: argparse.Namespace, gpu: bool) -> bool:
    """Whether the run computes in bf16: --bf16 / --no-bf16, else on a GPU unless --fp16 (setup.py builds so)."""
    return (gpu and not getattr(args, "fp16", False)) if args.bf16 is None else args.bf16


def target_errors(args: argparse.Namespace, gpu: Optional[bool], te: Optional[bool]) -> List[str]:
    """The precision and layer implementation against the target: gpu, te as argument_errors takes them (a check
    that needs one that is None is left for when it is known)."""
    errors = []
    if getattr(args, "fp16", False) and args.bf16:
        errors.append("--fp16 and --bf16 contradict: give one")
    if te is False and args.transformer_impl == "transformer_engine":
        errors.append("--transformer-impl transformer_engine needs Transformer Engine on a GPU")
    if args.fp8_format and (args.transformer_impl == "local" or te is False):
        errors.append("--fp8-format needs Transformer Engine on a GPU")
    if args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32:
        errors.append("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict: give one")
    elif args.grad_reduce_in_bf16 and (args.bf16 is not None or gpu is not None) and not bf16_on(args, bool(gpu)):
        errors.append("--grad-reduce-in-bf16 needs --bf16 (the gradients are in fp32 otherwise)")
    return errors


def input_errors(args: argparse.Namespace) -> List[str]:
    """What the arguments ask of the disk and the environment: one data source that exists, the folders to load
    and save, the packages an option needs."""
    errors = []
    sources = [bool(args.data_path), args.mock_data, bool(args.embedded_data), bool(args.train_data_path)]
    if sum(sources) != 1:
        errors.append("give exactly one data source: --data-path PREFIX, --train-data-path PREFIX (with "
                      "--valid-data-path, --test-data-path), --mock-data or --embedded-data DIR")
    errors += split_path_errors(args)
    if args.data_path:
        prefixes = [x for x in " ".join(args.data_path).split() if not _is_number(x)]
        missing = [x for x in prefixes if not (os.path.isfile(x + ".bin") and os.path.isfile(x + ".idx"))]
        if missing:
            errors.append(f"--data-path: no indexed dataset (.bin + .idx) at {', '.join(missing)} "
                          "(make one with tools/preprocess_data.py)")
        errors += blend_errors("--data-path", args.data_path)
        if not args.tokenizer_model:
            errors.append("--data-path needs --tokenizer-model (the tokenizer the data was made with)")
    if args.load and not os.path.isdir(args.load) and not (args.save and same_path(args.load, args.save)):
        errors.append(f"--load folder {args.load} does not exist")  # --save D --load D: D is created
    if args.pretrained_checkpoint and not os.path.isdir(args.pretrained_checkpoint):
        errors.append(f"--pretrained-checkpoint folder {args.pretrained_checkpoint} does not exist")
    errors += save_folder_errors(args)
    if args.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        errors.append("--tensorboard-dir needs the tensorboard package: pip install tensorboard "
                      "(in the train extra of megatron-sat)")
    if args.tensorboard_dir and os.path.exists(args.tensorboard_dir) and not os.path.isdir(args.tensorboard_dir):
        errors.append(f"--tensorboard-dir {args.tensorboard_dir} is a file: give a folder (new, or this run's)")
    elif args.tensorboard_dir:
        unwritable = unwritable_folder(args.tensorboard_dir)
        if unwritable:
            what = "is a file" if os.path.isfile(unwritable) else ("cannot be written: a read-only file system, an "
                                                                    "immutable folder or no permission")
            errors.append(f"--tensorboard-dir {args.tensorboard_dir} is not writable ({unwritable} {what}): pass a "
                          "--tensorboard-dir this job can write")
    return errors


def shape_errors(args: argparse.Namespace) -> List[str]:
    """The model's sizes: each >= 1, whole query groups, and a head dim the hidden size gives (or --kv-channels).
    Megatron-Core checks none of these before it builds: a zero depth divided by zero, three query groups of four
    heads failed in a reshape mid-forward. Run by the trainer, --print-config, the planner, its layout search and the
    dry run (argument_errors)."""
    out = []
    sizes = dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                 num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                 num_query_groups=args.num_query_groups)
    small = [f"--{k.replace('_', '-')} {v}" for k, v in sizes.items() if v is not None and v < 1]
    if small:
        return [f"{', '.join(small)}: the model's sizes must be >= 1"]
    heads, groups = args.num_attention_heads, args.num_query_groups
    if heads is not None and groups is not None and heads % groups:
        out.append(f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}: each query "
                   "group (KV head) serves the same number of heads")
    if heads is not None and args.hidden_size is not None and args.kv_channels is None and args.hidden_size % heads:
        out.append(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {heads}: give sizes "
                   "that divide, or the head dim as --kv-channels")
    return out

def world_errors(args: argparse.Namespace, world_size: int) -> List[str]:
    """The world size against TP x PP x CP (argument_errors' first check; the throughput profiler's too, which
    needs the data-parallel size before it can build a model for parallel.layout.validate)."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * pp * cp):
        return [f"world size {world_size} is not divisible by TP x PP x CP = {tp} x {pp} x {cp}"]
    return []


# the tokenizer types of Megatron-LM's --tokenizer-type that mean something here
TOKENIZER_TYPES = ("HuggingFaceTokenizer", "NullTokenizer")


# GPT-2's vocab.json + merges.txt as one tokenizers file (the tokenizers library, the same in transformers 4 and 5:
# transformers 5's GPT2TokenizerFast(vocab_file=..., merges_file=...) saved a one-token tokenizer).  Printed by the
# refusal of --vocab-file/--merge-file and run as typed by tests/test_docs_commands.py.
GPT2_TO_TOKENIZER_JSON = ("python -c \"import tokenizers as t; b = t.ByteLevelBPETokenizer('VOCAB', 'MERGES'); "
                          "b.add_special_tokens(['<|endoftext|>']); b.save('tokenizer.json')\"")


def megatron_lm_errors(args: argparse.Namespace) -> List[str]:
    """What the Megatron-LM flags refuse here: tokenizer types and checkpoint formats this trainer does not read,
    --finetune without a checkpoint to read or onto its own folder, --recompute-method without full recompute."""
    errors = []
    kind = args.tokenizer_type
    if kind is not None and kind not in TOKENIZER_TYPES:
        errors.append(f"--tokenizer-type {kind} is not read here: use --tokenizer-type HuggingFaceTokenizer "
                      "--tokenizer-model DIR (a Hugging Face tokenizer folder, tokenizer.json or hub name)")
    elif kind == "NullTokenizer" and not args.mock_data:
        errors.append("--tokenizer-type NullTokenizer goes with --mock-data --vocab-size N; for a dataset use "
                      "--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR")
    elif kind == "HuggingFaceTokenizer" and not args.tokenizer_model:
        errors.append("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer folder, "
                      "tokenizer.json or hub name)")
    if args.ckpt_format != "torch_dist":
        errors.append(f"--ckpt-format {args.ckpt_format} is not supported: checkpoints here are torch_dist "
                      "(Megatron-Core dist checkpointing); drop the flag or pass --ckpt-format torch_dist")
    if args.finetune:
        if not args.load:
            errors.append("--finetune needs --load (the checkpoint whose weights to start from)")
        elif args.save and same_path(args.load, args.save):
            errors.append(f"--finetune --load {args.load} would write over the run it reads: pass a new --save "
                          "folder (or --pretrained-checkpoint DIR --load NEW --save NEW, which a requeued job resumes)")
        if args.pretrained_checkpoint:
            errors.append("give --finetune --load DIR or --pretrained-checkpoint DIR, not both")
    if args.recompute_method is not None and args.recompute_granularity != "full":
        errors.append("--recompute-method needs --recompute-granularity full (selective recompute has no method)")
    if args.train_samples is not None and args.train_samples < 1:
        errors.append("--train-samples must be >= 1")
    return errors


def megatron_lm_flag_errors(args: argparse.Namespace) -> List[str]:
    """One line per Megatron-LM model-description flag (megatron_lm_flags.py) whose value is not what the arch is,
    and per bad value of its other flags."""
    out = []

    def conflict(flag: str, value, why: str) -> None:
        out.append(f"{flag} {value} conflicts with --arch {args.arch}: {why}; drop the flag (it describes the model)")

    if args.normalization is not None and args.normalization != megatron_lm_flags.NORMALIZATION:
        conflict("--normalization", args.normalization, f"every norm here is {megatron_lm_flags.NORMALIZATION}")
    if args.position_embedding_type is not None and args.position_embedding_type != megatron_lm_flags.POSITION_EMBEDDING:
        conflict("--position-embedding-type", args.position_embedding_type, "every arch here uses RoPE")
    if args.rotary_percent is not None and args.rotary_percent != 1.0:
        conflict("--rotary-percent", args.rotary_percent, "RoPE rotates the whole head here (1.0)")
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
        out.append(f"--max-position-embeddings {args.max_position_embeddings} is below --seq-length "
                   f"{args.seq_length}: give at least the sequence length")
    if args.kv_channels is not None and args.kv_channels < 1:  # ModelArgs fields (model/args.py)
        out.append(f"--kv-channels must be >= 1 (got {args.kv_channels})")
    if not args.layernorm_epsilon > 0:
        out.append(f"--norm-epsilon must be > 0 (got {args.layernorm_epsilon})")
    for flag, value in (("--attention-dropout", args.attention_dropout), ("--hidden-dropout", args.hidden_dropout)):
        if value not in (None, 0.0):
            conflict(flag, value, "the archs here train without dropout (0)")
    if args.apply_layernorm_1p and args.weight_decay_params == "all":
        out.append("--apply-layernorm-1p with --weight-decay-params all would decay norm weights towards 1, which "
                   "the norms here do not: use --weight-decay-params matrices (norms undecayed), where it is a no-op")
    if args.init_method_std <= 0:  # a ModelArgs field (model/args.py)
        out.append(f"--init-method-std must be > 0 (got {args.init_method_std})")
    out += rope_scaling_errors(args)  # ModelArgs fields (model/args.py)
    if args.num_workers < 0 or args.manual_gc_interval < 0:
        out.append("--num-workers and --manual-gc-interval must be >= 0")
    if args.overlap_param_gather and args.use_distributed_optimizer is False:
        out.append("--overlap-param-gather needs the distributed optimizer: drop --no-use-distributed-optimizer")
    if (args.decoupled_min_lr is not None) and args.decoupled_lr is None:
        out.append("--decoupled-min-lr needs --decoupled-lr")
    if args.vocab_file or args.merge_file:
        out.append("--vocab-file/--merge-file (GPT2BPETokenizer) are not read here: save them as one tokenizers "
                   "file, " + GPT2_TO_TOKENIZER_JSON + ", and pass --tokenizer-type HuggingFaceTokenizer "
                   "--tokenizer-model tokenizer.json (the data must have been made with that tokenizer)")
    if args.decoupled_lr is not None and args.weight_decay_params == "all":
        out.append("--decoupled-lr goes with --weight-decay-params matrices (Megatron-Core's parameter groups); "
                   "drop one of them")
    if args.recompute_modules and set(args.recompute_modules) - {"core_attn"}:
        out.append(f"--recompute-modules {' '.join(args.recompute_modules)}: selective recompute here recomputes core "
                   "attention only (core_attn, Megatron-LM's default); drop the others or use --recompute-granularity "
                   "full")
    if args.profile and not 1 <= args.profile_step_start <= args.profile_step_end:
        out.append(f"--profile-step-start {args.profile_step_start} and --profile-step-end {args.profile_step_end}: "
                   "need 1 <= start <= end")
    elif args.profile and args.train_iters is not None and args.profile_step_end > args.train_iters:
        out.append(f"--profile-step-start {args.profile_step_start} to --profile-step-end {args.profile_step_end} "
                   f"ends past the run's last step (--train-iters {args.train_iters}): the trace is written after step "
                   f"{args.profile_step_end}, so nothing would be; give a range within 1..{args.train_iters}")
    for flag in ("lr_warmup_samples", "lr_decay_samples"):
        if getattr(args, flag) is not None and getattr(args, flag) < 0:
            out.append(f"--{flag.replace('_', '-')} must be >= 0 (got {getattr(args, flag)})")
    return out


def save_folder_errors(args: argparse.Namespace) -> List[str]:
    """--save must be a folder that is new, or the run being resumed (--load the same folder): a run folder
    that holds checkpoints is never written over by a run that did not load it."""
    save = args.save
    if not save:
        return []
    if os.path.exists(save) and not os.path.isdir(save):
        return [f"--save {save} is a file, not a folder: pass a folder for checkpoints, metrics and config"]
    unwritable = unwritable_folder(save)
    if unwritable:
        return [f"--save {save} is not writable ({unwritable} cannot be written: a read-only file system, an "
                "immutable folder or no permission): pass a --save folder this job can write"]
    others = {"--load": None if args.load and same_path(args.load, save) else args.load,
              "--pretrained-checkpoint": args.pretrained_checkpoint}
    try:
        check_output("--save", save, others)
    except ValueError as e:
        return [str(e)]
    if args.load and same_path(args.load, save):
        return []
    if os.path.isdir(save) and holds_run(save):
        hint = f"resume it with --load {save}" + (f" (not --load {args.load})" if args.load else "")
        return [f"--save {save} already holds a run's checkpoints: {hint}, or pass a new --save folder"]
    return []


def unwritable_folder(folder: str) -> Optional[str]:
    """The folder (or, when it does not exist yet, its nearest existing parent) if this process cannot create
    files in it, else None. os.access honours read-only mounts and immutable folders for root as well."""
    path = os.path.abspath(folder)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return None if os.access(path, os.W_OK | os.X_OK) else path


def same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def arch_flag_errors(args: argparse.Namespace) -> List[str]:
    """What the chosen arch refuses of these flags (megatron_sat.archs.arch_errors; the model config raises the same,
    naming its fields)."""
    return archs.arch_errors(args.arch, fp8=args.fp8_format, recompute_granularity=args.recompute_granularity,
                             hc_expansion_rate=args.hc_expansion_rate, value_residual_gate=args.value_residual_gate,
                             resformer_lambdas=args.resformer_lambdas,
                             value_residual_gate_impl=args.value_residual_gate_impl)


def split_path_errors(args: argparse.Namespace) -> List[str]:
    """--train/valid/test-data-path: datasets that exist, a tokenizer, and no --valid/--test path without a train
    path (the per-split paths replace --data-path + --split as a whole)."""
    errors = []
    per_split = {k: getattr(args, f"{k}_data_path", None) for k in ("train", "valid", "test")}
    if not any(per_split.values()):
        return errors
    if not per_split["train"]:
        errors.append("--valid-data-path / --test-data-path need --train-data-path (they replace --data-path)")
    for name, value in per_split.items():
        if value:
            prefixes = [x for x in " ".join(value).split() if not _is_number(x)]
            missing = [x for x in prefixes if not (os.path.isfile(x + ".bin") and os.path.isfile(x + ".idx"))]
            if missing or not prefixes:
                errors.append(f"--{name}-data-path: no indexed dataset (.bin + .idx) at "
                              f"{', '.join(missing) or 'nothing given'} (make one with tools/preprocess_data.py)")
            errors += blend_errors(f"--{name}-data-path", value)
    if per_split["train"] and not args.tokenizer_model:
        errors.append("--train-data-path needs --tokenizer-model (the tokenizer the data was made with)")
    return errors


def blend_errors(flag: str, value: Sequence[str]) -> List[str]:
    """A blend's weights (finite, > 0; NaN too is refused) and empty .bin files, before anything is imported
    (data/checks.py checks the rest of each dataset, e.g. an .idx that lists no document, before step 1)."""
    items = " ".join(value).split()
    errors = []
    weights = items[0::2] if len(items) % 2 == 0 and all(_is_number(x) for x in items[0::2]) else []
    if weights and not all(0 < float(w) < float("inf") for w in weights):
        errors.append(f"{flag}: blend weights must be finite numbers > 0, got {' '.join(weights)}: write it as "
                      "'w1 prefix1 w2 prefix2 ...'")
    empty = [x for x in items if not _is_number(x) and os.path.isfile(x + ".bin") and os.path.getsize(x + ".bin") == 0]
    errors += [f"{flag}: {x}.bin is empty: the dataset {x} holds no documents. Remove it from {flag}, or re-run "
               "tools/preprocess_data.py on inputs that hold text" for x in empty]
    return errors


def data_spec(args: argparse.Namespace):
    """What the trainer reads: the --data-path blend (a string), or {"train", "valid", "test"} blends."""
    if args.train_data_path:
        return {k: " ".join(getattr(args, f"{k}_data_path") or []) or None for k in ("train", "valid", "test")}
    return " ".join(args.data_path)


def parse_split(split: str) -> list:
    """'98,2,0' -> [98.0, 2.0, 0.0]; ValueError with what is wrong (Megatron's own error says NaN)."""
    parts = [p.strip() for p in str(split).replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r} must be up to three comma-separated numbers, e.g. 98,2,0") from None
    if not 1 <= len(values) <= 3 or any(v < 0 or v != v for v in values) or sum(values) <= 0:
        raise ValueError(f"--split {split!r} must be up to three non-negative numbers with a positive sum, "
                         "e.g. 98,2,0")
    return values + [0.0] * (3 - len(values))



def _is_number(x: str) -> bool:
    try:
        float(x)
        return True
    except ValueError:
        return False


def eval_tasks_errors(args: argparse.Namespace, inputs: bool = True) -> List[str]:
    """What --eval-tasks and its companions refuse (checked before anything is built); inputs=False leaves out the
    folders and the lm-eval package."""
    companions = [f"--{k.replace('_', '-')}" for k in ("eval_tasks_interval", "eval_tasks_limit",
                                                       "eval_tasks_include_path", "eval_tasks_batch_size")
                  if getattr(args, k)]
    if not args.eval_tasks:
        return [f"{', '.join(companions)} need --eval-tasks"] if companions else []
    errors = []
    if not [t for t in args.eval_tasks.split(",") if t.strip()]:
        errors.append("--eval-tasks names no task: give comma-separated lm-eval task names")
    for name in ("eval_tasks_interval", "eval_tasks_batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.eval_tasks_limit is not None and args.eval_tasks_limit <= 0:
        errors.append("--eval-tasks-limit must be > 0 (examples per task, or a fraction below 1)")
    errors += [f"--eval-tasks-include-path {d} is not a folder" for d in args.eval_tasks_include_path
               if inputs and not os.path.isdir(d)]
    if args.pipeline_model_parallel_size > 1 or args.context_parallel_size > 1:
        errors.append("--eval-tasks runs at PP1 and CP1 only (TP and DP are fine): score this run's checkpoints "
                      "with tools/evaluate.py --checkpoint RUN instead")
    if args.mock_data and not args.tokenizer_model:
        errors.append("--eval-tasks with --mock-data needs --tokenizer-model (the tokenizer the tasks are read with)")
    if inputs and importlib.util.find_spec("lm_eval") is None:
        errors.append('--eval-tasks needs lm-eval: pip install "lm-eval[hf]==0.4.13"')
    return errors
