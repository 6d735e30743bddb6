"""Configurations of the DenseFormer, MUDDFormer and Hyper-Connections exports (shipped as remote code).

The SATFormer authors' class names, model types and fields (models/{denseformer,muddformer,
hyperconnections}/configuration_*.py), plus `qk_norm_eps`: the eps of the per-head q/k RMSNorms, which
their attention leaves at flash-linear-attention's default 1e-5 (their configs have no field for it).
The fuse_* switches are kept for compatibility and ignored: the shipped code is pure PyTorch.
"""

from transformers import PretrainedConfig


class _BaselineConfig(PretrainedConfig):
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(self, hidden_size: int = 2048, num_hidden_layers: int = 24, num_heads: int = 32, num_kv_heads=None,
                 qkv_bias: bool = False, qk_norm: bool = False, window_size=None, rope_theta: float = 10000.0,
                 max_position_embeddings: int = 2048, hidden_ratio=4, intermediate_size=None,
                 hidden_act: str = "swish", initializer_range: float = 0.02, elementwise_affine: bool = True,
                 norm_eps: float = 1e-6, qk_norm_eps: float = 1e-5, use_cache: bool = True, pad_token_id=None,
                 bos_token_id=1, eos_token_id=2, tie_word_embeddings: bool = False, fuse_norm: bool = True,
                 fuse_swiglu: bool = True, fuse_cross_entropy: bool = True, fuse_linear_cross_entropy: bool = False,
                 use_l2warp: bool = False, vocab_size: int = 32000, **kwargs):
        self.hidden_size, self.num_hidden_layers = hidden_size, num_hidden_layers
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.qkv_bias, self.qk_norm, self.window_size = qkv_bias, qk_norm, window_size
        self.rope_theta, self.max_position_embeddings = rope_theta, max_position_embeddings
        self.hidden_ratio, self.intermediate_size, self.hidden_act = hidden_ratio, intermediate_size, hidden_act
        self.initializer_range, self.elementwise_affine = initializer_range, elementwise_affine
        self.norm_eps, self.qk_norm_eps, self.use_cache = norm_eps, qk_norm_eps, use_cache
        self.fuse_norm, self.fuse_swiglu, self.fuse_cross_entropy = fuse_norm, fuse_swiglu, fuse_cross_entropy
        self.fuse_linear_cross_entropy, self.use_l2warp = fuse_linear_cross_entropy, use_l2warp
        self.vocab_size = vocab_size
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.tie_word_embeddings = tie_word_embeddings  # some transformers versions drop it from kwargs


class HyperConnectionsConfig(_BaselineConfig):
    """n residual streams (expansion_rate) with static and (use_dynamic_hc) tanh dynamic connection weights."""

    model_type = "dhc"

    def __init__(self, expansion_rate: int = 4, use_dynamic_hc: bool = True, use_tanh: bool = True,
                 hc_norm_type: str = "rms", **kwargs):
        if expansion_rate < 1:
            raise ValueError(f"expansion_rate must be at least 1, got {expansion_rate}")
        self.expansion_rate, self.use_dynamic_hc = expansion_rate, use_dynamic_hc
        self.use_tanh, self.hc_norm_type = use_tanh, hc_norm_type
        super().__init__(**kwargs)


class DenseFormerConfig(_BaselineConfig):
    """A depth-weighted average of all earlier outputs after every block (dilation and period 1)."""

    model_type = "denseformer"

    def __init__(self, dwa_dilation: int = 1, dwa_period: int = 1, **kwargs):
        self.dwa_dilation, self.dwa_period = dwa_dilation, dwa_period
        super().__init__(**kwargs)


class MUDDFormerConfig(_BaselineConfig):
    """Multiway dynamic dense connections (Q, K, V, R), per-layer FFN widths (param_realloc)."""

    model_type = "muddformer"

    def __init__(self, num_ways: int = 4, param_realloc: bool = True, use_pre_post_da_norm: bool = True, **kwargs):
        self.num_ways, self.param_realloc, self.use_pre_post_da_norm = num_ways, param_realloc, use_pre_post_da_norm
        super().__init__(**kwargs)
