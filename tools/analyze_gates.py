#!/usr/bin/env python
"""Where a SATFormer's gates open: per layer and head, per token, and perplexity with the gates ablated.

    python tools/analyze_gates.py --model hf/demo --output runs/gates_demo          # embedded held-out text
    python tools/analyze_gates.py --model hf/satformer --data val.jsonl --seq-length 2048 --device cuda \\
        --output gates/satformer

--model is a SATFormer export (tools/convert_to_hf.py). Prints a Markdown report; --output DIR also
writes report.json, layers.csv, tokens.csv, heatmap.png and report.md. See
megatron_sat/analysis/gate_report.py. Exit codes: 0 done, 2 bad input.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat.outputs import check_output  # no torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="SATFormer HF folder (tools/convert_to_hf.py --output)")
    p.add_argument("--data", action="append", default=[],
                   help=".jsonl/.txt file or folder (repeatable); default: the embedded corpus' held-out tail")
    p.add_argument("--text-key", default="text", help="jsonl field holding the text")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per sequence (default: min(1024, model's))")
    p.add_argument("--max-sequences", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default=None, help="default: cuda when there is a GPU, else cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-ablations", dest="ablations", action="store_false",
                   help="skip the two extra passes with the gates set to 0 and to their means")
    p.add_argument("--min-count", type=int, default=5, help="occurrences a token needs to be ranked")
    p.add_argument("--top", type=int, default=20, help="tokens listed at each end of the ranking")
    p.add_argument("--output", default=None, help="folder for the report files")
    args = p.parse_args(argv)
    for name in ("seq_length", "max_sequences", "batch_size", "min_count", "top"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        for flag, path in [("--model", args.model)] + [("--data", d) for d in args.data]:
            check_output("--output", args.output, {flag: path})
    except ValueError as e:
        p.error(str(e))

    # torch and transformers only now that the arguments are good: --help and bad input answer at once
    import torch

    from megatron_sat.analysis.gate_report import GateReportError, analyze, read_documents, to_markdown, write_report

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        documents = read_documents(args.data, args.text_key) if args.data else None
        report = analyze(args.model, documents, seq_length=args.seq_length, max_sequences=args.max_sequences,
                         batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                         ablations=args.ablations, min_count=args.min_count, top=args.top)
    except GateReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(to_markdown(report))
    if args.output:
        paths = write_report(report, args.output)
        print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
