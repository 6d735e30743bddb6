"""Forward+backward step time and memory of several archs, interleaved in one process.

Each arch's model is built once; then rounds run one timed step per arch, in an order that
alternates every round (A B C, C B A, ...), so machine drift and warm caches fall on every arch
alike. Memory per arch:
  * activations: bytes of the tensors autograd saves for backward in one step (unique storages,
    counted through saved-tensor hooks): exact and device-independent, the part that a value
    residual could grow;
  * on a GPU also the peak allocated during the step (torch.cuda.max_memory_allocated).
Written here because no library times several models against each other in one process.
The full training step (optimizer, any layout, per-arch processes, MFU, reports) is measured by
megatron_sat/profiling/throughput.py (tools/profile_throughput.py), which reuses SavedBytes, sync
and alternating_order from here.
"""

import statistics
import time
from dataclasses import dataclass, field

import torch

from megatron_sat import compat
from megatron_sat.archs import REFERENCE, SUBJECT, arch_label
from megatron_sat.model.config import make_config
from megatron_sat.model.flops import flops_per_token, peak_flops_per_device
from megatron_sat.model.gpt import build_model
from megatron_sat.parallel.layout import Layout


@dataclass
class ArchResult:
    arch: str
    params: int
    step_s: list = field(default_factory=list)
    activation_bytes: int = 0
    peak_bytes: int = 0
    tokens_per_step: int = 0
    flops_per_token: int = 0  # analytic, forward + backward (megatron_sat.model.flops)


class SavedBytes:
    """Counts the unique storages autograd saves while active (also used by profiling.throughput).

    Exact within one forward pass (nothing saved is freed before the backward); storages freed and
    reused later would be missed, so count one forward at a time.
    """

    def __init__(self):
        self.seen, self.bytes = set(), 0

    def pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.seen:
            self.seen.add(key)
            self.bytes += storage.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def sync():
    """Wait for the device (a no-op on CPU), so that wall-clock times cover the work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def alternating_order(items, round_index: int) -> list:
    """items in order on even rounds and reversed on odd ones (A B C, C B A, ...): drift and warm
    caches fall on every item alike."""
    return list(items) if round_index % 2 == 0 else list(reversed(items))


def run(archs, sizes: dict, *, seq_length: int, micro_batch_size: int, vocab_size: int, rounds: int,
        warmup: int, bf16: bool = False, backend=None, layout: Layout = Layout(), seed: int = 1234,
        fp8: str = None, log=print) -> dict:
    """Benchmark single-rank (TP=PP=1) fwd+bwd steps; parallel_state must be initialised.
    archs: labels, an arch or 'arch:variant' (megatron_sat.archs.arch_label), e.g. satformer:dot_product."""
    device = compat.device()
    dtype = torch.bfloat16 if bf16 else torch.float32
    models, results = {}, {}
    for label in archs:
        arch, overrides = arch_label(label)
        torch.manual_seed(seed)
        fp8_fields = dict(fp8=fp8) if fp8 else {}  # FP8 GEMMs (Transformer Engine backend)
        config = make_config(arch, **sizes, **overrides, **fp8_fields, params_dtype=dtype, bf16=bf16,
                             **layout.config_fields(dtype))
        models[label] = build_model(config, vocab_size=vocab_size, max_sequence_length=seq_length, backend=backend)[0]
        results[label] = ArchResult(label, sum(p.numel() for p in models[label].parameters()),
                                    tokens_per_step=micro_batch_size * seq_length,
                                    flops_per_token=flops_per_token(config, seq_length, vocab_size))
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length), generator=g).to(device)
    position_ids = torch.arange(seq_length, device=device).unsqueeze(0).expand(micro_batch_size, -1)

    def step(arch, measure=False):
        model = models[arch]
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        counter = SavedBytes() if measure else None
        sync()
        start = time.perf_counter()
        if counter:
            with counter:
                loss = model(tokens, position_ids, None, labels=tokens).float().mean()
        else:
            loss = model(tokens, position_ids, None, labels=tokens).float().mean()
        loss.backward()
        sync()
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        if counter:
            results[arch].activation_bytes = counter.bytes
        if torch.cuda.is_available():
            results[arch].peak_bytes = max(results[arch].peak_bytes, torch.cuda.max_memory_allocated())
        return elapsed

    for arch in archs:  # warm-up, and one pass counting saved activations (not timed)
        step(arch, measure=True)
        for _ in range(warmup):
            step(arch)
    for r in range(rounds):
        for arch in alternating_order(archs, r):
            results[arch].step_s.append(step(arch))
        log(f"round {r + 1}/{rounds}: " + "  ".join(f"{a} {results[a].step_s[-1] * 1e3:.1f} ms" for a in archs))
    return results


def summarize(results: dict, baseline: str = REFERENCE) -> list:
    """Rows with median/min step time, memory and ratios to the baseline arch (and SATFormer's speed-up and
    memory saving against each arch when SATFormer is benchmarked)."""
    base = results.get(baseline)
    peak_flops = peak_flops_per_device()  # None on CPU and unknown GPUs: no MFU
    rows = []
    for arch, r in results.items():
        med = statistics.median(r.step_s)
        tokens_per_s = r.tokens_per_step / med
        row = dict(arch=arch, params=r.params, step_ms_median=med * 1e3, step_ms_min=min(r.step_s) * 1e3,
                   step_ms_max=max(r.step_s) * 1e3, activation_mib=r.activation_bytes / 2**20,
                   peak_mib=r.peak_bytes / 2**20 if r.peak_bytes else None, tokens_per_s=tokens_per_s,
                   mfu=tokens_per_s * r.flops_per_token / peak_flops if peak_flops else None)
        if base is not None:
            row["time_ratio"] = med / statistics.median(base.step_s)
            row["activation_ratio"] = r.activation_bytes / base.activation_bytes
            row["peak_ratio"] = r.peak_bytes / base.peak_bytes if base.peak_bytes else None
        sat = results.get(SUBJECT)
        if sat is not None:  # the paper's claims are SATFormer vs a baseline: its speed-up and memory saving
            row["satformer_speedup"] = med / statistics.median(sat.step_s)
            row["satformer_activation_saving"] = 1 - sat.activation_bytes / r.activation_bytes
            row["satformer_peak_saving"] = 1 - sat.peak_bytes / r.peak_bytes if r.peak_bytes else None
        rows.append(row)
    return rows
