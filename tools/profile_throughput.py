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
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_sat.archs import ARCHS  # (import-free: the help and the parser need no megatron)
from megatron_sat.model.args import SHAPE  # no torch either

# The rest of the library (torch, megatron: profiling/settings.py, throughput.py, report.py) is imported inside the
# functions main calls once the command line is parsed, so that --help answers at once.


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--archs", nargs="+", default=list(ARCHS), help=f"archs to compare (default: all of {', '.join(ARCHS)})")
    a("--baseline", default="transformer", help="the arch every ratio divides by")
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(spec: dict, world: int, tag: str) -> dict:
    """One worker launch (torchrun when world > 1); its raw record, or SystemExit with the log tail."""
    out = spec["out_dir"]
    for sub in ("raw", "logs"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    spec_path, raw_path = os.path.join(out, "raw", f"{tag}.spec.json"), os.path.join(out, "raw", f"{tag}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f, indent=1)
    worker = ["-m", "megatron_sat.profiling.throughput", "--spec", spec_path, "--out", raw_path]
    cmd = [sys.executable] + (["-m", "torch.distributed.run", f"--nproc-per-node={world}",
                               f"--master-port={_free_port()}"] if world > 1 else []) + worker
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    if world == 1:  # a lone rank, whatever Slurm variables this shell inherited
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    log_path = os.path.join(out, "logs", f"{tag}.log")
    t0 = time.time()
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    with open(log_path) as f:
        text = f.read()
    if rc or not os.path.isfile(raw_path):
        errors = [line for line in text.splitlines() if line.startswith("error: ")]
        if errors:
            sys.exit(f"profile_throughput.py: {errors[0][7:]}")
        sys.exit(f"profile_throughput.py: run {tag} failed (exit {rc}); {log_path} ends with:\n{text[-4000:]}")
    print(f"  {tag}: done in {time.time() - t0:.0f} s", flush=True)
    with open(raw_path) as f:
        return json.load(f)


def _in_job(spec: dict):
    """--mode shared inside torchrun/srun: profile here; the raw record on rank 0, None elsewhere."""
    import torch

    from megatron_sat import compat

    compat.ensure_cpu_compat()
    from megatron_sat.parallel.process_group import init_from_env
    from megatron_sat.profiling import throughput

    init_from_env()
    rank = torch.distributed.get_rank()
    try:
        record = throughput.run(spec, (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None))
    except ValueError as e:
        sys.exit(f"profile_throughput.py: {e}")
    torch.distributed.barrier()
    return record


def main(argv=None) -> int:
    parser = build_parser()
    options = parser.parse_args(argv)
    from megatron_sat.profiling import settings as resolution

    try:
        settings = resolution.resolve(options)
    except ValueError as e:
        parser.error(str(e))
    world, out = settings["world_size"], settings["out_dir"]
    if settings["mode"] == "shared" and resolution.job_world():
        record = _in_job(dict(settings, tag="shared"))
        if record is None:
            return 0
        records = [record]
    else:
        runs = [("shared", list(settings["archs"]))] if settings["mode"] == "shared" else [
            (f"{a}_r{r + 1}", [a]) for r in range(settings["repeats"])
            for a in (settings["archs"] if r % 2 == 0 else settings["archs"][::-1])]
        print(f"profiling {', '.join(settings['archs'])} ({settings['source']}), {len(runs)} launch(es) of "
              f"{world} process(es); logs in {os.path.join(out, 'logs')}", flush=True)
        records = []
        for i, (tag, archs) in enumerate(runs):
            first = i < len(settings["archs"])  # detail (flops profile, traces) on the first pass only
            spec = dict(settings, archs=archs, tag=tag, flops_profile=settings["flops_profile"] and first,
                        trace_steps=settings["trace_steps"] if first else None)
            records.append(_launch(spec, world, tag))
    return _report(settings, records)


def _report(settings: dict, records: list) -> int:
    from megatron_sat.profiling import report

    raw = report.merge_runs(records)
    device = records[0]["device"]
    peak = _peak_flops(settings, device)
    s = settings["sizes"]
    info = dict(settings, device=device, layout=records[0]["layout"], peak_tflops=peak / 1e12 if peak else None,
                shape=f"L{s['num_layers']} h{s['hidden_size']} heads {s['num_attention_heads']}/"
                      f"{s['num_query_groups'] or s['num_attention_heads']} seq {settings['seq_length']} "
                      f"mbs {settings['micro_batch_size']} gbs {settings['global_batch_size']}")
    rows = report.summarize(raw, info, peak, settings["baseline"])
    notes = _notes(info, peak)
    modules = {a: (raw[a].get("deepspeed") or {}).get("modules") for a in settings["archs"] if raw[a].get("deepspeed")}
    paths = report.write_outputs(settings["out_dir"], info, rows, notes, modules)
    print(f"\n{info['device']} | {info['layout']} | {info['precision']} | {info['shape']} | "
          f"{rows[0]['steps']} measured steps per arch ({settings['mode']})")
    print(report.format_table(rows))
    for n in notes:
        print(f"note: {n}")
    print("wrote " + ", ".join(paths.values()))
    return 0


def _peak_flops(settings, device):
    if settings.get("peak_tflops"):
        return settings["peak_tflops"] * 1e12
    from megatron_sat.model.flops import PEAK_TFLOPS

    return next((t * 1e12 for k, t in PEAK_TFLOPS.items() if k in device), None)


def _notes(info: dict, peak) -> list:
    notes = []
    if peak is None:
        notes.append("MFU not reported: no peak FLOP/s for this device (pass --peak-tflops); tflops_per_gpu is "
                     "the achieved model FLOP rate")
    if info["mode"] == "shared":
        notes.append("shared mode: GPU memory = the arch's resident bytes + its largest transient peak; CPU RSS "
                     "cannot be split between archs of one process (use --mode per-arch)")
    elif "CPU" not in info["device"]:
        notes.append("GPU memory: torch.cuda.max_memory_allocated / max_memory_reserved since the warm-up, max over "
                     "ranks, one arch per process")
    else:
        notes.append("CPU wall time moves with whatever else runs on the machine: compare step_s_min and the "
                     "process CPU time (step_cpu_s_median) as well as the median")
        notes.append("CPU memory is the process's peak RSS; rss_above_start_mib excludes what imports and process "
                     "groups held before the model was built (the ratio uses it)")
    notes.append("saved activations: bytes autograd keeps for one micro-batch's forward on the busiest rank")
    return notes


if __name__ == "__main__":
    sys.exit(main())
