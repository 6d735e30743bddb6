"""Layer specs: Megatron's Llama-style GPT layer, with two module swaps for value-residual archs.

A variant is a spec plus a small subclass: SATFormer and ResFormer use Megatron's own layer
submodules and replace only the layer class (ValueResidualTransformerLayer) and the attention
class (ValueResidualSelfAttention). The Transformer baseline is Megatron's spec untouched.

Two backends with the same classes on top:
  * local: pure Megatron-Core modules, runs anywhere (the CPU path and the tests);
  * te:    Transformer Engine linears, norms and attention (BF16/FP8, context parallel), chosen
           when transformer_engine imports and a GPU is present. SATFormer's gate reads the
           normalised x, which TE's fused norm+QKV linear keeps to itself, so there the norm is a
           separate TENorm in front of a TEColumnParallelLinear (same weights, unfused).
"""

import copy
from typing import Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_sat.model.attention import ValueResidualSelfAttention
from megatron_sat.model.config import SATConfig
from megatron_sat.model.layer import ValueResidualTransformerLayer

try:  # Transformer Engine exists only on GPU machines (it cannot even import with CPU torch)
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except Exception:  # ImportError, or its own errors when it finds no CUDA
    HAVE_TE = False


def te_available() -> bool:
    return HAVE_TE and torch.cuda.is_available()


def layer_spec(config: SATConfig, backend: Optional[str] = None) -> ModuleSpec:
    """The decoder layer spec for config.arch on `backend` ('local', 'te' or None = best available)."""
    backend = backend or ("te" if te_available() else "local")
    if backend == "te":
        if not HAVE_TE:
            raise RuntimeError("backend 'te' needs transformer-engine (pip install -e .[te] on a GPU machine)")
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    elif backend == "local":
        spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    else:
        raise ValueError(f"unknown backend {backend!r}; choose 'local' or 'te'")
    if not config.uses_value_residual:
        return spec

    layer = copy.deepcopy(spec.submodules)
    attention = layer.self_attention
    attention.module = ValueResidualSelfAttention
    if backend == "te" and config.arch == "satformer":
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        te = TESpecProvider()
        layer.input_layernorm = te.layer_norm(has_residual=True)
        attention.submodules.linear_qkv = te.column_parallel_linear()
    return ModuleSpec(module=ValueResidualTransformerLayer, submodules=layer)
