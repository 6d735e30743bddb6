"""Optional detail for tools/profile_throughput.py: where the FLOPs and the time go.

    python tools/profile_throughput.py --recipe debug_satformer --flops-profile --trace-steps 2-2 --out runs/p

* `flops_profile`: DeepSpeed's flops profiler (exact counts on CPU as on GPU: it wraps torch's matmul
  and functional ops) over one forward-only pass of the step's micro-batches. Returns the forward
  FLOPs per token it counted over all ranks next to the analytic count (megatron_sat/model/flops.py),
  and writes `modules_<tag>.csv` on the chosen rank: every module of the model, layers folded
  (decoder.layers.*.self_attention...), with forward FLOPs, parameters and forward latency
  (DeepSpeed's hooks synchronise the device around each module) and their shares of the total.
  It counts matmuls, not elementwise ops written as Python operators (the value-residual mix
  `v + alpha * v1` is invisible to it); the gate's x @ W_alpha is counted. Its matmul rule counts a
  matrix @ vector product (Hyper-Connections' normed streams @ w_beta) as if the vector were a
  square matrix; `_matmul_flops` replaces that rule while profiling.
* `torch_trace`: a torch.profiler trace of one step, `trace_<name>.json` (open in chrome://tracing
  or https://ui.perfetto.dev) and `ops_<name>.txt`, the top operators by self time.
"""

import csv
import os
import re
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

from megatron_sat import compat
from megatron_sat.training.step import run_forward_backward

_LAYER = re.compile(r"(^|\.)layers\.\d+(\.|$)")


def _fold(name: str) -> str:
    return _LAYER.sub(r"\1layers.*\2", name) or "(model)"


@contextmanager
def torch_trace(out_dir: str, name: str, top: int = 40):
    """Profile the block with torch.profiler; write trace_<name>.json and ops_<name>.txt to out_dir."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        yield prof
    os.makedirs(out_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(out_dir, f"trace_{name}.json"))
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with open(os.path.join(out_dir, f"ops_{name}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=top))


def _matmul_flops(input, other, *, out=None):
    """DeepSpeed's matmul count (2 x MACs), right for 1-D operands too: [..., k] @ [k] is prod(input) MACs,
    [k] @ [..., k, n] is prod(other) MACs (DeepSpeed multiplies by other.shape[-1] = k in the first case)."""
    if other.dim() == 1:
        macs = input.numel()
    elif input.dim() == 1:
        macs = other.numel()
    else:
        macs = input.numel() * other.shape[-1]
    return 2 * macs, macs


def flops_profile(run, out_dir: str, tag: str, write: bool) -> dict:
    """DeepSpeed's forward FLOPs of `run` (a throughput.ArchRun); collective: every rank must call it."""
    # the profile extra (DeepSpeed), seconds to import: only for --flops-profile
    from deepspeed.profiling.flops_profiler import profiler as ds
    from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler, get_module_duration, get_module_flops

    spec = run.spec
    container = torch.nn.ModuleList(run.inner)  # never called: only its children run
    prof = FlopsProfiler(container)
    compat.forget_cached_torch_attributes()
    ds_matmul, ds._matmul_flops_compute = ds._matmul_flops_compute, _matmul_flops  # read when the patch is made
    try:
        prof.start_profile()
    finally:
        ds._matmul_flops_compute = ds_matmul
    try:
        with torch.no_grad():
            run_forward_backward(run.chunks, run.optimizer, run.config, iter(run.data),
                                 num_microbatches=run.num_micro, seq_length=spec["seq_length"],
                                 micro_batch_size=spec["micro_batch_size"], forward_only=True)
        rows = {}
        for chunk in run.inner:
            for name, module in chunk.named_modules():
                key = _fold(name)
                row = rows.setdefault(key, dict(module=key, type=type(module).__name__, count=0, params=0,
                                                forward_flops=0, forward_ms=0.0))
                row["count"] += 1
                row["params"] += sum(p.numel() for p in module.parameters())
                row["forward_flops"] += get_module_flops(module)
                row["forward_ms"] += get_module_duration(module) * 1e3
        local = float(sum(get_module_flops(c) for c in run.inner))
    finally:
        compat.forget_cached_torch_attributes()
        prof.end_profile()
    total = torch.tensor([local], dtype=torch.float64)
    torch.distributed.all_reduce(total)
    tokens = spec["global_batch_size"] * spec["seq_length"]
    measured = total.item() / tokens
    analytic = run.flops_per_token / 3
    top = rows.get("(model)", {})
    for row in rows.values():
        row["flops_share"] = row["forward_flops"] / top["forward_flops"] if top.get("forward_flops") else None
        row["time_share"] = row["forward_ms"] / top["forward_ms"] if top.get("forward_ms") else None
    modules = list(rows.values())
    path = None
    if write:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"modules_{tag}.csv")
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(modules[0]))
            w.writeheader()
            w.writerows(modules)
    return dict(forward_flops_per_token=measured, analytic_forward_flops_per_token=analytic,
                ratio_to_analytic=measured / analytic, modules_csv=path,
                modules=modules if write else None)
