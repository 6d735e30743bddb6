"""Command-line arguments of the trainer (Megatron-LM's flag names where the concept exists).

Parsing is in layers: `--recipe NAME` (recipes/, or `module:function` outside the repository) and
`--config FILE` (config_file.py) are read first and become the parser's defaults, the config file's over
the recipe's, so that any flag on the command line overrides both: recipe < config file < command line.
Without a recipe or a config file that gives them, the model shape and the length of training are
required flags, as in Megatron-LM. The flags are declared by group (`_add_<group>_args`, Megatron-LM's habit;
the Megatron-LM compatibility flags in megatron_lm_flags.py, the model's from model/args.py), and
argument_checks.py checks the resolved values without importing megatron or touching the disk for writing, so
bad input fails in about a second with a clear message and leaves no checkpoint behind.
"""

import argparse
import importlib.util
import os
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence

from megatron_sat import archs
from megatron_sat.model import args as model_args  # no torch
from megatron_sat.parallel.world import world_from_env  # torchrun's or srun's world, without importing torch
from megatron_sat.training import megatron_lm_flags
from megatron_sat.training.argument_checks import argument_errors, refusal
from megatron_sat.training.config_file import dump_config, explicit_dests, placeholder_errors, read_config


class Parser(argparse.ArgumentParser):
    """argparse with a refusal of one line (`PROG: error: ...`, exit 2) in place of the usage and the error: an
    unrecognized flag or a bad value is one problem among the others, not a 120-line dump; --help keeps the usage."""

    def error(self, message):
        self.exit(2, refusal(self.prog, [message]) + "\n")


def refuse(prog: str, errors: List[str]):
    """Print the problems as one line and exit 2 (nothing is written)."""
    sys.stderr.write(refusal(prog, errors) + "\n")
    sys.exit(2)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown for options that take a value and whose help does not state its own; a switch's default
    ('True' for --no-save-final) misleads."""

    def _get_help_string(self, action):
        if action.nargs == 0 or "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


def _group(parser: argparse.ArgumentParser, title: Optional[str], names_run: bool):
    """add_argument of a new argument group of `parser` (of the parser itself without a title) that tags each
    flag's action with `names_run`: True for a flag whose value is part of what a run is (it goes into the run
    folder's name, megatron_sat/sweep/plan.py: another value is another run), False for one that only says how a run is
    laid out, stored, logged or stopped (layout, micro-batch, paths, cadences), so that a run resumes under
    another value. The group's value is the default; a flag unlike its group passes its own names_run=."""
    add = parser.add_argument_group(title).add_argument if title else parser.add_argument

    def tagged(*flags, names_run: bool = names_run, **kwargs):
        action = add(*flags, **kwargs)
        action.names_run = names_run
        return action

    return tagged


def unnamed_dests(parser: Optional[argparse.ArgumentParser] = None) -> set:
    """The arguments (dests) of the flags tagged names_run=False: left out of run-folder names."""
    return {a.dest for a in (parser or build_parser())._actions if getattr(a, "names_run", True) is False}


