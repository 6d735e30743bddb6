#!/usr/bin/env python
"""Evaluate a Hugging Face export or a Megatron checkpoint with lm-eval: the paper's retrieval suite, a zero-shot
suite, or any tasks.

    python tools/evaluate.py --model hf/satformer --suite retrieval --output evals/satformer-retrieval
    python tools/evaluate.py --checkpoint runs/denseformer --suite retrieval --output evals/denseformer-retrieval
    torchrun --nproc-per-node 2 tools/evaluate.py --checkpoint runs/satformer_1.3B --tensor-model-parallel-size 2 \
        --suite zeroshot --output runs/satformer_1.3B/eval/zeroshot
    python tools/evaluate.py --model hf/satformer --suite zeroshot --device cuda --batch-size 16 --output evals/z
    python tools/evaluate.py --model hf/satformer --tasks megatron_sat_tiny_mc --include-path tests/data/eval

lm-eval's command line, as typed, goes to lm-eval's own CLI (every flag and form of lm-eval 0.4.13: the `run`, `ls`
and `validate` subcommands, -b -o -s -L -f -C -t, --model_args k=v k2=v2, --gen_kwargs, --apply_chat_template,
--trust_remote_code, --write_out, --use_cache, --wandb_args, ...) with the megatron_sat backend registered and the
shipped task folder searched (megatron_sat/analysis/lm_eval_cli.py). It is lm-eval's form when the line starts with
a subcommand, or uses none of this tool's own flags and names an lm-eval model (--model hf, --model megatron_sat,
--model_args ...); `megatron-sat-evaluate run --help` shows lm-eval's options:

    megatron-sat-evaluate run --model hf --model_args pretrained=hf/satformer trust_remote_code=True \
        -t piqa,hellaswag -f 0 -b 8 -o evals -s --seed 1234
    # evals/<model path, sanitized>/results_<time>.json and samples_<task>_<time>.jsonl, lm-eval's layout
    megatron-sat-evaluate run --model megatron_sat --model_args checkpoint=runs/satformer -t piqa -b 8 -o evals
    megatron-sat-evaluate run --checkpoint runs/satformer -t piqa -b 8 -o evals     # the same
    lm_eval --model megatron_sat --model_args checkpoint=runs/satformer -t piqa     # lm-eval itself, once installed

This tool's own form also takes lm-eval's spellings --tasks a,b, --output_path, --log_samples, --seed, --num_fewshot,
--batch_size, --include_path and --model hf --model_args pretrained=DIR[,dtype=...,max_length=...] (other keys:
exit 2) when mixed with its own flags (--checkpoint, --suite, --output, ...).

--model takes an export (lm-eval's HF backend); --checkpoint takes a trainer run folder or one of its
iter_XXXXXXX folders, any arch and any saved layout, evaluated with no conversion by the megatron_sat
backend (megatron_sat/analysis/lm_eval_backend.py; greedy generation without a KV cache). Its files are checked
against its manifest.json first, as the trainer checks a resume (a corrupt file: one line, exit 2;
--no-verify-checkpoint to skip); an unfinished iter_XXXXXXX.tmp is never read.

Prints a Markdown table; --output DIR also writes DIR/results.json and DIR/results.md. Built-in
tasks download their data; offline, use local task YAMLs (--include-path). See
megatron_sat/analysis/evaluation.py. With --checkpoint RUN, --output may lie inside RUN (not in its
iter_* folders): RUN/eval/retrieval is where tools/collect_grid.py finds the scores. Needs
lm-eval[hf]==0.4.13. Exit codes: 0 done, 2 bad input.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# light: lm-eval and torch are imported inside evaluation's functions, so --help and bad input answer at once
# (tests/test_evaluate.py::test_help_imports_no_torch)
from megatron_sat.analysis import lm_eval_cli  # noqa: E402
from megatron_sat.analysis.evaluation import SUITES, EvaluationError, evaluate, to_markdown, write_results  # noqa: E402
from megatron_sat.outputs import check_output  # noqa: E402
from megatron_sat.parallel.world import world_from_env  # noqa: E402

# the flags of this tool's own form that lm-eval's CLI does not have: any of them selects this form
OWN_FLAGS = ("--checkpoint", "--suite", "--include-path", "--skip-missing", "--batch-size", "--dtype", "--num-fewshot",
             "--max-length", "--output", "--tensor-model-parallel-size", "--no-verify-checkpoint")
HF_MODEL_ARGS = ("pretrained", "dtype", "max_length", "trust_remote_code")  # --model hf --model_args in this form


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if lm_eval_cli.is_lm_eval_form(argv, OWN_FLAGS):
        return lm_eval_cli.run(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="lm-eval's own command line works as typed: megatron-sat-evaluate run --help")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="HF model folder (tools/convert_to_hf.py --output)")
    which.add_argument("--checkpoint", help="Megatron run folder or iter_XXXXXXX folder (any arch, no conversion)")
    p.add_argument("--suite", action="append", default=[], choices=sorted(SUITES), help="task suite (repeatable)")
    p.add_argument("--model_args", default=None, metavar="pretrained=DIR,...",
                   help="lm-eval's form, with --model hf: pretrained= the HF folder (dtype= and max_length= are read "
                        "too)")
    p.add_argument("--tasks", nargs="*", default=[],
                   help="lm-eval task names, space- or comma-separated (lm-eval's --tasks a,b)")
    p.add_argument("--include-path", "--include_path", action="append", default=[], help="folder of extra task YAMLs")
    p.add_argument("--skip-missing", action="store_true", help="skip tasks lm-eval does not know")
    p.add_argument("--batch-size", "--batch_size", default="1")
    p.add_argument("--device", default=None, help="cuda when there is one, else cpu")
    p.add_argument("--dtype", default="auto", help="auto (the model's / checkpoint's), float32, bfloat16")
    p.add_argument("--limit", type=float, default=None, help="examples per task (a fraction if < 1; debugging)")
    p.add_argument("--num-fewshot", "--num_fewshot", type=int, default=None)
    p.add_argument("--seed", default="1234", metavar="S[,S,S,S]",
                   help="lm-eval's seeds (python, numpy, torch, few-shot): one integer for all four, or four "
                        "comma-separated values, None for one left unset (lm-eval's form)")
    p.add_argument("--max-length", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--output", default=None, help="folder for results.json and results.md")
    p.add_argument("--output_path", default=None, metavar="DIR",
                   help="lm-eval's output layout in DIR: DIR/<model>/results_<time>.json (+ samples with --log_samples)")
    p.add_argument("--log_samples", action="store_true",
                   help="with --output_path: every request and response, samples_<task>_<time>.jsonl (lm-eval's)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="N",
                   help="--checkpoint at TP N, launched with torchrun --nproc-per-node N (default: one process)")
    p.add_argument("--no-verify-checkpoint", dest="verify_checkpoint", action="store_false",
                   help="--checkpoint: read it without checking its files against its manifest.json (as the "
                        "trainer's flag of that name)")
    args = p.parse_args(argv)
    _lm_eval_forms(p, args)
    args.device = args.device or ("cuda" if _cuda() else "cpu")
    tasks = [t for s in args.suite for t in SUITES[s]] + [t.strip() for x in args.tasks for t in x.split(",")
                                                          if t.strip()]
    if not tasks:
        p.error("give --suite and/or --tasks")
    if args.model and (os.path.isfile(os.path.join(args.model, "latest_checkpointed_iteration.txt")) or
                       os.path.isfile(os.path.join(args.model, "metadata.json"))):
        p.error(f"--model {args.model} is a Megatron checkpoint: convert it first "
                f"(python tools/convert_to_hf.py --load {args.model} --output HF_DIR), then --model HF_DIR; "
                f"or evaluate it as it is with --checkpoint {args.model}")
    if args.checkpoint and not os.path.isdir(args.checkpoint):
        p.error(f"--checkpoint {args.checkpoint} is not a folder: pass a trainer run folder or an iter_XXXXXXX folder")
    if args.checkpoint and os.path.isfile(os.path.join(args.checkpoint, "config.json")) and \
            not os.path.isfile(os.path.join(args.checkpoint, "latest_checkpointed_iteration.txt")) and \
            any(f.endswith((".safetensors", ".bin")) for f in os.listdir(args.checkpoint)):
        p.error(f"--checkpoint {args.checkpoint} is a Hugging Face folder: pass it as --model {args.checkpoint}")
    world = world_from_env()  # torchrun's WORLD_SIZE, or srun's SLURM_NTASKS in a job step
    if not args.verify_checkpoint and not args.checkpoint:
        p.error("--no-verify-checkpoint is for --checkpoint (an HF --model has no manifest)")
    if args.tensor_model_parallel_size != 1 and not args.checkpoint:
        p.error("--tensor-model-parallel-size needs --checkpoint (an HF --model runs in one process)")
    if args.tensor_model_parallel_size < 1 or world != args.tensor_model_parallel_size:
        p.error(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} needs exactly that many processes "
                f"(torchrun --nproc-per-node {args.tensor_model_parallel_size}); this launch has {world}")
    source = ("--model", args.model) if args.model else ("--checkpoint", args.checkpoint)
    try:
        for flag, out in (("--output", args.output), ("--output_path", args.output_path)):
            if not (args.checkpoint and out and _beside_checkpoints(out, args.checkpoint)):
                check_output(flag, out, dict([source]))
    except ValueError as e:
        p.error(str(e))

    try:
        summary = evaluate(args.model, list(dict.fromkeys(tasks)), checkpoint=args.checkpoint,
                           include_paths=args.include_path,
                           batch_size=args.batch_size, device=args.device, dtype=args.dtype, limit=args.limit,
                           num_fewshot=args.num_fewshot, max_length=args.max_length, skip_missing=args.skip_missing,
                           tensor_parallel=args.tensor_model_parallel_size, verify_checkpoint=args.verify_checkpoint,
                           seed=args.seed, output_path=args.output_path, log_samples=args.log_samples)
    except EvaluationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) != 0:  # tensor-parallel ranks computed the same: rank 0 reports
        return 0
    print(to_markdown(summary))
    if args.output:
        write_results(summary, args.output)
        print(f"wrote {os.path.join(args.output, 'results.json')} and results.md")
    return 0


def _lm_eval_forms(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """lm-eval's forms onto ours: --model hf --model_args pretrained=DIR, --seed S or S,S,S,S, --log_samples."""
    if args.model_args is not None:
        if args.model != "hf":
            p.error("--model_args goes with --model hf (lm-eval's form); or pass the HF folder as --model DIR")
        fields = dict(kv.split("=", 1) for kv in args.model_args.split(",") if "=" in kv)
        unknown = sorted(set(fields) - set(HF_MODEL_ARGS))
        if unknown:
            p.error(f"--model_args {', '.join(unknown)}: this form reads only {', '.join(HF_MODEL_ARGS)}; for any "
                    f"argument of lm-eval's HF backend use lm-eval's form (megatron-sat-evaluate run --model hf ...)")
        if "pretrained" not in fields:
            p.error("--model_args needs pretrained=DIR (the Hugging Face model folder)")
        args.model = fields["pretrained"]
        args.dtype = fields.get("dtype", args.dtype)
        if fields.get("max_length"):
            args.max_length = int(fields["max_length"])
    elif args.model == "hf":
        p.error("--model hf needs --model_args pretrained=DIR (lm-eval's form), or pass the folder as --model DIR")
    parts = [x.strip() for x in str(args.seed).split(",")]
    try:
        seeds = [None if x == "None" else int(x) for x in parts]
    except ValueError:
        p.error(f"--seed {args.seed}: give an integer or four comma-separated integers (None for one left unset)")
    if len(seeds) not in (1, 3, 4):
        p.error(f"--seed {args.seed}: give one value or four (python, numpy, torch, few-shot)")
    args.seed = seeds[0] if len(seeds) == 1 else tuple(seeds + [1234] * (4 - len(seeds)))  # lm-eval's 4th default
    if args.log_samples and not args.output_path:
        p.error("--log_samples needs --output_path DIR (lm-eval's layout, where the samples are written)")


def _beside_checkpoints(output: str, run: str) -> bool:
    """An output folder inside a run folder but in none of its iter_XXXXXXX checkpoints (run/eval/retrieval,
    where tools/collect_grid.py reads the scores): allowed, it touches no file of the run."""
    out, run = os.path.realpath(output), os.path.realpath(run)
    if os.path.basename(run).startswith("iter_") or not out.startswith(run + os.sep):
        return False
    return not os.path.relpath(out, run).split(os.sep)[0].startswith(("iter_", "latest_checkpointed_iteration"))


def _cuda() -> bool:
    try:
        import torch  # only to pick the default device: ~2 s that --help and bad input do not pay

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
