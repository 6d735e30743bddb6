"""Model configuration: Megatron's TransformerConfig plus the fields that select the architecture.

`SATConfig` is a TransformerConfig (so every Megatron module accepts it) with extra fields for
SATFormer and its baselines (the paper, arXiv 2605.03953, and the authors' code; docs/architectures.md):
    transformer        Megatron's Llama-style GPT, untouched
    resformer          V' = lambda1 V1 + lambda2 V                 (megatron_sat.model.attention)
    satformer          V' = V + ReLU(x W_alpha) V1                 (megatron_sat.model.attention)
    denseformer        depth-weighted average after every block    (megatron_sat.model.denseformer)
    muddformer         dynamic dense connections, 4 ways (Q,K,V,R)  (megatron_sat.model.muddformer)
    hyperconnections   n residual streams, dynamic tanh weights     (megatron_sat.model.hyperconnections)
 `make_config` fills in the paper's Llama-style defaults
(docs/architectures.md): RMSNorm eps 1e-6 (q/k norms 1e-5), QK-norm, SwiGLU, no biases, init std 0.02.

Which layers mix V1 (1-based global layer numbers, L layers):
    layer 1            produces V1 (its raw value projection), never mixes
    layers 2..L        mix V1, or only the last k of them with value_residual_last_k=k
"""

from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import init_method_normal

from megatron_sat import archs
from megatron_sat.archs import GATES, LOCAL_ATTENTION, OUTPUT_LAYER_INITS, arch_errors
from megatron_sat.model.args import NAMES, ModelArgs, rope_scaling_errors


@dataclass
class SATConfig(TransformerConfig, ModelArgs):
    """TransformerConfig with the SATFormer / ResFormer switches: ModelArgs' fields (model/args.py, where each
    is described) that TransformerConfig does not have, with ModelArgs' defaults. TransformerConfig's own fields
    keep its defaults; make_config fills in the paper's (ModelArgs' fixed fields)."""

    def __post_init__(self):
        if self.output_layer_init not in OUTPUT_LAYER_INITS:
            raise ValueError(f"unknown output_layer_init {self.output_layer_init!r}; choose one of "
                             f"{', '.join(OUTPUT_LAYER_INITS)}")
        if self.output_layer_init == "unscaled" and self.output_layer_init_method is None:
            self.output_layer_init_method = init_method_normal(self.init_method_std)
        super().__post_init__()
        if self.local_attention not in LOCAL_ATTENTION:
            raise ValueError(f"unknown local_attention {self.local_attention!r}; choose one of "
                             f"{', '.join(LOCAL_ATTENTION)}")
        if not self.qk_norm_eps > 0:
            raise ValueError(f"qk_norm_eps must be > 0 (got {self.qk_norm_eps}); the authors' q/k norms use 1e-5")
        if rope_scaling_errors(self):
            raise ValueError("; ".join(rope_scaling_errors(self)))
        errors = arch_errors(self.arch, fp8=self.fp8, recompute_granularity=self.recompute_granularity,
                             hc_expansion_rate=self.hc_expansion_rate, value_residual_gate=self.value_residual_gate,
                             resformer_lambdas=self.resformer_lambdas,
                             value_residual_gate_impl=self.value_residual_gate_impl, spelling="fields")
        if errors:
            raise ValueError("; ".join(errors))
        errors = archs.get(self.arch).layout_errors(self)
        if errors:
            raise ValueError("; ".join(errors))
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
    def fused_value_residual_gate(self) -> bool:
        """SATFormer's gate rows live in linear_qkv (value_residual_gate_impl 'fused', where it applies)."""
        return archs.get(self.arch).fused_gate(self, self.tensor_model_parallel_size)

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
    raise ValueError(f"unknown gate {name!r}; choose one of {', '.join(GATES)}")


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
    """The paper's Llama-style block (ModelArgs' fixed fields) with the given sizes; any TransformerConfig or
    ModelArgs field can be overridden."""
    described = {k: overrides.pop(k) for k in NAMES if k in overrides}
    model = ModelArgs(arch=arch, num_layers=num_layers, hidden_size=hidden_size,
                      num_attention_heads=num_attention_heads, num_query_groups=num_query_groups,
                      ffn_hidden_size=ffn_hidden_size, **described)
    fields = dict(
        asdict(model),
        activation_func=F.silu,  # with gated_linear_unit: SwiGLU
        add_qkv_bias=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    return SATConfig(**fields)
