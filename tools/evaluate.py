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

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# light: lm-eval and torch are imported inside evaluation's functions, so --help and bad input answer at once
# (tests/test_evaluate.py::test_help_imports_no_torch)
from megatron_sat.analysis import evaluate_command, lm_eval_cli
from megatron_sat.analysis.evaluation import EvaluationError, evaluate, to_markdown, write_results
from megatron_sat.parallel.world import world_from_env


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if lm_eval_cli.is_lm_eval_form(argv, evaluate_command.OWN_FLAGS):
        return lm_eval_cli.run(argv)
    # every check of the arguments, one line and exit 2 for bad input (analysis/evaluate_command.py)
    args = evaluate_command.parse(argv, world=world_from_env(), description=__doc__.split("\n\n")[0])
    args.device = args.device or ("cuda" if _cuda() else "cpu")
    try:
        summary = evaluate(args.model, args.tasks, checkpoint=args.checkpoint, include_paths=args.include_path,
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


def _cuda() -> bool:
    try:
        import torch  # only to pick the default device: ~2 s that --help and bad input do not pay

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
