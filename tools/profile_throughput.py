"""Throughput and memory of the real training step, per arch, against the Transformer.

CPU (debug sizes; every arch, one process per arch and repeat, a few minutes on 2 cores):
    python tools/profile_throughput.py --recipe debug_satformer --out runs/profile_cpu
    python tools/profile_throughput.py --recipe debug_satformer --nproc 2 --pp 2 --out runs/profile_pp2
    python tools/profile_throughput.py --recipe debug_satformer --flops-profile --trace-steps 2-2 --out runs/p
    python tools/profile_throughput.py --config exp.yaml --archs transformer satformer --out runs/profile_exp
SATFormer's two gate implementations side by side (an arch label 'satformer:IMPL', IMPL fused or separate):
    python tools/profile_throughput.py --recipe debug_satformer --archs transformer satformer satformer:separate \
        --mode shared --out runs/profile_gate
GPU, the paper's 760M comparison on one node (8 GPUs, BF16, the recipe's layout and batch):
    python tools/profile_throughput.py --scale 760M --nproc 8 --steps 10 --out runs/profile_760M
    python tools/profile_throughput.py --scale 1.3B --nproc 8 --steps 10 --out runs/profile_1.3B   # MFU target 45%
Inside an existing distributed job (torchrun's WORLD_SIZE, or srun's SLURM_NTASKS): all archs in that job
    torchrun --nproc-per-node 8 tools/profile_throughput.py --scale 760M --steps 10
    srun --ntasks-per-node 8 python tools/profile_throughput.py --recipe satformer_760M   (slurm/profile.sbatch)

Each arch runs the trainer's step (Megatron schedule for the layout, forward + backward over the
step's micro-batches, AdamW with clipping) on random tokens: `--warmup` steps, then `--steps`
measured steps. Machine drift is cancelled by alternation:
  --mode per-arch (default): one launch per arch, `--repeats` times, in alternating order
                 (A B C, C B A, ...): every memory figure (GPU peak allocated / reserved, or peak
                 RSS on CPU) then belongs to one arch alone;
  --mode shared: all archs in one launch, alternating every step (tighter timing; GPU memory is
                 each arch's resident bytes + its transient peak, CPU RSS is not separable).
Per arch: tokens/s per GPU, step time (median, min, max), MFU (analytic FLOPs, megatron_sat/
model/flops.py; on CPU only with --peak-tflops), peak memory, saved activations per micro-batch,
pipeline bytes per micro-batch (PP > 1, counted in the communicator) and every figure's ratio to
the baseline; with satformer in --archs also SATFormer's throughput and memory against every other arch
(the form of the paper's claims: 1.75x / 1.82x the throughput of Hyper-Connections / MUDDFormer at 760M,
31% / 5% less memory). Outputs in --out: throughput.json / .csv / .png (+ raw/ and logs/), the table on
stdout; with --flops-profile modules_<arch>.csv (DeepSpeed's per-module FLOPs and latency) and with
--trace-steps torch.profiler traces (trace_*.json, ops_*.txt) of those measured steps on --trace-rank.
Exit status: 0, or 2 on bad arguments (message on stderr), 1 when a run fails (its log tail shown).
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_sat.archs import ARCHS, REFERENCE  # (import-free: the help and the parser need no megatron)
from megatron_sat.model.args import SHAPE  # no torch either
from megatron_sat.training.argument_checks import refusal  # no torch
from megatron_sat.training.arguments import Parser  # the trainer's one-line refusals (no torch)

# The rest of the library (torch, megatron: profiling/settings.py and launch.py) is imported in main once the
# command line is parsed, so that --help answers at once.


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # one-line refusals
    a = p.add_argument
    a("--archs", nargs="+", default=list(ARCHS), help=f"archs to compare (default: all of {', '.join(ARCHS)})")
    a("--baseline", default=REFERENCE, help="the arch every ratio divides by")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--recipe", help="take shapes, batch, layout and precision from this recipe (e.g. "
                                      "debug_satformer, satformer_760M); its arch is replaced by each of --archs")
    a("--config", metavar="FILE", help="the trainer's config file (YAML or JSON): shapes, batch, layout and precision "
                                       "over --recipe's, as the trainer resolves them (its arch is replaced too)")
    src.add_argument("--scale", help="a paper scale (130M, 340M, 760M, 1.3B: the paper recipe at that scale) or a "
                                     "recipes.SIZES shape (tiny, demo, small, ...)")
    for name in SHAPE + ("seq_length", "micro_batch_size", "global_batch_size", "vocab_size"):  # the trainer's flags
        a("--" + name.replace("_", "-"), type=int, default=None)
    a("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=None)
    a("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=None)
    a("--vpp", "--num-virtual-stages-per-pipeline-rank", dest="vpp", type=int, default=None)
    a("--sp", "--sequence-parallel", dest="sp", action="store_true", default=None)
    a("--nproc", type=int, default=None, help="processes (GPUs) to launch with torchrun; default 1, or the "
                                                  "world size of the job this runs in")
    a("--precision", choices=["bf16", "fp32"], default=None,
      help="default: the recipe's, else bf16 on GPU, fp32 on CPU")
    a("--backend", choices=["local", "te"], default=None,
      help="default: te on a GPU with Transformer Engine, else local")
    a("--recompute", choices=["none", "selective", "full"], default=None, help="default: the recipe's")
    a("--use-distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
      help="default: the recipe's, else on with a GPU")
    a("--warmup", type=int, default=2, help="untimed optimizer steps per arch and run")
    a("--steps", type=int, default=5, help="measured optimizer steps per arch and run")
    a("--repeats", type=int, default=2, help="--mode per-arch: launches per arch (alternating order)")
    a("--mode", choices=["per-arch", "shared"], default=None,
      help="per-arch: a launch per arch (default); shared: all archs in one launch (default inside torchrun)")
    a("--peak-tflops", type=float, default=None,
      help="peak TFLOP/s per device for MFU (default: GPU table; none on CPU)")
    a("--flops-profile", action="store_true", help="DeepSpeed flops profiler: per-module FLOPs and forward latency")
    a("--trace-steps", default=None, metavar="A-B", help="torch.profiler traces of measured steps A..B (1-based)")
    a("--trace-rank", type=int, default=0, help="global rank that writes traces and the module breakdown")
    a("--threads", type=int, default=None, help="torch intra-op threads per process (CPU; default: torch's). 1 keeps "
                                                "CPU timings steadier on a machine shared with other jobs")
    a("--seed", type=int, default=1234)
    a("--mock-data", action="store_true", help="accepted for trainer-style command lines: the data is always random "
                                                "tokens (input is not what is measured)")
    a("--output", "--out", dest="out", default="runs/profile", help="output folder (--out: the older name)")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    options = parser.parse_args(argv)
    from megatron_sat.profiling import launch
    from megatron_sat.profiling import settings as resolution

    try:
        settings = resolution.resolve(options)
    except ValueError as e:  # every problem (settings.SettingsError's args), on one line, exit 2
        parser.exit(2, refusal(parser.prog, list(e.args)) + "\n")
    return launch.run(settings)


if __name__ == "__main__":
    sys.exit(main())
