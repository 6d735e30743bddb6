"""Hugging Face configurations of SATFormer and ResFormer (remote code shipped with every export).

Written by megatron_sat.conversion; the class names, `model_type`s and fields are those of the
SATFormer authors' classes (SATFormerConfig / ResFormerConfig), so a folder exported here loads in
their ecosystem and theirs loads here. Pure Python: no fla, no flash-attn.
"""

from transformers import PretrainedConfig

GATES = ("relu", "sigmoid", "softmax", "softmax_sigmoid", "tanh", "identity")


class _ValueResidualConfig(PretrainedConfig):
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        hidden_size: int = 2048,
        num_hidden_layers: int = 24,
        num_heads: int = 32,
        num_kv_heads=None,
        qkv_bias: bool = False,
        qk_norm: bool = True,
        window_size=None,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 2048,
        hidden_ratio=4,
        intermediate_size=None,
        hidden_act: str = "swish",
        initializer_range: float = 0.02,
        elementwise_affine: bool = True,
        norm_eps: float = 1e-6,
        qk_norm_eps: float = 1e-5,
        use_cache: bool = True,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings: bool = True,
        fuse_norm: bool = False,
        fuse_swiglu: bool = False,
        fuse_cross_entropy: bool = False,
        fuse_linear_cross_entropy: bool = False,
        use_l2warp: bool = False,
        vocab_size: int = 32000,
        use_value_residual: bool = True,
        value_residual_last_k=None,
        **kwargs,
    ):
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.qkv_bias = qkv_bias
        self.qk_norm = qk_norm
        self.window_size = window_size
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.elementwise_affine = elementwise_affine
        self.norm_eps = norm_eps
        self.qk_norm_eps = qk_norm_eps  # q/k RMSNorms: the authors' attention uses fla's default 1e-5, not norm_eps
        self.use_cache = use_cache
        self.fuse_norm = fuse_norm
        self.fuse_swiglu = fuse_swiglu
        self.fuse_cross_entropy = fuse_cross_entropy
        self.fuse_linear_cross_entropy = fuse_linear_cross_entropy
        self.use_l2warp = use_l2warp
        self.vocab_size = vocab_size
        self.use_value_residual = use_value_residual
        self.value_residual_last_k = value_residual_last_k
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.tie_word_embeddings = tie_word_embeddings  # some transformers versions drop it from kwargs


class SATFormerConfig(_ValueResidualConfig):
    """V'[n] = V[n] + gate(x W_alpha[n]) * V1, one gate value per token and KV head."""

    model_type = "SATFormer"

    def __init__(self, value_residual_gate: str = "relu", value_residual_proj_bias: bool = False, **kwargs):
        if value_residual_gate not in GATES:
            raise ValueError(f"value_residual_gate must be one of {sorted(GATES)}, got {value_residual_gate!r}")
        self.value_residual_gate = value_residual_gate
        self.value_residual_proj_bias = value_residual_proj_bias
        super().__init__(**kwargs)


class ResFormerConfig(_ValueResidualConfig):
    """V'[n] = lambda1[n] V1 + lambda2[n] V[n], lambda1 = scale * softmax(logits) over layers 2..N."""

    model_type = "ResFormer"

    def __init__(self, value_residual_lambda2_init: float = 0.5, **kwargs):
        self.value_residual_lambda2_init = value_residual_lambda2_init
        super().__init__(**kwargs)