def add_model_flags(add) -> None:
    """One flag per ModelArgs field that names one (model/args.py), with its default, help, choices and names_run
    tag, under the field's name as dest; a bool field's flag switches it away from its default (one named after
    its field, --qk-layernorm, takes both spellings, --no-qk-layernorm switching it off)."""
    for f in model_args.FIELDS:
        facts = f.metadata
        if not facts["flag"]:
            continue
        kwargs = dict(dest=f.name, default=f.default, help=facts["help"], names_run=facts["names_run"])
        if isinstance(f.default, bool) and facts["flag"] == "--" + f.name.replace("_", "-"):
            kwargs["action"] = argparse.BooleanOptionalAction  # named after its field: --qk-layernorm / --no-...
        elif isinstance(f.default, bool):
            kwargs["action"] = "store_false" if f.default else "store_true"
        else:
            kwargs["type"] = model_args.flag_type(f)
            if facts["choices"]:
                kwargs["choices"] = list(facts["choices"])
        add(facts["flag"], **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="megatron-sat-train",
        description="Pretrain a Transformer / ResFormer / SATFormer (or the DenseFormer, MUDDFormer and "
                    "Hyper-Connections baselines) on Megatron-Core. Precedence: recipe < config file < command "
                    "line (each flag given overrides --config FILE, whose values override --recipe's). Without "
                    "--recipe or --config, give the model shape and the length of training: --num-layers, "
                    "--hidden-size, --num-attention-heads and --train-iters or --train-samples.",
        formatter_class=_HelpFormatter,
    )
    # each group says whether its flags name a run (names_run, see _group); a flag unlike its group says so itself
    a = _group(p, None, names_run=False)
    _add_model_args(p)
    _add_parallel_args(p)
    _add_training_args(p)
    _add_data_args(p)
    _add_checkpoint_args(p)
    _add_logging_args(p)
    _add_eval_tasks_args(p)
    megatron_lm_flags.add_arguments(p, _group)
    a("--debug-inject-nan-at-step", type=int, default=None, help=argparse.SUPPRESS)
    a("--debug-save-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # seconds inside each save (tests)
    a("--debug-fail-save-at", type=int, default=None, help=argparse.SUPPRESS)  # this iteration's save fails
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The recipe, config file and model flags."""
    g = _group(p, "recipe, config file and model", names_run=True)
    g("--recipe", default=None, names_run=False,
      help="start from a recipe: a name in recipes/, or module:function (also path/to/file.py:function) of your own "
           "that returns {argument: value}; --config and flags override it")
    # the path of a config file names no run: its values do, as every value does (a moved file: the same run)
    g("--config", default=None, metavar="FILE", names_run=False,
      help="YAML or JSON file of arguments under their flag names (a run's RUN/config.json works too and "
           "reproduces that run); overrides --recipe, flags override it")
    g("--print-config", action="store_true", names_run=False,
      help="print the resolved arguments as a config file (YAML) and exit 0; nothing is checked on disk")
    add_model_flags(g)  # model/args.py's ModelArgs: the shape and every arch switch
    g("--rotary-base", type=int, default=10000)
    g("--recompute-granularity", default=None, choices=["full", "selective"], names_run=False)
    g("--recompute-method", default=None, choices=["uniform", "block"],
      help="with --recompute-granularity full (Megatron-LM's meaning): uniform = checkpoint every "
           "--recompute-num-layers layers as one chunk, block = only the first --recompute-num-layers layers of "
           "each pipeline stage; default: uniform")
    g("--recompute-num-layers", type=int, default=1, names_run=False)


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    """The parallelism flags."""
    g = _group(p, "parallelism", names_run=False)
    g("--tensor-model-parallel-size", type=int, default=1)
    g("--pipeline-model-parallel-size", type=int, default=1)
    g("--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size", type=int, default=None)
    g("--sequence-parallel", action="store_true")
    g("--context-parallel-size", type=int, default=1, names_run=True, help="needs Transformer Engine attention (GPU)")
    g("--transformer-impl", default="auto", choices=["auto", "local", "transformer_engine"], names_run=True,
      help="layer implementation; auto = transformer_engine when it imports on a GPU, else local")
    g("--fp8-format", default=None, choices=["e4m3", "hybrid"], names_run=True,
      help="FP8 GEMMs (Transformer Engine, Hopper+)")
    g("--use-distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
      help="default: on with a GPU, off on CPU")
    g("--overlap-grad-reduce", action="store_true")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    """The batch and schedule flags."""
    g = _group(p, "batch and schedule", names_run=True)
    g("--micro-batch-size", type=int, default=2, names_run=False)
    g("--global-batch-size", type=int, default=8)
    g("--seq-length", type=int, default=32)
    g("--train-iters", type=int, default=20,
      help="steps to train; it or --train-samples is required unless --recipe or --config gives it (no default)")
    g("--train-samples", type=int, default=None, metavar="N",
      help="instead of --train-iters (Megatron-LM): N sequences, i.e. floor(N / global batch) steps")
    g("--lr", type=float, default=1e-3)
    g("--min-lr", type=float, default=0.0)
    g("--lr-warmup-iters", type=int, default=0)
    g("--lr-warmup-fraction", type=float, default=None, metavar="F",
      help="instead of --lr-warmup-iters (Megatron-LM): warm up over F x the decay length (--lr-decay-iters)")
    g("--lr-decay-style", default="cosine", choices=["cosine", "linear", "constant"])
    g("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g("--override-opt_param-scheduler", "--override-opt-param-scheduler", dest="override_opt_param_scheduler",
      action="store_true", names_run=False,
      help="on resume, follow this command's LR schedule (--lr, --min-lr, warmup, decay, --weight-decay) from the "
           "resumed iteration on, instead of the checkpoint's; the optimizer state is kept (Megatron-LM's flag)")
    g("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
      dest="use_checkpoint_opt_param_scheduler", action="store_true", names_run=False,
      help="on resume, keep the checkpoint's LR schedule and ignore this command's schedule flags (Megatron-LM's "
           "flag). Without either flag a resume whose schedule flags differ from the checkpoint's is refused")
    g("--clip-grad", type=float, default=1.0)
    g("--weight-decay", type=float, default=0.1)
    g("--weight-decay-params", default="matrices", choices=list(archs.WEIGHT_DECAY_PARAMS),
      help="matrices = no decay on 1-D tensors and biases (Megatron), all = every tensor (the SATFormer authors' "
           "AdamW(model.parameters()); the paper recipes)")
    g("--adam-beta1", type=float, default=0.9)
    g("--adam-beta2", type=float, default=0.95)
    g("--adam-eps", type=float, default=1e-8)
    g("--bf16", action=argparse.BooleanOptionalAction, default=None, names_run=False,
      help="default: on with a GPU, off on CPU")
    # FP16 with loss scaling (Megatron-LM's flags and defaults; megatron-core's grad scaler and fp16 optimizer)
    g("--fp16", action="store_true", names_run=False,
      help="fp16 weights and activations, fp32 main parameters, dynamic loss scaling (or --loss-scale); a step "
           "whose gradients overflow is skipped and counted (skipped_iters, loss_scale in metrics.jsonl)")
    g("--loss-scale", type=float, default=None, help="with --fp16: a constant loss scale (default: dynamic)")
    g("--initial-loss-scale", type=float, default=2.0**32, help="with --fp16: the dynamic scale's start")
    g("--min-loss-scale", type=float, default=1.0, help="with --fp16: the dynamic scale's floor")
    g("--loss-scale-window", type=float, default=1000,
      help="with --fp16: steps without overflow before the dynamic scale doubles")
    g("--hysteresis", type=int, default=2, help="with --fp16: overflows tolerated before the dynamic scale halves")
    # the DP gradient buffer's dtype (Megatron-LM's two flags): fp32 by default here, with or without --bf16
    g("--grad-reduce-in-bf16", action="store_true", names_run=False,
      help="with --bf16: accumulate the micro-batches' gradients and reduce them over data parallelism in bf16 "
           "(half the bytes on the wire, bf16 rounding in every sum). Default: in fp32")
    g("--accumulate-allreduce-grads-in-fp32", action="store_true", names_run=False,
      help="accumulate and reduce gradients in fp32 (Megatron-LM's flag): the default here; refused with "
           "--grad-reduce-in-bf16")
    g("--seed", type=int, default=1234)


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """The data flags."""
    g = _group(p, "data", names_run=False)
    g("--data-path", nargs="*", default=None, help="indexed dataset prefix(es) or a blend 'w1 p1 w2 p2'")
    g("--split", default="98,2,0")
    # separate datasets per split (Megatron-LM's names), instead of --data-path + --split; each a prefix or blend
    g("--train-data-path", nargs="*", default=None, help="training data: a prefix or a blend 'w1 p1 w2 p2'")
    g("--valid-data-path", nargs="*", default=None, help="validation data (default: none, no validation)")
    g("--test-data-path", nargs="*", default=None, help="test data")
    g("--data-args-path", default=None, metavar="FILE", names_run=True,
      help="instead of --data-path (Megatron-LM): a file holding the --data-path value (prefixes or a blend "
           "'w1 p1 w2 p2', whitespace-separated), for blends too long for a command line")
    g("--tokenizer-type", default=None, metavar="TYPE", names_run=True,
      help="Megatron-LM's tokenizer type: HuggingFaceTokenizer (the only kind read here, with --tokenizer-model), "
           "or NullTokenizer with --mock-data; default: HuggingFaceTokenizer")
    g("--tokenizer-model", default=None,
      help="HF tokenizer folder / tokenizer.json / hub name (Megatron-LM's meaning with HuggingFaceTokenizer)")
    g("--mock-data", action=argparse.BooleanOptionalAction, default=False, names_run=True,
      help="synthetic tokens (throughput runs) over --vocab-size ids, or over --tokenizer-model's vocabulary. "
           "--data-path or --embedded-data on the command line replaces a recipe's mock data")
    g("--embedded-data", default=None, metavar="DIR", names_run=True,
      help="build (once) the embedded corpus, a BPE tokenizer and its dataset in DIR and train on it")
    g("--vocab-size", type=int, default=None, names_run=True, help="mock data vocabulary / embedded BPE size")
    g("--data-cache-path", default=None)
    g("--allow-tokenizer-mismatch", action="store_true",
      help="train even though the data's .meta.json names a different tokenizer")
    g("--make-vocab-size-divisible-by", type=int, default=128, names_run=True,
      help="pad the model's vocabulary (x TP)")


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """The checkpoints and stopping flags."""
    g = _group(p, "checkpoints and stopping", names_run=False)
    g("--save", default=None, help="run folder: checkpoints, metrics.jsonl, config.json (default runs/RECIPE)")
    g("--load", default=None, help="resume from this folder's latest complete checkpoint")
    g("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    g("--ckpt-fallback", action="store_true",
      help="if the checkpoint to load is corrupt or missing, resume from the newest complete one before it")
    g("--no-verify-checkpoint", dest="verify_checkpoint", action="store_false",
      help="load without checking the files against the checkpoint's manifest (sizes and checksums)")
    g("--pretrained-checkpoint", default=None, metavar="DIR", names_run=True,
      help="when --load has nothing to resume, start from the model weights of DIR's latest checkpoint (fine-"
           "tuning, or an HF import under a new schedule): new optimizer, LR schedule, data order, iteration 0")
    g("--upcycle-gate-std", type=float, default=1e-4, metavar="STD", names_run=True,
      help="a SATFormer started from a Transformer's weights (--pretrained-checkpoint of a Transformer run, "
           "convert-from-hf --arch satformer) draws W_alpha from N(0, STD^2), seeded by --seed and the tensor's name: "
           "about half the ReLU gate open, within a tiny step of the Transformer's function; 0 is exactly the "
           "Transformer, whose ReLU gate never opens (no gradient at 0)")
    g("--save-interval", type=int, default=None)
    g("--save-retain-interval", type=int, default=None, metavar="N",
      help="after each save, delete the previous checkpoint unless its iteration is a multiple of N "
           "(Megatron-LM's meaning); default: keep every checkpoint")
    g("--async-save", action="store_true",
      help="write checkpoints in a background process (Megatron-Core's async dist-checkpoint save) while "
           "training goes on; each is finished before the next save, at the end and on a signal")
    g("--no-save-final", dest="save_final", action="store_false", help="skip the final checkpoint")
    g("--distributed-timeout-minutes", type=float, default=None,
      help="how long a collective of the process groups may wait before it fails (Megatron-LM's flag; default: "
           "30, or --hang-timeout-minutes / 0.8 if larger, so that the hang watchdog fires first; it also bounds "
           "rank 0's data checks while the others wait)")
    g("--hang-timeout-minutes", type=float, default=None,
      help="hang watchdog: a rank that makes no progress (a step, an evaluation pass, a save) for this long names "
           "the ranks that stopped and where, prints its Python stacks and exits 75, which slurm/launch.sh "
           "requeues (default: 0.8 x --distributed-timeout-minutes, else 10; 0: off). Must exceed the longest step, "
           "evaluation pass and save")
    g("--finetune", action="store_true", names_run=True,
      help="(Megatron-LM) load only the model weights of --load's checkpoint and start at iteration 0 with a new "
           "optimizer, LR schedule, RNG and data order; --save must be another folder")
    g("--no-load-optim", action="store_true", names_run=True,
      help="(Megatron-LM) resume --load without its optimizer state and LR schedule (both start afresh at the "
           "loaded iteration); weights, iteration, consumed samples and RNG are loaded")
    g("--no-load-rng", action="store_true", names_run=True, help="(Megatron-LM) resume --load without its RNG states")
    g("--ckpt-format", default="torch_dist", metavar="FORMAT", names_run=True,
      help="checkpoint format: torch_dist (Megatron-Core dist checkpointing) is the only one written and read here")
    g("--exit-signal-handler", action="store_true", names_run=True,
      help="accepted for Megatron-LM command lines; a no-op: SIGTERM / SIGUSR1 always save a checkpoint and exit 0")
    g("--exit-interval", type=int, default=None, help="save and exit at the first iteration that is a multiple of N")
    g("--exit-duration-in-mins", type=float, default=None, help="save and exit after this wall time")
    g("--eval-interval", type=int, default=None)
    g("--eval-iters", type=int, default=2)
    g("--eval-samples", type=int, default=None, metavar="N",
      help="sequences per evaluation (rounded up to a multiple of micro-batch x data-parallel size) instead of "
           "--eval-iters global batches")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    """The logging flags."""
    g = _group(p, "logging", names_run=False)
    g("--log-interval", type=int, default=10)
    g("--wandb-project", default=None)
    g("--wandb-exp-name", default=None)
    g("--wandb-mode", default=None, choices=["online", "offline", "disabled"],
      help="default: $WANDB_MODE, else online (wandb's own settings: WANDB_BASE_URL, HTTPS_PROXY, WANDB_INIT_TIMEOUT); "
           "offline with a warning when wandb cannot start online")
    g("--tensorboard-dir", default=None, metavar="DIR",
      help="also write TensorBoard event files to DIR (Megatron-LM's flag; the metrics.jsonl scalars; needs the "
           "tensorboard package)")
    g("--peak-tflops", type=float, default=None, help="peak TFLOP/s per device for MFU (default: device table)")
    g("--no-progress-bar", dest="progress_bar", action="store_false")


def _add_eval_tasks_args(p: argparse.ArgumentParser) -> None:
    """The downstream tasks (lm-eval, during training) flags."""
    # downstream tasks during training (megatron_sat/analysis/training_tasks.py); checked by eval_tasks_errors
    g = _group(p, "downstream tasks (lm-eval, during training)", names_run=True)
    g("--eval-tasks", default=None, metavar="TASKS",
      help="comma-separated lm-eval tasks scored on the model being trained, every --eval-tasks-interval steps and "
           "at the end (metrics.jsonl and wandb; a failing task is reported and training goes on); TP x DP, PP1")
    g("--eval-tasks-interval", type=int, default=None, metavar="N", help="every N steps (default: at the end only)")
    g("--eval-tasks-limit", type=float, default=None, metavar="K",
      help="examples per task (a fraction if < 1; default: all)")
    g("--eval-tasks-include-path", action="append", default=[], metavar="DIR",
      help="folder of local task YAMLs (repeatable; data_files relative to the YAML)")
    g("--eval-tasks-batch-size", type=int, default=None, metavar="B", help="requests per forward (default: micro-batch)")


def recipe_defaults(recipe: Optional[str], parser: Optional[argparse.ArgumentParser] = None) -> dict:
    """{dest: value} of `recipe` ({} for none); ValueError for an unknown recipe or one that sets arguments the
    trainer does not have."""
    import recipes  # the repository's recipes/ package (installed with this one)

    if not recipe:
        return {}
    defaults = recipes.get(recipe)
    unknown = [k for k in defaults if k not in _dests(parser or build_parser())]
    if unknown:
        raise ValueError(f"recipe {recipe!r} sets unknown arguments {unknown}")
    return defaults


# where a value came from, lowest first: each layer overrides the ones before it
SOURCES = ("default", "recipe", "config", "flag")


class Resolution(NamedTuple):
    """What the resolver found: the arguments, where each came from and what each layer said."""

    args: argparse.Namespace
    sources: Dict[str, str]   # {dest: one of SOURCES} for every argument (derived values: their own flag's source)
    defaults: dict            # the built-in defaults
    recipe: dict              # the recipe's values ({} without one)
    config: dict              # the config file's values ({} without one)

    def given(self, *layers: str) -> dict:
        """{dest: resolved value} of the arguments that came from `layers` (e.g. "recipe", "config")."""
        return {k: getattr(self.args, k) for k, src in self.sources.items() if src in layers}

    def record(self) -> dict:
        """What a run's config.json keeps of the resolution, for its readers (monitor.scale_name, the sweep tables):
        "sources" {dest: "recipe" | "config" | "flag"} of every argument not at its built-in default, and
        "recipe_values" {dest: value}, what the recipe itself said ({} without one)."""
        return dict(sources={k: src for k, src in self.sources.items() if src != "default"},
                    recipe_values=dict(self.recipe))


def resolve_layers(recipe: Optional[str], overrides: Sequence[str] = ()) -> Resolution:
    """recipe_args with where each value came from (Resolution): the tools that ask what a recipe or a config file
    set (the throughput profiler's defaults, the sweep's run names) read it here instead of reading the layers
    again. ValueError as recipe_args."""
    argv = (["--recipe", recipe] if recipe else []) + list(overrides)
    resolution, errors = _resolve(argv, read_files=False)[::2]
    if errors:
        raise ValueError("; ".join(errors))
    return resolution


def recipe_args(recipe: Optional[str], overrides: Sequence[str] = ()) -> argparse.Namespace:
    """The trainer's arguments for `recipe` (None: no recipe) with command-line `overrides`, which may hold
    --config FILE, resolved by the trainer's own layers (_resolve: recipe < config file < command line, then
    --train-samples and --lr-warmup-fraction) but not validated: no data needs to exist, and --data-args-path is
    not read (the trainer reads it). What every tool that reasons about a run works on: the planner, the dry run,
    the throughput profiler (profiling/settings.py), the Slurm sweep (its run names and TRAIN_ITERS) and the
    monitor. ValueError with the resolution's problems (an unknown recipe, an unreadable config file, a missing
    model shape, two values given for one setting, an unrecognized flag); a bad value of a flag exits 2 with one line,
