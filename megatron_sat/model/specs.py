"""Layer specs: Megatron's Llama-style GPT layer, with module swaps for the other archs.

A variant is a spec plus a small subclass, on Megatron's own submodules; the arch's module (megatron_sat/archs/)
names them (Arch.layer_class, attention_class, unfused_input_norm):
    transformer        Megatron's spec untouched
    satformer/resformer    layer ValueResidualTransformerLayer, attention ValueResidualSelfAttention
    denseformer        layer DenseFormerLayer
    muddformer         layer MUDDFormerLayer, attention MultiInputSelfAttention, unfused input norm
    hyperconnections   layer HyperConnectionsLayer
The baselines' extra norms are built from `norm` in LayerSubmodules (the backend's RMSNorm).
Every arch's q/k norms use config.qk_norm_eps (`qk_norm_builder`), not layernorm_epsilon; qk_layernorm=False
(--no-qk-layernorm, Llama) builds none.

Two backends with the same classes on top:
  * local: pure Megatron-Core modules, runs anywhere (the CPU path and the tests); core attention on
           torch's scaled_dot_product_attention (flash kernels on any GPU) unless local_attention='dot_product';
  * te:    Transformer Engine linears, norms and attention (BF16/FP8, context parallel), chosen
           when transformer_engine imports and a GPU is present. SATFormer's fused gate is rows of
           linear_qkv, so its layer keeps TE's fused norm+QKV linear like the Transformer's; the
           separate gate reads the normalised x, which that linear keeps to itself, so there the norm
           is a TENorm in front of a TEColumnParallelLinear (same weights, unfused).
"""

import copy
import dataclasses
import importlib
import warnings
from typing import Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron_sat import archs
from megatron_sat.model.config import SATConfig
from megatron_sat.model.core_attention import SDPAttention


@dataclasses.dataclass
class LayerSubmodules(TransformerLayerSubmodules):
    """Megatron's layer submodules plus the norm that the baselines' extra norms are built from."""

    norm: object = None

try:  # Transformer Engine exists only on GPU machines (it cannot even import with CPU torch)
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except Exception:  # ImportError, or its own errors when it finds no CUDA
    HAVE_TE = False


def te_available() -> bool:
    return HAVE_TE and torch.cuda.is_available()


def qk_norm_builder(norm):
    """The q/k norm built with config.qk_norm_eps: Megatron's attention passes layernorm_epsilon to it."""

    def build(hidden_size, config, eps=None):
        return build_module(norm, hidden_size=hidden_size, config=config, eps=config.qk_norm_eps)

    return build


def resolve(ref):
    """A class an arch names: the class itself, or "module:Class" (imported here, so that the arch's module
    stays torch-free)."""
    if not isinstance(ref, str):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def layer_spec(config: SATConfig, backend: Optional[str] = None) -> ModuleSpec:
    """The decoder layer spec for config.arch on `backend` ('local', 'te' or None = best available)."""
    backend = backend or ("te" if te_available() else "local")
    if backend == "te":
        if not HAVE_TE:
            raise RuntimeError("backend 'te' needs transformer-engine (pip install -e .[te] on a GPU machine)")
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    elif backend == "local":
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
        if config.local_attention == "sdpa":  # torch's fused attention in place of the [b, np, s, s] baddbmm
            spec.submodules.self_attention.submodules.core_attention = SDPAttention
    else:
        raise ValueError(f"unknown backend {backend!r}; choose 'local' or 'te'")
    layer = copy.deepcopy(spec.submodules)
    attention = layer.self_attention
    for name in ("q_layernorm", "k_layernorm") if config.qk_layernorm else ():  # --no-qk-layernorm: none (Llama)
        setattr(attention.submodules, name, qk_norm_builder(getattr(attention.submodules, name)))
    arch = archs.get(config.arch)
    if arch.layer_class is None:  # Megatron's own layer (the Transformer)
        return ModuleSpec(module=spec.module, params=spec.params, submodules=layer)
    module = resolve(arch.layer_class)
    if arch.attention_class is not None:
        attention.module = resolve(arch.attention_class)
    # the separate gate reads the normalised x; the fused one is part of the fused norm + QKV linear
    unfused_input_norm = arch.unfused_input_norm(config)
    if arch.gated and unfused_input_norm and config.value_residual_gate_impl == "fused":
        warnings.warn("SATFormer's fused gate needs num_query_groups divisible by the TP size and no QKV bias: "
                      "this model runs the separate gate (--value-residual-gate-impl separate)", stacklevel=2)
    if backend == "te":
        # Transformer Engine: optional, GPU only (HAVE_TE above); this module of megatron-core imports it
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        te = TESpecProvider()
        norm = te.layer_norm(has_residual=True)
        if unfused_input_norm:
            layer.input_layernorm = norm
            attention.submodules.linear_qkv = te.column_parallel_linear()
    else:
        norm = layer.input_layernorm
    fields = {f.name: getattr(layer, f.name) for f in dataclasses.fields(TransformerLayerSubmodules)}
    return ModuleSpec(module=module, submodules=LayerSubmodules(**fields, norm=norm))
