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
        ResFormer               3 ng d (l1 * V1, l2 * V, +)
    once per token              2 h V (logits)
    training = 3 x forward (backward = 2 x forward); recomputation is not counted (model FLOPs).
Norms, RoPE, softmax and the loss are left out, as in the usual MFU conventions.
"""

from typing import Optional

# dense bf16 peak per device (no sparsity)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def _mixing_layers(cfg) -> int:
    if getattr(cfg, "arch", "transformer") not in ("resformer", "satformer"):
        return 0
    k = getattr(cfg, "value_residual_last_k", None)
    return cfg.num_layers - 1 if k is None else k


def flops_breakdown(cfg, seq_length: int, vocab_size: int) -> dict:
    """Forward FLOPs per token by term. cfg: anything with SATConfig's field names."""
    h, L, nh = cfg.hidden_size, cfg.num_layers, cfg.num_attention_heads
    ng = getattr(cfg, "num_query_groups", None) or nh
    d = getattr(cfg, "kv_channels", None) or h // nh
    f = getattr(cfg, "ffn_hidden_size", None) or 4 * h
    mlp_mats = 3 if getattr(cfg, "gated_linear_unit", True) else 2
    m = _mixing_layers(cfg)
    out = dict(
        qkv=L * 2 * h * d * (nh + 2 * ng),
        attention=L * 4 * seq_length * nh * d,
        out_proj=L * 2 * nh * d * h,
        mlp=L * 2 * h * f * mlp_mats,
        logits=2 * h * vocab_size,
        gate=0,
        mixing=0,
    )
    if cfg.arch == "satformer":
        out["gate"] = m * (2 * h * ng + ng)
        out["mixing"] = m * 2 * ng * d
    elif cfg.arch == "resformer":
        out["mixing"] = m * 3 * ng * d
    return out


def flops_per_token(cfg, seq_length: int, vocab_size: int, training: bool = True) -> int:
    """Model FLOPs per token: forward, or forward + backward (3x) when training."""
    forward = sum(flops_breakdown(cfg, seq_length, vocab_size).values())
    return 3 * forward if training else forward


def peak_flops_per_device(override_tflops: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of this process's device: the override, the table entry for the GPU, else None (CPU)."""
    if override_tflops:
        return override_tflops * 1e12
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, tflops in PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None
