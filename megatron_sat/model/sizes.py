"""The paper's model sizes and an exact parameter count for any config.

PAPER_SCALES are the SATFormer authors' grid (their configs; docs/recipes_slurm.md) with their defects
fixed: xl uses 32 heads (their SATFormer xl file says 24, and 2048 / 24 is not a whole head size),
and every arch is multi-head (their Transformer medium alone used 4 KV heads), so that archs at one
scale differ only in the value residual.
"""

from typing import Optional

from megatron_sat.archs import ffn_size

PAPER_VOCAB = 32000  # Llama-2 tokenizer
PAPER_SEQ_LENGTH = 4096

PAPER_SCALES = {
    "130M": dict(num_layers=11, hidden_size=768, num_attention_heads=12, num_query_groups=12, ffn_hidden_size=3072),
    "340M": dict(num_layers=18, hidden_size=1024, num_attention_heads=16, num_query_groups=16, ffn_hidden_size=4096),
    "760M": dict(num_layers=19, hidden_size=1536, num_attention_heads=24, num_query_groups=24, ffn_hidden_size=6144),
    "1.3B": dict(num_layers=24, hidden_size=2048, num_attention_heads=32, num_query_groups=32, ffn_hidden_size=5632),
}


def count_parameters(config, vocab_size: int, tied_embeddings: bool = True, tp: Optional[int] = None) -> dict:
    """Parameters by part for a megatron_sat model (matches sum(p.numel()) of the built model).

    "gate_padding": the zero rows of SATFormer's fused gate (megatron_sat.model.fused_gate), which pad
    each TP rank's QKV weight to a multiple of 16 rows; they depend on the TP size `tp` (default the
    config's tensor_model_parallel_size) and are counted in "total" (they take memory)."""
    from megatron_sat.model.fused_gate import padding_rows  # here: `import recipes` reads PAPER_SCALES, no torch
    h, L = config.hidden_size, config.num_layers
    hn, nq, ng = config.kv_channels, config.num_attention_heads, config.num_query_groups
    attention = h * (nq + 2 * ng) * hn + nq * hn * h  # linear_qkv + linear_proj
    mlp_factor = 3 if config.gated_linear_unit else 2
    mlp = h * config.ffn_hidden_size * mlp_factor
    norms = 2 * h + (2 * hn if config.qk_layernorm else 0)  # input, pre-MLP, q and k norms
    mixing = len(config.mixing_layers)
    if config.arch == "satformer":
        value_residual = mixing * ng * h  # W_alpha per mixing layer
    elif config.arch == "resformer" and config.resformer_lambdas == "learned":
        value_residual = mixing + (L - 1) + 1  # lambda2 per mixing layer; logits for layers 2..L; scale
    else:
        value_residual = 0
    connections, mlp_total, norms_total = 0, L * mlp, L * norms + h
    if config.arch == "denseformer":
        connections = sum(i + 1 for i in range(1, L + 1))  # DWA weights over X_0..X_i after layer i
    elif config.arch == "muddformer":
        mlp_total = sum(h * ffn_size(config, i) * mlp_factor for i in range(1, L + 1))
        norms_total += L * 2 * h  # key and value input norms
        for i in range(1, L + 1):  # depth aggregate: w1, w2, static weights, pre-norms, post-norms
            C, k = (4 if i < L else 1), i + 1
            connections += C * k * h + (C * k) ** 2 + C * k + k * h + C * h
    elif config.arch == "hyperconnections":
        n = config.hc_expansion_rate
        hc = n * (n + 1) + n  # static alpha, beta
        if config.hc_dynamic:
            hc += h + h * (n + 1) + h + 2  # norm, dynamic alpha, beta, their two scales
        connections = L * 2 * hc  # before attention and before the MLP
    parts = dict(
        embedding=vocab_size * h * (1 if tied_embeddings else 2),
        attention=L * attention,
        mlp=mlp_total,
        norms=norms_total,
        value_residual=value_residual,
        gate_padding=mixing * h * padding_rows(config, tp or getattr(config, "tensor_model_parallel_size", 1))
        if config.arch == "satformer" else 0,
        connections=connections,
    )
    parts["total"] = sum(parts.values())
    return parts