as the trainer does. The values are not checked here: argument_checks.argument_errors does that (the planner and the
dry run call it with their target)."""
    return resolve_layers(recipe, overrides).args


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The trainer's arguments: recipe < config file < command line, resolved (_resolve), checked (every
    problem at once, one line, exit 2: the layers', unrecognized flags and the values'), then printed and exit 0
    (--print-config: the values are checked, nothing on disk) or returned. The checks that need the GPU and
    Transformer Engine run again in trainer.configure, where they are known."""
    return parse_run(argv).args


def parse_run(argv: Optional[List[str]] = None) -> Resolution:
    """parse_args with where each value came from (Resolution): what the trainer runs on, and records (config.json's
    "sources" and "recipe_values": run_folder.resolution_record)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        resolution, parser, errors = _resolve(argv, read_files=True)
    except ValueError as e:  # an unreadable config file or recipe
        refuse(build_parser().prog, [str(e)])
    args = resolution.args
    # Transformer Engine: known absent when it is not installed (whether it runs on a GPU: trainer.configure)
    te = False if importlib.util.find_spec("transformer_engine") is None else None
    errors += argument_errors(args, world_from_env(), inputs=not args.print_config, te=te)
    if errors:
        refuse(parser.prog, errors)
    if args.print_config:
        sys.stdout.write(dump_config(args, parser))
        sys.stdout.flush()
        sys.exit(0)
    return resolution


# the model shape: required flags unless a recipe or a config file gives them (Megatron-LM requires them)
REQUIRED_SHAPE = model_args.REQUIRED


def _resolve(argv: List[str], read_files: bool):
    """(Resolution, parser, errors): the recipe's values, the config file's over them, the command line's over
    both; then what depends on where a value came from (a data source, --train-samples, --lr-warmup-fraction,
    --data-args-path), with the problems found there. ValueError for an unreadable config file or recipe.
    read_files=False leaves --data-args-path unread (the tools that plan or name a run need no data)."""
    base = build_parser()
    given = explicit_dests(base, argv)  # the flags on the command line
    config = read_config(given["config"], base) if given.get("config") else {}
    recipe = given.get("recipe") or config.get("recipe")
    parser = build_parser()
    from_recipe = recipe_defaults(recipe, parser)
    parser.set_defaults(**from_recipe)
    parser.set_defaults(**config)
    if recipe:
        parser.set_defaults(recipe=recipe)
    args, unknown = parser.parse_known_args(argv)
    # where each value came from: 1 recipe, 2 config file, 3 command line (0: the built-in default)
    level = {k: 1 for k, v in from_recipe.items() if v is not None}
    level.update({k: 2 for k, v in config.items() if v is not None})
    level.update({k: 3 for k in given})
    errors = _resolve_layers(args, level, read_files) + megatron_lm_flags.resolve(args, level)
    if given.get("config"):  # an HF import's record: its placeholders must come from the command line
        errors += placeholder_errors(given["config"], given)
    not_here, unknown = megatron_lm_flags.unsupported(unknown)  # MoE, Megatron-FSDP: one problem each
    if unknown:  # reported with the other problems (argparse would stop at it with its usage)
        errors.insert(0, f"unrecognized arguments: {' '.join(unknown)} (--help lists the flags)")
    errors[:0] = not_here
    if not args.save:  # every run has a folder for metrics.jsonl, config.json and checkpoints
        args.save = os.path.join("runs", recipe_folder_name(args.recipe) if args.recipe else "run")
    sources = {dest: SOURCES[level.get(dest, 0)] for dest in _dests(parser) if dest != "help"}
    defaults = {a.dest: a.default for a in base._actions if a.dest != "help"}
    return Resolution(args, sources, defaults, from_recipe, config), parser, errors


def recipe_folder_name(recipe: str) -> str:
    """runs/NAME for a recipe: its name, or the function of a module:function (or path.py:function) recipe,
    so that a run folder's name holds no ':' or '/' (the Slurm sweep's run names start with it too)."""
    return recipe.rpartition(":")[2] if ":" in recipe else recipe


DATA_SOURCES = ("data_path", "embedded_data", "mock_data", "train_data_path", "data_args_path")


def _resolve_layers(args: argparse.Namespace, level: dict, read_files: bool = True) -> List[str]:
    """Apply what depends on the layer a value came from; returns the errors."""
    errors = []
    missing = [f"--{k.replace('_', '-')}" for k in REQUIRED_SHAPE if not level.get(k)]
    if not level.get("train_iters") and not level.get("train_samples"):
        missing.append("--train-iters (or --train-samples)")
    if missing:
        errors.append(f"the model shape and training length are required without a --recipe or --config that "
                      f"gives them: missing {', '.join(missing)}")
    # a data source from a higher layer replaces the lower layers' (and the mock vocabulary size that belongs to
    # a recipe's mock data), like any other recipe default
    sources = [k for k in DATA_SOURCES if getattr(args, k)]
    if sources:
        top = max(level.get(k, 0) for k in sources)
        winners = {k for k in sources if level.get(k, 0) == top}
        for k in set(sources) - winners:
            setattr(args, k, False if k == "mock_data" else None)
        if "mock_data" not in winners and level.get("vocab_size", 0) < top:
            args.vocab_size = None
    if args.data_args_path and read_files:
        errors += _read_data_args(args)
    # Megatron-LM's pairs: iteration- or sample-based length, warmup in iterations or as a fraction. Given at
    # the same layer both are refused, as Megatron-LM does; otherwise the higher layer's wins.
    if args.train_samples is not None:
        if level.get("train_iters", 0) == level.get("train_samples", 0):
            errors.append("give --train-iters or --train-samples, not both")
        elif level.get("train_iters", 0) > level.get("train_samples", 0):
            args.train_samples = None
        elif args.train_samples < args.global_batch_size:
            errors.append(f"--train-samples {args.train_samples} is less than one global batch "
                          f"({args.global_batch_size}): give at least {args.global_batch_size}")
        else:
            args.train_iters = args.train_samples // args.global_batch_size
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters and level.get("lr_warmup_iters", 0) == level.get("lr_warmup_fraction", 0):
            errors.append("give --lr-warmup-iters or --lr-warmup-fraction, not both")
        elif level.get("lr_warmup_iters", 0) > level.get("lr_warmup_fraction", 0):
            args.lr_warmup_fraction = None
        else:
            args.lr_warmup_iters = 0
    return errors


def _read_data_args(args: argparse.Namespace) -> List[str]:
    """--data-args-path FILE: FILE's whitespace-separated words become --data-path (Megatron-LM reads it so)."""
    if args.data_path:
        return ["give --data-path or --data-args-path, not both"]
    try:
        with open(args.data_args_path) as f:
            args.data_path = f.read().split()
    except (OSError, UnicodeDecodeError) as e:
        return [f"--data-args-path {args.data_args_path}: cannot read it ({getattr(e, 'strerror', None) or e})"]
    if not args.data_path:
        return [f"--data-args-path {args.data_args_path} is empty: write the --data-path value (a prefix or a "
                "blend 'w1 p1 w2 p2') in it"]
    return []


def _dests(parser) -> set:
    return {action.dest for action in parser._actions}
