"""Every arch's predicted step time on a GPU relative to the Transformer at the same layout (docs/step_time.md).

    python tools/arch_steptime.py                          # the paper's 760M and 1.3B grid points, their clusters
    python tools/arch_steptime.py --scales 760M --gpu H200 --markdown
    python tools/arch_steptime.py --json
    python tools/arch_steptime.py --update-docs   # rewrite docs/step_time.md's arch table

Each scale runs every arch at the Transformer recipe's layout (transformer_<scale>: TP, PP, micro-batch, recompute,
global batch 512 x 4096) on the recipe's default cluster (recipes/paper.py CLUSTERS) unless --gpu / --nodes say
otherwise, so that the ratio is the arch's cost alone (a baseline whose recipe needs a smaller micro-batch to fit
in memory would run slower still). Beside the ratios: the paper's throughput claims (SATFormer ~1.75x the
throughput of Hyper-Connections and ~1.82x that of MUDDFormer at 760M), the project's goal (SATFormer's step within
1.02x the Transformer's) and the operators that make the difference (the breakdown's largest extra seconds).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat import archs
from megatron_sat.archs import ARCHS
from megatron_sat.model.args import model_args
from megatron_sat.model.sizes import PAPER_SCALES
from megatron_sat.steptime import cluster, layout_from_args, predict_step
from megatron_sat.steptime.published import replace_block
from megatron_sat.training.planner import default_cluster, resolve_args

# SATFormer's throughput over each baseline's at 760M, as the paper reports it (the arch modules' paper_satformer_vs)
PAPER_CLAIMS = {a: archs.get(a).paper_satformer_vs[0] for a in ARCHS if archs.get(a).paper_satformer_vs}
GOAL = 1.02  # SATFormer's step time over the Transformer's on a GPU (the project's goal)


def rows_for(scale: str, gpu=None, nodes=None) -> list:
    base = resolve_args(f"transformer_{scale}")
    c = default_cluster(f"transformer_{scale}")
    cl = cluster(f"{nodes or c['nodes']}x{c['gpus_per_node']}x{gpu or c['gpu']}")
    layout = layout_from_args(base, cl.world_size)
    out = []
    ref = None
    for arch in ARCHS:
        args = resolve_args(f"{arch}_{scale}")
        p = predict_step(model_args(args), layout, cl, seq_length=args.seq_length, vocab_size=args.vocab_size)
        if arch == archs.REFERENCE:
            ref = p
        extra = {k: v - ref.breakdown.get(k, 0.0) for k, v in p.breakdown.items()}
        top = sorted(((k, v) for k, v in extra.items() if v > 1e-4), key=lambda kv: -kv[1])[:3]
        out.append(dict(scale=scale, arch=arch, cluster=str(cl), layout=str(layout), step_time_s=p.step_time_s,
                        mfu=p.mfu, tflops_per_gpu=p.tflops_per_gpu, vs_transformer=p.step_time_s / ref.step_time_s,
                        extra_ms={k: round(1e3 * v, 1) for k, v in top}))
    sat = next(r for r in out if r["arch"] == archs.SUBJECT)
    for r in out:
        r["satformer_speedup"] = r["step_time_s"] / sat["step_time_s"]
    return out


def markdown(rows: list) -> str:
    lines = ["| scale | arch | step (s) | MFU | vs Transformer | SATFormer's throughput over it | paper's claim "
             "| what makes the difference (extra ms a step) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        claim = PAPER_CLAIMS.get(r["arch"]) if r["scale"] == "760M" else None
        goal = f"goal <= {GOAL}" if r["arch"] == archs.SUBJECT else ""
        diff = ", ".join(f"{k} {v:g}" for k, v in r["extra_ms"].items()) or "-"
        lines.append(f"| {r['scale']} | {r['arch']} | {r['step_time_s']:.3f} | {100 * r['mfu']:.1f}% | "
                     f"{r['vs_transformer']:.3f} {goal} | {r['satformer_speedup']:.2f}x | "
                     f"{f'{claim}x' if claim else ''} | {diff} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", default="760M,1.3B", help="comma-separated paper scales (default 760M,1.3B)")
    parser.add_argument("--gpu", help="GPU of gpus.json (default: the recipe's cluster's)")
    parser.add_argument("--nodes", type=int, help="nodes (default: the recipe's cluster's)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--update-docs", action="store_true", help="rewrite the arch table of docs/step_time.md")
    args = parser.parse_args()
    scales = [s.strip() for s in args.scales.split(",")]
    unknown = [s for s in scales if s not in PAPER_SCALES]
    if unknown:
        print(f"arch_steptime: unknown scale(s) {', '.join(unknown)}; use {', '.join(PAPER_SCALES)}", file=sys.stderr)
        return 2
    try:
        rows = [r for s in scales for r in rows_for(s, args.gpu, args.nodes)]
    except ValueError as e:
        print(f"arch_steptime: {e}", file=sys.stderr)
        return 2
    if args.update_docs:
        docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "step_time.md")
        replace_block(docs, "arch-table", markdown(rows))
        print(f"updated {docs}")
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.markdown:
        print(markdown(rows))
    else:
        for r in rows:
            claim = PAPER_CLAIMS.get(r["arch"]) if r["scale"] == "760M" else None
            print(f"{r['scale']:>5} {r['arch']:<17} {r['layout']} on {r['cluster']}: step {r['step_time_s']:.3f} s, "
                  f"MFU {100 * r['mfu']:.1f}%, x{r['vs_transformer']:.3f} the Transformer's"
                  + (f" (goal <= {GOAL})" if r["arch"] == archs.SUBJECT else "")
                  + f", SATFormer {r['satformer_speedup']:.2f}x its throughput"
                  + (f" (paper: {claim}x)" if claim else "")
                  + ("; extra ms: " + ", ".join(f"{k} {v:g}" for k, v in r["extra_ms"].items()) if r["extra_ms"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
