"""Model configuration: Megatron's TransformerConfig plus the value-residual fields.

`SATConfig` is a TransformerConfig (so every Megatron module accepts it) with four extra fields
that select the architecture. `make_config` fills in the paper's Llama-style defaults
(../shared/reference/satformer.md): RMSNorm eps 1e-6, QK-norm, SwiGLU, no biases, init std 0.02.

Which layers mix V1 (1-based global layer numbers, L layers):
    layer 1            produces V1 (its raw value projection), never mixes
    layers 2..L        mix V1, or only the last k of them with value_residual_last_k=k
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

ARCHS = ("transformer", "resformer", "satformer")
VALUE_RESIDUAL_ARCHS = ("resformer", "satformer")
GATES = ("relu", "sigmoid", "tanh", "identity", "softmax", "softmax_sigmoid")
RESFORMER_LAMBDAS = ("learned", "fixed")


@dataclass
class SATConfig(TransformerConfig):
    """TransformerConfig with the SATFormer / ResFormer switches."""

    arch: str = "satformer"
    """One of ARCHS. 'transformer' is plain Megatron; the other two carry V1 through the model."""

    value_residual_gate: str = "relu"
    """SATFormer gate function applied to x @ W_alpha (one of GATES); relu is the paper's."""

    value_residual_last_k: Optional[int] = None
    """Mix V1 only into the last k layers (1 <= k <= num_layers - 1); None mixes into layers 2..L."""

    resformer_lambdas: str = "learned"
    """ResFormer: 'fixed' is V' = 0.5 V1 + 0.5 V; 'learned' is the SATFormer authors' baseline:
    per-layer lambda2 (init 0.5) and lambda1 = s * softmax(logits) over the mixing layers
    (s init to their count, logits init 0), a vector shared by every pipeline stage."""

    value_residual_gate_init_std: float = 0.02
    """Std of the normal init of W_alpha."""

    def __post_init__(self):
        super().__post_init__()
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; choose one of {', '.join(ARCHS)}")
        if self.value_residual_gate not in GATES:
            raise ValueError(
                f"unknown value_residual_gate {self.value_residual_gate!r}; "
                f"choose one of {', '.join(GATES)}"
            )
        if self.resformer_lambdas not in RESFORMER_LAMBDAS:
            raise ValueError(
                f"unknown resformer_lambdas {self.resformer_lambdas!r}; "
                f"choose one of {', '.join(RESFORMER_LAMBDAS)}"
            )
        if not self.uses_value_residual:
            return
        if self.num_layers < 2:
            raise ValueError(
                f"arch {self.arch!r} mixes layer 1's values into later layers and needs "
                f"num_layers >= 2 (got {self.num_layers})"
            )
        k = self.value_residual_last_k
        if k is not None and not 1 <= k <= self.num_layers - 1:
            raise ValueError(
                f"value_residual_last_k must be in [1, num_layers - 1] = [1, {self.num_layers - 1}] "
                f"(layer 1 produces V1 and cannot mix it); got {k}"
            )
        if self.fused_single_qkv_rope:
            raise ValueError("fused_single_qkv_rope hides V from the value residual; turn it off")
        if self.attention_output_gate:
            raise ValueError("attention_output_gate is not supported with a value-residual arch")

    @property
    def uses_value_residual(self) -> bool:
        return self.arch in VALUE_RESIDUAL_ARCHS

    @property
    def mixing_layers(self) -> list:
        """Global 1-based numbers of the layers that mix V1 into their values."""
        if not self.uses_value_residual:
            return []
        first = 2 if self.value_residual_last_k is None else self.num_layers - self.value_residual_last_k + 1
        return list(range(first, self.num_layers + 1))

    @property
    def v1_channels(self) -> int:
        """Width of V1 over all KV heads: num_query_groups * kv_channels."""
        return self.num_query_groups * self.kv_channels


def gate_function(name: str):
    """alpha = f(logits) with logits [..., N_kv]; the softmax variants normalise over KV heads."""
    if name == "relu":
        return F.relu
    if name == "sigmoid":
        return torch.sigmoid
    if name == "tanh":
        return torch.tanh
    if name == "identity":
        return lambda x: x
    if name == "softmax":  # scaled so that a uniform gate is 1 per head, as the authors do
        return lambda x: torch.softmax(x, dim=-1) * x.shape[-1]
    if name == "softmax_sigmoid":  # the authors' definition, also scaled by N_kv
        return lambda x: torch.softmax(x, dim=-1) * torch.sigmoid(x) * x.shape[-1]
    raise ValueError(f"unknown gate {name!r}")


def make_config(
    arch: str = "satformer",
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_query_groups: Optional[int] = None,
    ffn_hidden_size: Optional[int] = None,
    **overrides,
) -> SATConfig:
    """The paper's Llama-style block with the given sizes; any TransformerConfig field can be overridden."""
    fields = dict(
        arch=arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups or num_attention_heads,
        ffn_hidden_size=ffn_hidden_size or 4 * hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
    )
    fields.update(overrides)
    return SATConfig(**fields)
