#!/usr/bin/env python
"""Evaluate a Hugging Face export or a Megatron checkpoint with lm-eval: the paper's retrieval suite, a zero-shot
suite, or any tasks.

    python tools/evaluate.py --model hf/satformer --suite retrieval --output evals/satformer-retrieval
    python tools/evaluate.py --checkpoint runs/denseformer --suite retrieval --output evals/denseformer-retrieval
    torchrun --nproc-per-node 2 tools/evaluate.py --checkpoint runs/satformer_1.3B --tensor-model-parallel-size 2 \
        --suite zeroshot --output runs/satformer_1.3B/eval/zeroshot
    python tools/evaluate.py --model hf/satformer --suite zeroshot --device cuda --batch-size 16 --output evals/z
    python tools/evaluate.py --model hf/satformer --tasks megatron_sat_tiny_mc --include-path tests/data/eval

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


def main(argv=None) -> int:
    from megatron_sat.analysis.evaluation import SUITES
    from megatron_sat.outputs import check_output

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="HF model folder (tools/convert_to_hf.py --output)")
    which.add_argument("--checkpoint", help="Megatron run folder or iter_XXXXXXX folder (any arch, no conversion)")
    p.add_argument("--suite", action="append", default=[], choices=sorted(SUITES), help="task suite (repeatable)")
    p.add_argument("--tasks", nargs="*", default=[], help="lm-eval task names")
    p.add_argument("--include-path", action="append", default=[], help="folder of extra task YAMLs")
    p.add_argument("--skip-missing", action="store_true", help="skip tasks lm-eval does not know")
    p.add_argument("--batch-size", default="1")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--dtype", default="auto", help="auto (the model's / checkpoint's), float32, bfloat16")
    p.add_argument("--limit", type=float, default=None, help="examples per task (debugging)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--max-length", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--output", default=None, help="folder for results.json and results.md")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="N",
                   help="--checkpoint at TP N, launched with torchrun --nproc-per-node N (default: one process)")
    p.add_argument("--no-verify-checkpoint", dest="verify_checkpoint", action="store_false",
                   help="--checkpoint: read it without checking its files against its manifest.json (as the "
                        "trainer's flag of that name)")
    args = p.parse_args(argv)
    tasks = [t for s in args.suite for t in SUITES[s]] + list(args.tasks)
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
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not args.verify_checkpoint and not args.checkpoint:
        p.error("--no-verify-checkpoint is for --checkpoint (an HF --model has no manifest)")
    if args.tensor_model_parallel_size != 1 and not args.checkpoint:
        p.error("--tensor-model-parallel-size needs --checkpoint (an HF --model runs in one process)")
    if args.tensor_model_parallel_size < 1 or world != args.tensor_model_parallel_size:
        p.error(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} needs exactly that many processes "
                f"(torchrun --nproc-per-node {args.tensor_model_parallel_size}); this launch has {world}")
    source = ("--model", args.model) if args.model else ("--checkpoint", args.checkpoint)
    try:
        if not (args.checkpoint and args.output and _beside_checkpoints(args.output, args.checkpoint)):
            check_output("--output", args.output, dict([source]))
    except ValueError as e:
        p.error(str(e))
    from megatron_sat.analysis.evaluation import EvaluationError, evaluate, to_markdown, write_results

    try:
        summary = evaluate(args.model, list(dict.fromkeys(tasks)), checkpoint=args.checkpoint,
                           include_paths=args.include_path,
                           batch_size=args.batch_size, device=args.device, dtype=args.dtype, limit=args.limit,
                           num_fewshot=args.num_fewshot, max_length=args.max_length, skip_missing=args.skip_missing,
                           tensor_parallel=args.tensor_model_parallel_size, verify_checkpoint=args.verify_checkpoint)
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


def _beside_checkpoints(output: str, run: str) -> bool:
    """An output folder inside a run folder but in none of its iter_XXXXXXX checkpoints (run/eval/retrieval,
    where tools/collect_grid.py reads the scores): allowed, it touches no file of the run."""
    out, run = os.path.realpath(output), os.path.realpath(run)
    if os.path.basename(run).startswith("iter_") or not out.startswith(run + os.sep):
        return False
    return not os.path.relpath(out, run).split(os.sep)[0].startswith(("iter_", "latest_checkpointed_iteration"))


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
