"""Step time and memory of every arch against the Transformer (and SATFormer against every arch), same size
and layout.

    python tools/benchmark_step.py                                  # CPU-sized default
    python tools/benchmark_step.py --scale 760M --seq-length 4096 --bf16 --rounds 20   # on a GPU
    python tools/benchmark_step.py --archs transformer satformer satformer:dot_product   # A/B of one arch
    python tools/benchmark_step.py --archs transformer satformer satformer:separate --seq-length 256  # gate A/B

Forward+backward of one micro-batch per arch, the archs interleaved round by round in one process
(megatron_sat/profiling/step_benchmark.py); prints each arch's median step time, saved-activation
memory (and peak GPU memory on a GPU) with ratios to the Transformer, tokens/s and (on a GPU) MFU from
the analytic FLOPs. An arch label 'arch:variant' runs a variant of the arch beside it (megatron_sat.archs.ARCH_VARIANTS).
Goal on a GPU for SATFormer: <= 1.02.
With satformer among --archs also SATFormer's speed-up and memory saving against each arch (the paper, 760M:
1.75x / 1.82x faster than Hyper-Connections / MUDDFormer, 31% / 5% less memory).
"""

import argparse
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore", module="megatron")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat.archs import ARCH_VARIANTS, ARCHS, REFERENCE, SUBJECT, arch_label_errors
from megatron_sat.model.sizes import PAPER_SCALES


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", nargs="+", default=list(ARCHS),
                   metavar="ARCH[:VARIANT]", help="archs, and variants: satformer:separate / satformer:fused (the "
                   f"SATFormer gate's implementation), ARCH:dot_product (Megatron's attention); all: {list(ARCH_VARIANTS)}")
    p.add_argument("--scale", choices=list(PAPER_SCALES), help="a paper scale instead of the sizes below")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--num-query-groups", type=int, default=None)
    p.add_argument("--ffn-hidden-size", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--backend", choices=["local", "te"], default=None, help="default: te on a GPU with TE, else local")
    p.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                   help="FP8 GEMMs (Transformer Engine on Hopper+; with --bf16; not for the dense baselines)")
    p.add_argument("--output", "--json", dest="json", metavar="FILE",
                   help="also write the rows to this JSON file (--json: the older name)")
    args = p.parse_args()
    for error in arch_label_errors(args.archs):
        p.error(error)
    if REFERENCE not in args.archs:
        p.error("--archs must include transformer (the baseline of the ratios)")
    # torch and megatron-core only now that the arguments are good: --help and bad input answer at once
    import torch

    from megatron_sat import compat
    from megatron_sat.model.specs import te_available
    from megatron_sat.parallel.layout import Layout, initialize
    from megatron_sat.parallel.process_group import init_from_env
    from megatron_sat.profiling import step_benchmark

    if args.fp8_format and not (te_available() and args.bf16 and args.backend != "local"):
        p.error("--fp8-format needs Transformer Engine on a GPU (backend te) and --bf16")
    compat.ensure_cpu_compat()
    init_from_env(single_only=True)
    initialize(Layout())
    sizes = dict(PAPER_SCALES[args.scale]) if args.scale else dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups or args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"device: {device}; sizes: {sizes}; seq {args.seq_length} x mbs {args.micro_batch_size}; "
          f"{'bf16' if args.bf16 else 'fp32'}{' + fp8 ' + args.fp8_format if args.fp8_format else ''}", flush=True)
    results = step_benchmark.run(args.archs, sizes, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                 vocab_size=args.vocab_size, rounds=args.rounds, warmup=args.warmup, bf16=args.bf16,
                                 backend=args.backend, fp8=args.fp8_format, log=lambda s: print(s, flush=True))
    rows = step_benchmark.summarize(results)
    w = max(12, *(len(a) for a in args.archs))
    print(f"\n{'arch':<{w}} {'params':>13} {'step ms (med)':>14} {'min':>8} {'max':>8} {'time x':>7} "
          f"{'tokens/s':>9} {'MFU':>6} {'activ. MiB':>11} {'activ. x':>9} {'peak MiB':>9} {'peak x':>7}")
    for r in rows:
        peak = f"{r['peak_mib']:>9.0f} {r['peak_ratio']:>7.3f}" if r["peak_mib"] else f"{'n/a':>9} {'n/a':>7}"
        mfu = f"{100 * r['mfu']:>5.1f}%" if r["mfu"] else f"{'n/a':>6}"
        print(f"{r['arch']:<{w}} {r['params']:>13,} {r['step_ms_median']:>14.1f} {r['step_ms_min']:>8.1f} "
              f"{r['step_ms_max']:>8.1f} {r['time_ratio']:>7.3f} {r['tokens_per_s']:>9.0f} {mfu} "
              f"{r['activation_mib']:>11.1f} {r['activation_ratio']:>9.3f} {peak}")
    if SUBJECT in args.archs and len(args.archs) > 1:
        print(f"\n{'satformer vs':<{w}} {'speed-up':>9} {'activ. saved':>13} {'peak saved':>11}")
        for r in rows:
            if r["arch"] != SUBJECT:
                peak = "n/a" if r["satformer_peak_saving"] is None else f"{100 * r['satformer_peak_saving']:.1f}%"
                print(f"{r['arch']:<{w}} {r['satformer_speedup']:>8.2f}x "
                      f"{100 * r['satformer_activation_saving']:>12.1f}% {peak:>11}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, sizes=sizes, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
