"""Analytic FLOPs of one training token, per arch, and the peak FLOPs of a device (for MFU).

Counting rules (a matmul [m, k] x [k, n] is 2 m k n FLOPs; elementwise ops count 1 per element
only where they are part of the value-residual mechanism, since they are what differs by arch):

    per token and layer (h hidden, nh heads, ng KV heads, d head dim, f FFN, s sequence):
        QKV projection          2 h d (nh + 2 ng)
        attention scores + AV   4 s nh d          (full s x s, the PaLM / llm-foundry convention,
                                                   so MFU compares with the published anchors)
        output projection       2 nh d h
        MLP                     2 h f x 3 (SwiGLU: gate, up, down) or x 2 (plain)
    per mixing layer (layers 2..L, or the last k):
        SATFormer               2 h ng (x @ W_alpha) + ng (gate fn) + 2 ng d (alpha * V1, + V)
                                fused gate (W_alpha's rows in linear_qkv): + 2 h P (key "gate_padding"),
                                P the zero rows that pad each TP rank's QKV width to a multiple of 16
                                (megatron_sat.model.fused_gate; P depends on TP, given as `tp`)
        ResFormer               3 ng d (l1 * V1, l2 * V, +)
    connections of the baselines (key "connections"), per layer i = 1..L with k = i + 1 earlier outputs:
        DenseFormer             (2k - 1) h                       weighted sum of X_0..X_i
        MUDDFormer              C ways (4; 1 in layer L): 2 h Ck + Ck + 2 (Ck)^2 + Ck (W1, GELU, W2, + static)
                                + C (2k - 1) h + C h             (weighted sums, + X_i)
                                and the MLP term with its per-layer FFN widths (param_realloc)
        Hyper-Connections       n streams, per sublayer (2 per layer):
                                dynamic: 2 n h (n+1) + 2 n h (weights from the normed streams) + 3 n (n+2)
                                (tanh, scale, + static); 2 n (n+1) h (width mix) + 2 n h (beta y +);
                                layer L: (n - 1) h (the streams' sum)
    once per token              2 h V (logits)
    training = 3 x forward (backward = 2 x forward); recomputation is not counted (model FLOPs).
Norms, RoPE, softmax and the loss are left out, as in the usual MFU conventions.
"""

from typing import Optional

from megatron_sat import archs
from megatron_sat.archs import mixing_layers

# dense bf16 peak TFLOP/s per device (no sparsity), from the vendors' datasheets; matched as a substring of
# torch.cuda.get_device_name() in this order (a more specific name first: A100 before A10, L40S before L40, GB200
# before B200). A GPU not listed: --peak-tflops.
PEAK_TFLOPS = {
    "GB200": 2500.0, "B200": 2250.0, "B100": 1750.0,       # Blackwell (per GPU)
    "GH200": 989.0, "H200": 989.0, "H100": 989.0, "H800": 989.0, "H20": 148.0,  # Hopper (SXM)
    "A100": 312.0, "A800": 312.0, "A30": 165.0, "A40": 149.7, "A10": 125.0,     # Ampere
    "L40S": 362.0, "L40": 181.0, "L4": 121.0,               # Ada
    "MI325X": 1307.4, "MI300X": 1307.4, "MI250X": 383.0,    # AMD Instinct (ROCm builds of torch)
}


def flops_breakdown(cfg, seq_length: int, vocab_size: int, tp: Optional[int] = None) -> dict:
    """Forward FLOPs per token by term. cfg: anything with SATConfig's field names; tp: the TP size the
    fused gate's padding is counted for (default the config's tensor_model_parallel_size, else 1). The arch's
    own terms come from its module (megatron_sat/archs/: Arch.flops)."""
    h, L, nh = cfg.hidden_size, cfg.num_layers, cfg.num_attention_heads
    ng = getattr(cfg, "num_query_groups", None) or nh
    d = getattr(cfg, "kv_channels", None) or h // nh
    f = getattr(cfg, "ffn_hidden_size", None) or 4 * h
    mlp_mats = 3 if getattr(cfg, "gated_linear_unit", True) else 2
    m = len(mixing_layers(cfg))
    out = dict(
        qkv=L * 2 * h * d * (nh + 2 * ng),
        attention=L * 4 * seq_length * nh * d,
        out_proj=L * 2 * nh * d * h,
        mlp=L * 2 * h * f * mlp_mats,
        logits=2 * h * vocab_size,
        gate=0,
        gate_padding=0,
        mixing=0,
    )
    out["connections"] = 0
    dims = dict(h=h, L=L, nh=nh, ng=ng, d=d, mlp_mats=mlp_mats, m=m)
    archs.get(cfg.arch).flops(cfg, out, dims, tp or getattr(cfg, "tensor_model_parallel_size", 1))
    return out


def flops_per_token(cfg, seq_length: int, vocab_size: int, training: bool = True, tp: Optional[int] = None) -> int:
    """Model FLOPs per token: forward, or forward + backward (3x) when training."""
    forward = sum(flops_breakdown(cfg, seq_length, vocab_size, tp).values())
    return 3 * forward if training else forward


def peak_flops_per_device(override_tflops: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of this process's device: the override, the table entry for the GPU, else None (CPU)."""
    if override_tflops:
        return override_tflops * 1e12
    import torch  # here: importing this module (the planner, the Slurm tools) loads no torch
    if not torch.cuda.is_available():
        return None
    tflops = peak_tflops_of(torch.cuda.get_device_name())
    return None if tflops is None else tflops * 1e12


def peak_tflops_of(device_name: str) -> Optional[float]:
    """The table's dense bf16 peak of a device name (torch.cuda.get_device_name()), else None."""
    return next((tflops for key, tflops in PEAK_TFLOPS.items() if key in device_name), None)
