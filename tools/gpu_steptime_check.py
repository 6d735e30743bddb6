"""The step-time model against this GPU: GEMM throughput at the paper models' shapes and the benchmarked
forward + backward of one micro-batch, measured against predicted (tools/gpu_check.sh runs it after its step
benchmark; about a minute).

    python tools/gpu_steptime_check.py --benchmarks OUT/benchmark_760M_bf16.json OUT/benchmark_1.3B_bf16.json \
        --output OUT/steptime_check.json   # --gpu H100: another gpus.json row (default: the device's)

1. GEMMs: torch.matmul in bf16 at the shapes of the 760M and 1.3B models' layers for one micro-batch of 4096 tokens
   (QKV, output projection, FC1, FC2, logits) and one large square GEMM, timed with CUDA events (median of 20 after
   5 warm-ups); beside each, the roofline's prediction for the --gpu row of gpus.json and the ratio. The measured
   over predicted ratio says how this GPU's isolated GEMMs compare with the calibrated (in-training) efficiency.
2. Step: each arch's measured forward + backward of one micro-batch (tools/benchmark_step.py's JSON: the real model,
   megatron-core's local spec here) against the model's forward + backward of the same micro-batch on one GPU (no
   optimizer, no communication), with the ratio: what calibrating the --gpu row on this machine would correct.
Without a CUDA device it prints one line and exits 0 (nothing to measure; the predictions need no GPU).
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat.model.args import ModelArgs
from megatron_sat.model.sizes import PAPER_SCALES, PAPER_VOCAB
from megatron_sat.model.wire import chunk_layers
from megatron_sat.steptime import Layout, cluster, gpu_names, load_gpu
from megatron_sat.steptime.layer_costs import stage_costs
from megatron_sat.steptime.roofline import gemm_time

TOKENS = 4096  # one micro-batch of the paper's sequence length


def gemm_shapes(scale: str) -> list:
    """(name, m, n, k) of one layer's GEMMs and the logits at `scale` for TOKENS tokens (TP1; SwiGLU FC1)."""
    s = PAPER_SCALES[scale]
    h, f = s["hidden_size"], s["ffn_hidden_size"]
    d = h // s["num_attention_heads"]
    qkv = (s["num_attention_heads"] + 2 * s["num_query_groups"]) * d
    return [(f"{scale} QKV", TOKENS, qkv, h), (f"{scale} output projection", TOKENS, h, h),
            (f"{scale} FC1", TOKENS, 2 * f, h), (f"{scale} FC2", TOKENS, h, f),
            (f"{scale} logits", TOKENS, PAPER_VOCAB, h)]


def predicted_gemms(gpu: str, scales=("760M", "1.3B")) -> list:
    """Every shape with its predicted time and TFLOP/s on `gpu` (no GPU needed)."""
    hw = load_gpu(gpu)
    rows = []
    for name, m, n, k in [s for scale in scales for s in gemm_shapes(scale)] + [("square 8192", 8192, 8192, 8192)]:
        t = gemm_time(hw, m, n, k)
        rows.append(dict(name=name, m=m, n=n, k=k, predicted_ms=1e3 * t, predicted_tflops=2 * m * n * k / t / 1e12))
    return rows


def predicted_micro_batch(arch: str, sizes: dict, gpu: str, seq_length: int, micro_batch_size: int,
                          vocab_size: int) -> float:
    """Seconds of one micro-batch's forward + backward of `arch` on one `gpu` (the model's stage costs)."""
    model = ModelArgs(arch=arch, **sizes)
    chunks = chunk_layers(model.num_layers, 1)
    fwd, bwd = stage_costs(model, Layout(micro_batch_size=micro_batch_size), cluster(f"1x1x{gpu}"), seq_length,
                           vocab_size, chunks)
    return fwd[0][0].total + bwd[0][0].total


def measure_gemms(rows: list) -> None:
    import torch  # here: the predictions above run without torch

    for r in rows:
        a = torch.randn(r["m"], r["k"], device="cuda", dtype=torch.bfloat16)
        b = torch.randn(r["k"], r["n"], device="cuda", dtype=torch.bfloat16)
        times = []
        for i in range(25):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b)
            end.record()
            torch.cuda.synchronize()
            if i >= 5:
                times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        r.update(measured_ms=ms, measured_tflops=2 * r["m"] * r["n"] * r["k"] / (ms * 1e-3) / 1e12,
                 measured_over_predicted=r["predicted_ms"] / ms)


def compare_benchmarks(paths: list, gpu: str) -> list:
    out = []
    for path in paths:
        if not os.path.exists(path):  # the benchmark did not run (or failed): nothing to compare for it
            print(f"gpu_steptime_check: no {path}, its micro-batches are not compared")
            continue
        with open(path) as f:
            bench = json.load(f)
        sizes = {k: v for k, v in bench["sizes"].items() if k in PAPER_SCALES["760M"]}
        seq, mbs = bench.get("seq_length", 4096), bench.get("micro_batch_size", 1)
        for row in bench["rows"]:
            arch = row["arch"].partition(":")[0]
            pred = predicted_micro_batch(arch, sizes, gpu, seq, mbs, bench.get("vocab_size", PAPER_VOCAB))
            measured = row["step_ms_median"] * 1e-3
            out.append(dict(file=os.path.basename(path), arch=row["arch"], measured_ms=1e3 * measured,
                            predicted_ms=1e3 * pred, predicted_over_measured=pred / measured))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="auto",
                        help="the gpus.json row to predict with (default: the one the device's name contains, else H200)")
    parser.add_argument("--benchmarks", nargs="*", default=[], help="tools/benchmark_step.py --json files")
    parser.add_argument("--output", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.gpu != "auto":
        try:
            load_gpu(args.gpu)
        except ValueError as e:
            print(f"gpu_steptime_check: {e}", file=sys.stderr)
            return 2
    import torch  # here: --help and bad input answer at once

    if not torch.cuda.is_available():
        print("gpu_steptime_check: no CUDA device, nothing measured (skipped)")
        return 0
    if args.gpu == "auto":
        args.gpu = next((n for n in gpu_names() if n in torch.cuda.get_device_name()), "H200")
    gemms = predicted_gemms(args.gpu)
    measure_gemms(gemms)
    print(f"GEMMs, bf16, on {torch.cuda.get_device_name()} against the {args.gpu} row:")
    print(f"{'shape':<26} {'m x n x k':>22} {'measured':>9} {'predicted':>9} {'meas/pred':>9}  (TFLOP/s)")
    for r in gemms:
        print(f"{r['name']:<26} {r['m']:>6} x {r['n']:>6} x {r['k']:>6} {r['measured_tflops']:>9.0f} "
              f"{r['predicted_tflops']:>9.0f} {r['measured_over_predicted']:>9.2f}")
    steps = compare_benchmarks(args.benchmarks, args.gpu)
    if steps:
        print("one micro-batch forward + backward (tools/benchmark_step.py), measured against predicted:")
        for r in steps:
            print(f"  {r['file']:<28} {r['arch']:<20} measured {r['measured_ms']:8.1f} ms, predicted "
                  f"{r['predicted_ms']:8.1f} ms, predicted / measured {r['predicted_over_measured']:.2f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), gpu_row=args.gpu, gemms=gemms, steps=steps), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
