"""The throughput profiler's launches (tools/profile_throughput.py parses the command line and calls `run`): one
worker launch per arch and repeat (torchrun when the layout needs several processes), or the profile inside an
existing torchrun/srun job, then the merged table, figures and notes (profiling/report.py)."""

import json
import os
import subprocess
import sys
import time

import torch

from megatron_sat import compat
from megatron_sat.model.flops import peak_tflops_of
from megatron_sat.parallel.process_group import init_from_env
from megatron_sat.parallel.world import free_port
from megatron_sat.profiling import report, throughput
from megatron_sat.profiling import settings as resolution

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # what the workers import


def run(settings: dict) -> int:
    """Profile what `settings` (profiling/settings.py resolve) describes: inside an existing torchrun/srun job
    (--mode shared), or one launch per arch and repeat in alternating order; then the table and the outputs.
    Returns the exit status; SystemExit with one line when a run fails."""
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
                               f"--master-port={free_port()}"] if world > 1 else []) + worker
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    if world == 1:  # a lone rank, whatever Slurm variables this shell inherited
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
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
    compat.ensure_cpu_compat()
    init_from_env()
    rank = torch.distributed.get_rank()
    try:
        record = throughput.run(spec, (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None))
    except ValueError as e:
        sys.exit(f"profile_throughput.py: {e}")
    torch.distributed.barrier()
    return record


def _report(settings: dict, records: list) -> int:
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
    tflops = peak_tflops_of(device)
    return tflops * 1e12 if tflops else None


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
