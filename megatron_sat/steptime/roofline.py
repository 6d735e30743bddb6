"""Operators and their time on a roofline with an achievable-efficiency curve per operator class and size.

Three operator classes, each with a forward and a backward:

    gemm       [m, k] x [k, n]: 2mnk FLOPs; bytes: both inputs and the output. Backward: the data gradient
               [m, n] x [n, k] and the weight gradient [k, m] x [m, n] (2 x the forward FLOPs).
               efficiency = gemm_efficiency x waves(m, n) x k / (k + K_FILL)
                 waves: the fraction of the last wave of 128 x 128 output tiles the SMs fill (tiles / (waves x
                 SMs)): a GEMM of few tiles leaves SMs idle; K_FILL: the main loop's prologue and epilogue, which a
                 short reduction dimension does not amortise
    attention  flash attention over [b, heads, s_q, s_k, d]: the FLOPs it executes (QK^T and PV, 4 b heads s_q s_k
               d, halved by the causal mask), at attention_efficiency x d / (d + D_HALF) x s_k / (s_k + S_HALF)
               (each factor normalised to 1 at d = 128, s_k = 4096); backward executes 2.5 x the forward
               (recomputes the scores: five matmuls against two)
    memory     elementwise and reduction work (norms, activations, RoPE, residual adds, the cross entropy, the
               baselines' stream mixing, the optimizer): bytes read and written / (HBM x memory_efficiency);
               backward moves `bwd_bytes` (default twice the forward's: the gradient in and out plus what it reads)

Every kernel costs kernel_overhead_us on top; time = max(compute, memory) + overhead (the roofline). The
calibration constants come from the Hardware (hardware.py, gpus.json).
"""

import math
from dataclasses import dataclass
from typing import Optional

from megatron_sat.steptime.hardware import Hardware

TILE = 128  # output tile edge of the GEMM kernels' wave model
K_FILL = 64  # reduction length at which a GEMM's main loop reaches half its efficiency
D_HALF, S_HALF = 32, 256  # flash attention: head dim and key length at half efficiency (before normalising)
ATTN_BWD_FACTOR = 2.5  # flash attention backward executes 5 matmuls against the forward's 2
BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}


@dataclass(frozen=True)
class Op:
    """One operator of a layer's forward pass, per micro-batch on one rank, and how to cost its backward.

    kind: 'gemm' (m, n, k), 'attention' (flops executed, head_dim, keys), 'memory' (bytes, bwd_bytes).
    group: the breakdown's name for it ('gemm', 'attention', 'elementwise', or an arch's own name).
    count: how many identical kernels (their overheads add)."""

    name: str
    kind: str
    group: str = "elementwise"
    m: int = 0
    n: int = 0
    k: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    bwd_bytes: Optional[float] = None
    head_dim: int = 128
    keys: int = 4096
    count: int = 1
    backward: bool = True  # False: no backward work (e.g. a mask or an index)


def gemm(name: str, m: int, n: int, k: int, group: str = "gemm") -> Op:
    """[m, k] x [k, n]."""
    return Op(name, "gemm", group, m=m, n=n, k=k, flops=2.0 * m * n * k)


def memory(name: str, nbytes: float, group: str = "elementwise", bwd_bytes: Optional[float] = None,
           count: int = 1) -> Op:
    """A memory-bound kernel moving `nbytes` (read + written) forward."""
    return Op(name, "memory", group, bytes=float(nbytes), bwd_bytes=bwd_bytes, count=count)


def attention(name: str, b: int, heads: int, s_q: int, s_k: int, d: int, causal: bool = True) -> Op:
    """Flash attention of b x heads queries s_q over keys s_k with head dim d (executed FLOPs)."""
    flops = 4.0 * b * heads * s_q * s_k * d * (0.5 if causal else 1.0)
    return Op(name, "attention", "attention", flops=flops, head_dim=d, keys=s_k)


def waves(m: int, n: int, sms: int) -> float:
    """Fraction of the SMs' tile slots a GEMM with an [m, n] output fills over its waves."""
    tiles = math.ceil(m / TILE) * math.ceil(n / TILE)
    return tiles / (math.ceil(tiles / sms) * sms)


def gemm_efficiency(hw: Hardware, m: int, n: int, k: int) -> float:
    """Fraction of the dense peak an [m, k] x [k, n] GEMM reaches (module docstring)."""
    return hw.cal("gemm_efficiency") * waves(m, n, hw.sm_count) * k / (k + K_FILL)


def gemm_time(hw: Hardware, m: int, n: int, k: int, precision: str = "bf16") -> float:
    """Seconds of one [m, k] x [k, n] GEMM: max(FLOPs / (peak x efficiency), bytes / (HBM x efficiency)) + overhead.
    FP8 reads its inputs in one byte and writes bf16."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k
    size = BYTES[precision]
    nbytes = (m * k + k * n) * size + m * n * max(size, 2)
    compute = flops / (hw.peak(precision) * gemm_efficiency(hw, m, n, k))
    mem = nbytes / (hw.hbm_gbps * 1e9 * hw.cal("memory_efficiency"))
    return max(compute, mem) + hw.cal("kernel_overhead_us") * 1e-6


def memory_time(hw: Hardware, nbytes: float, count: int = 1) -> float:
    """Seconds of memory-bound kernels moving `nbytes` in all."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (hw.hbm_gbps * 1e9 * hw.cal("memory_efficiency")) + count * hw.cal("kernel_overhead_us") * 1e-6


def attention_efficiency(hw: Hardware, head_dim: int, keys: int) -> float:
    """Fraction of the bf16 peak flash attention reaches on the FLOPs it executes."""
    d = head_dim / (head_dim + D_HALF) / (128 / (128 + D_HALF))
    s = keys / (keys + S_HALF) / (4096 / (4096 + S_HALF))
    return hw.cal("attention_efficiency") * min(d, 1.0) * min(s, 1.0)


def op_time(hw: Hardware, op: Op, precision: str = "bf16", backward: bool = False) -> float:
    """Seconds of an operator's forward (or backward) on `hw`; GEMMs in `precision` (fp8: the others stay bf16)."""
    if backward and not op.backward:
        return 0.0
    overhead = hw.cal("kernel_overhead_us") * 1e-6
    if op.kind == "gemm":
        if not backward:
            return op.count * gemm_time(hw, op.m, op.n, op.k, precision)
        return op.count * (gemm_time(hw, op.m, op.k, op.n, precision) + gemm_time(hw, op.k, op.n, op.m, precision))
    if op.kind == "attention":
        flops = op.flops * (ATTN_BWD_FACTOR if backward else 1.0)
        peak = hw.peak("bf16" if precision in ("fp8", "bf16") else precision)
        return op.count * (flops / (peak * attention_efficiency(hw, op.head_dim, op.keys)) + overhead)
    if op.kind == "memory":
        nbytes = (op.bwd_bytes if op.bwd_bytes is not None else 2 * op.bytes) if backward else op.bytes
        return memory_time(hw, nbytes, op.count)
    raise ValueError(f"unknown operator kind {op.kind!r}")
