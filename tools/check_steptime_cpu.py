"""The step-time model on this machine: measure the CPU (a short micro-benchmark), predict the step time of a small
recipe at 1 rank, TP2, PP2 (1F1B), PP2 interleaved and DP2, then train each under megatron-sat-torchrun and print
predicted against measured with the error (goal: within 25%). About 3-5 minutes on an idle 2-core machine.

    python tools/check_steptime_cpu.py                       # every layout, the default model
    python tools/check_steptime_cpu.py --layouts 1rank,pp2 --steps 12 --json out.json
    python tools/check_steptime_cpu.py --hidden-size 128 --seq-length 128     # another shape

Each rank runs one intra-op thread (OMP_NUM_THREADS=1) and is one "device" of the CPU description
(megatron_sat/profiling/cpu_hardware.py: GEMM FLOP/s at the model's shapes, memory bandwidth, gloo all-reduce
latency and bandwidth between two local processes, one op's dispatch time) and a step's time besides its
operators, the trainer's own (measured: the trainer at 1 rank and at DP2 on a tiny model of the same depth and
micro-batches, whose operators take a few ms, less the model's prediction for it); the same step-time model as
for GPUs (megatron_sat/steptime.predict_step) predicts each layout, nothing fitted per layout. Measured: the
median step_time_s of the logged windows after the first (warm-up) window in the run's metrics.jsonl, fp32,
mock data, the local (Megatron-Core) layer implementation. On a shared machine the timings carry its load: say so.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUTS = {  # name -> (processes, trainer flags)
    "1rank": (1, []),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp2-interleaved": (2, ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]),
    "dp2": (2, []),
}


def model_flags(opts) -> list:
    return ["--recipe", "debug_transformer", "--arch", opts.arch, "--num-layers", str(opts.num_layers),
            "--hidden-size", str(opts.hidden_size), "--num-attention-heads", str(opts.num_attention_heads),
            "--ffn-hidden-size", str(4 * opts.hidden_size), "--seq-length", str(opts.seq_length),
            "--vocab-size", str(opts.vocab_size), "--micro-batch-size", str(opts.micro_batch_size),
            "--global-batch-size", str(opts.global_batch_size), "--no-bf16"]


def measure_run(name: str, opts, workdir: str) -> float:
    """Train layout `name` for opts.steps steps; the median logged step time after the first window (s)."""
    nproc, flags = LAYOUTS[name]
    save = os.path.join(workdir, name)
    if os.path.exists(save):
        shutil.rmtree(save)  # the script's own temporary folder: the tiny runs reuse the layout names
    cmd = [sys.executable, "-m", "megatron_sat.torchrun", "--nproc-per-node", str(nproc), "--master-port",
           str(_port()), "-m", "megatron_sat.train", *model_flags(opts), *flags, "--train-iters", str(opts.steps),
           "--log-interval", str(opts.log_interval), "--save", save, "--save-interval", "100000", "--eval-interval", "100000",
           "--mock-data"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    with open(os.path.join(save, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r.get("step", 0) > opts.log_interval]
    if not times:
        raise RuntimeError(f"{name}: no step times after the first window in {save}/metrics.jsonl")
    return statistics.median(times)


TINY = dict(hidden_size=32, num_attention_heads=2, seq_length=32, vocab_size=128)  # operators of a few ms a step


def measure_step_overhead(opts, measured, workdir: str):
    """`measured` with the trainer's step besides its operators recorded at 1 and 2 ranks: the median step of the
    tiny model (TINY: the same layers, micro-batch size and global batch) at 1 rank and DP2, less the model's
    prediction of its operators."""
    tiny = argparse.Namespace(**{**vars(opts), **TINY})
    for name, ranks in (("1rank", 1), ("dp2", 2)):
        real = measure_run(name, tiny, os.path.join(workdir, "tiny"))
        measured = measured.with_step_overhead(ranks, real - predict(name, tiny, measured).step_time_s)
    return measured


def _port() -> int:
    from megatron_sat.parallel.process_group import free_port

    return free_port()


def predict(name: str, opts, measured) -> object:
    """The step-time model's StepPrediction of layout `name` on one node of the layout's processes, each one
    measured CPU rank with that many ranks busy (cpu_hardware.cpu_hardware), with the schedule flags the trainer
    resolves on a CPU (no distributed optimizer, no overlapped gradient reduction unless asked for)."""
    from megatron_sat import steptime
    from megatron_sat.model.args import model_args
    from megatron_sat.profiling.cpu_hardware import cpu_hardware
    from megatron_sat.training.planner import padded_vocab_size, resolve_args

    nproc, flags = LAYOUTS[name]
    args = resolve_args(None, model_flags(opts)[2:] + flags + ["--train-iters", "1"])
    layout = replace(steptime.layout_from_args(args, nproc), distributed_optimizer=bool(args.use_distributed_optimizer))
    cluster = steptime.Cluster(gpu=cpu_hardware(measured, ranks=nproc), nodes=1, gpus_per_node=nproc)
    return steptime.predict_step(model_args(args), layout, cluster, seq_length=args.seq_length,
                                 vocab_size=padded_vocab_size(args.vocab_size, args, args.tensor_model_parallel_size))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated from {', '.join(LAYOUTS)}")
    p.add_argument("--arch", default="transformer")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--log-interval", type=int, default=3)
    p.add_argument("--no-step-overhead", action="store_true",
                   help="leave the trainer's step besides its operators out (the operators alone)")
    p.add_argument("--verbose", action="store_true", help="also each prediction's breakdown (ms)")
    p.add_argument("--json", metavar="FILE", help="also write the rows and the measured CPU to FILE")
    opts = p.parse_args(argv)
    names = [n for n in opts.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"error: unknown layout(s) {', '.join(unknown)}; known: {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    # torch, the benchmark and the model only now that the arguments are good
    from megatron_sat.profiling.cpu_hardware import measure, model_shapes

    t0 = time.time()
    measured = measure(model_shapes(opts.hidden_size, 4 * opts.hidden_size, opts.num_attention_heads,
                                    opts.num_attention_heads, opts.micro_batch_size * opts.seq_length,
                                    opts.vocab_size), threads=1, ranks=2,
                       attention=(opts.micro_batch_size, opts.num_attention_heads, opts.seq_length,
                                  opts.hidden_size // opts.num_attention_heads))
    load = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        if not opts.no_step_overhead:
            measured = measure_step_overhead(opts, measured, work)
        print(measured, f"({time.time() - t0:.0f} s)", flush=True)
        for name in names:
            pred = predict(name, opts, measured)
            real = measure_run(name, opts, work)
            rows.append(dict(layout=name, predicted_s=pred.step_time_s, measured_s=real,
                             error=pred.step_time_s / real - 1, bubble_share=pred.bubble_share,
                             exposed_comm_share=pred.exposed_comm_share, load_average=os.getloadavg()[0]))
            print(f"  {name:<16} predicted {pred.step_time_s:7.3f} s  measured {real:7.3f} s  "
                  f"error {100 * rows[-1]['error']:+6.1f}%  (bubble {100 * pred.bubble_share:.0f}%, exposed comm "
                  f"{100 * pred.exposed_comm_share:.0f}%; load {rows[-1]['load_average']:.1f})", flush=True)
            if opts.verbose:
                print("    " + pred.format().splitlines()[-1].strip(), flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"mean |error| {100 * statistics.fmean(abs(r['error']) for r in rows):.1f}%, worst {100 * worst:.1f}% "
          f"(goal 25%); load average {load:.1f} on {os.cpu_count()} cores at the start; {time.time() - t0:.0f} s")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(cpu=measured.as_dict(), load_average=load, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
