"""Throughput and memory of the real training step, per arch, against the Transformer.

CPU (debug sizes; every arch, one process per arch and repeat, a few minutes on 2 cores):
    python tools/profile_throughput.py --recipe debug_satformer --out runs/profile_cpu
    python tools/profile_throughput.py --recipe debug_satformer --nproc 2 --pp 2 --out runs/profile_pp2
    python tools/profile_throughput.py --recipe debug_satformer --flops-profile --trace-steps 2-2 --out runs/p
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

from megatron_sat.archs import ARCHS, arch_errors, arch_label, arch_label_errors  # (import-free: no megatron here)
from megatron_sat.training.arguments import MODEL_CONFIG_KEYS

ALIASES = {"hyper_connections": "hyperconnections", "hyper-connections": "hyperconnections", "hc": "hyperconnections",
           "mudd": "muddformer", "dwa": "denseformer"}  # other spellings of the baselines, for a hint
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size")


def _job_world() -> int:
    """World size of the distributed job this process is a rank of (torchrun: WORLD_SIZE; srun: SLURM_NTASKS,
    read the way megatron_sat.train reads it), or 0 when it was started alone."""
    env = os.environ
    if env.get("WORLD_SIZE"):
        return int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and env.get("SLURM_NTASKS"):
        return int(env["SLURM_NTASKS"])
    return 0


def _recipes():
    import recipes

    try:
        import recipes.paper  # noqa: F401  (registers the paper grid when it is there)
    except ImportError:
        pass
    return recipes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--archs", nargs="+", default=list(ARCHS), help=f"archs to compare (default: all of {', '.join(ARCHS)})")
    a("--baseline", default="transformer", help="the arch every ratio divides by")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--recipe", help="take shapes, batch, layout and precision from this recipe (e.g. "
                                      "debug_satformer, satformer_760M); its arch is replaced by each of --archs")
    src.add_argument("--scale", help="a paper scale (130M, 340M, 760M, 1.3B: the paper recipe at that scale) or a "
                                     "recipes.SIZES shape (tiny, demo, small, ...)")
    for name in SHAPE_KEYS + ("seq_length", "micro_batch_size", "global_batch_size", "vocab_size"):
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


def _resolve(args, parser) -> dict:
    """The run's settings from recipe/scale + flags; parser.error on anything invalid (no megatron import)."""
    bad = arch_label_errors(args.archs)
    if bad:
        hints = [f"{a}: did you mean {ALIASES[a.lower()]}?" for a in args.archs if a.lower() in ALIASES]
        parser.error("\n  ".join(bad) + (f" ({'; '.join(hints)})" if hints else ""))
    if len(set(args.archs)) != len(args.archs):
        parser.error(f"--archs lists an arch twice: {' '.join(args.archs)}")
    if args.baseline not in args.archs:
        parser.error(f"--baseline {args.baseline} must be one of --archs ({' '.join(args.archs)}): ratios divide by it")
    recipes = _recipes()
    if args.scale:
        paper = getattr(recipes, "paper", None)
        if paper is not None and f"satformer_{args.scale}" in recipes.RECIPES:
            base, source = recipes.get(f"satformer_{args.scale}"), f"recipe satformer_{args.scale}"
        elif args.scale in recipes.SIZES:
            base, source = dict(recipes.SIZES[args.scale], seq_length=512, micro_batch_size=1, vocab_size=32000), \
                f"size {args.scale}"
        else:
            known = [s for s in getattr(paper, "SCALES", ())] + list(recipes.SIZES)
            parser.error(f"unknown --scale {args.scale!r}; known: {', '.join(known)}")
    else:
        name = args.recipe or "debug_transformer"
        try:
            base = recipes.get(name)
        except ValueError as e:
            parser.error(str(e))
        source = f"recipe {name}"
    s = {k: base.get(k) for k in SHAPE_KEYS}
    for k in SHAPE_KEYS:
        if getattr(args, k) is not None:
            s[k] = getattr(args, k)
    if s["num_layers"] is None or s["hidden_size"] is None or s["num_attention_heads"] is None:
        parser.error(f"{source} sets no model shape; give --num-layers, --hidden-size and --num-attention-heads")
    pick = lambda flag, key, default: flag if flag is not None else base.get(key, default)  # noqa: E731
    seq, mbs = pick(args.seq_length, "seq_length", 512), pick(args.micro_batch_size, "micro_batch_size", 1)
    vocab = pick(args.vocab_size, "vocab_size", 32000)
    tp, pp = pick(args.tp, "tensor_model_parallel_size", 1), pick(args.pp, "pipeline_model_parallel_size", 1)
    vpp = pick(args.vpp, "num_virtual_stages_per_pipeline_rank", None)
    sp = bool(pick(args.sp, "sequence_parallel", False))
    env_world = _job_world()
    world = args.nproc or env_world or 1
    if args.nproc and env_world and args.nproc != env_world:
        parser.error(f"--nproc {args.nproc} inside a job of world size {env_world}: drop --nproc")
    errors = []
    checks = (("--steps", args.steps), ("--repeats", args.repeats), ("--nproc", world), ("--tp", tp), ("--pp", pp),
              ("--seq-length", seq), ("--micro-batch-size", mbs), ("--vocab-size", vocab),
              ("--threads", 1 if args.threads is None else args.threads))
    for name, v in checks:
        if v < 1:
            errors.append(f"{name} must be >= 1 (got {v})")
    if args.warmup < 0:
        errors.append(f"--warmup must be >= 0 (got {args.warmup})")
    if not errors and world % (tp * pp):
        errors.append(f"world size {world} is not divisible by TP x PP = {tp} x {pp} (set --nproc)")
    dp = world // (tp * pp) if not errors else 1
    gbs = pick(args.global_batch_size, "global_batch_size", None) or mbs * dp * (2 * pp if pp > 1 else 1)
    if not errors and gbs % (mbs * dp):
        errors.append(f"global batch {gbs} is not divisible by micro-batch x DP = {mbs} x {dp}")
    if s["num_layers"] % (pp * (vpp or 1)):
        errors.append(f"num_layers={s['num_layers']} is not divisible by PP x VPP = {pp} x {vpp or 1}")
    trace = None
    if args.trace_steps:
        try:
            first, _, last = args.trace_steps.partition("-")
            trace = [int(first), int(last or first)]
        except ValueError:
            errors.append(f"--trace-steps wants A-B or A (measured steps, 1-based), got {args.trace_steps!r}")
        else:
            if not 1 <= trace[0] <= trace[1] <= args.steps:
                errors.append(f"--trace-steps {args.trace_steps} is outside the measured steps 1-{args.steps}")
    if not 0 <= args.trace_rank < world:
        errors.append(f"--trace-rank {args.trace_rank} is not a rank of a world of {world}")
    if args.mode == "per-arch" and env_world:
        errors.append("--mode per-arch launches its own processes: run it outside torchrun/srun (with --nproc)")
    recompute = args.recompute or base.get("recompute_granularity") or "none"
    for arch in args.archs:  # what an arch refuses (megatron_sat/archs.py), with the tool's flag names
        errors += [e.replace("--recompute-granularity", "--recompute") for e in
                   arch_errors(arch_label(arch)[0], recompute_granularity=None if recompute == "none" else recompute)]
    if errors:
        parser.error("\n  ".join(["invalid settings:"] + errors))
    rec = {} if recompute == "none" else (dict(recompute_granularity="selective") if recompute == "selective" else
                                          dict(recompute_granularity="full", recompute_method="uniform",
                                               recompute_num_layers=base.get("recompute_num_layers", 1)))
    return dict(
        archs=list(args.archs), baseline=args.baseline, source=source, sizes=s,
        arch_options={k: base[k] for k in MODEL_CONFIG_KEYS if base.get(k) is not None},
        seq_length=seq, micro_batch_size=mbs, global_batch_size=gbs, vocab_size=vocab,
        layout=dict(tp=tp, pp=pp, vpp=vpp, sp=sp), world_size=world, recompute=rec,
        precision=args.precision or ({True: "bf16", False: "fp32"}.get(base.get("bf16"))),
        use_distributed_optimizer=args.use_distributed_optimizer if args.use_distributed_optimizer is not None
        else base.get("use_distributed_optimizer"),
        backend=args.backend, warmup=args.warmup, steps=args.steps, seed=args.seed, trace_steps=trace,
        trace_rank=args.trace_rank, flops_profile=args.flops_profile, out_dir=os.path.abspath(args.out),
        mode=args.mode or ("shared" if env_world else "per-arch"), repeats=args.repeats,
        peak_tflops=args.peak_tflops, threads=args.threads, lr=base.get("lr", 1e-4),
        rotary_base=base.get("rotary_base", 10000),
    )


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
    settings = _resolve(parser.parse_args(argv), parser)
    import torch  # after the argument checks: only the device-dependent defaults need it

    gpu = torch.cuda.is_available()
    settings["bf16"] = (settings["precision"] or ("bf16" if gpu else "fp32")) == "bf16"
    settings["precision"] = "bf16" if settings["bf16"] else "fp32"
    if settings["use_distributed_optimizer"] is None:
        settings["use_distributed_optimizer"] = gpu
    world, out = settings["world_size"], settings["out_dir"]
    if settings["mode"] == "shared" and _job_world():
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
