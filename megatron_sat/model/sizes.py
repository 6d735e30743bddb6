"""The paper's model sizes and an exact parameter count for any config.

PAPER_SCALES are the SATFormer authors' grid (their configs; docs/recipes_slurm.md) with their defects
fixed: xl uses 32 heads (their SATFormer xl file says 24, and 2048 / 24 is not a whole head size),
and every arch is multi-head (their Transformer medium alone used 4 KV heads), so that archs at one
scale differ only in the value residual.
"""

from typing import Optional

from megatron_sat.model.args import model_parameters

PAPER_VOCAB = 32000  # Llama-2 tokenizer
PAPER_SEQ_LENGTH = 4096

PAPER_SCALES = {
    "130M": dict(num_layers=11, hidden_size=768, num_attention_heads=12, num_query_groups=12, ffn_hidden_size=3072),
    "340M": dict(num_layers=18, hidden_size=1024, num_attention_heads=16, num_query_groups=16, ffn_hidden_size=4096),
    "760M": dict(num_layers=19, hidden_size=1536, num_attention_heads=24, num_query_groups=24, ffn_hidden_size=6144),
    "1.3B": dict(num_layers=24, hidden_size=2048, num_attention_heads=32, num_query_groups=32, ffn_hidden_size=5632),
}


def count_parameters(config, vocab_size: int, tied_embeddings: bool = True, tp: Optional[int] = None) -> dict:
    """Parameters by part for a megatron_sat model (matches sum(p.numel()) of the built model): model/args.py's
    model_parameters, the one place the per-arch formulas are written.

    "gate_padding": the zero rows of SATFormer's fused gate (megatron_sat.model.fused_gate), which pad
    each TP rank's QKV weight to a multiple of 16 rows; they depend on the TP size `tp` (default the
    config's tensor_model_parallel_size) and are counted in "total" (they take memory)."""
    return model_parameters(config, vocab_size, tied_embeddings, tp or getattr(config, "tensor_model_parallel_size", 1))
