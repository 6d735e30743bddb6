"""The architectures: one module per arch in this package, each an `Arch` (base.py: every hook the model, the
planner, FLOPs, the conversion and the tools ask), and the registry (registry.py: register, get, names).

Imports nothing heavy (no torch, no megatron), so argument parsing, recipes, the planner, the Slurm tools and the
model config all read the same facts:

    ARCHS               every arch of this package: the paper's six, then any other module here
    get(name)           an arch's Arch; names(): every registered arch (with those of MSAT_ARCH_MODULES)
    VALUE_RESIDUAL      carry layer 1's values V1 to later layers (ResFormer, SATFormer)
    DENSE               carry every earlier layer's output (DenseFormer, MUDDFormer): no full recompute
    BASELINES           the paper's dense-connection baselines: BF16 only (no FP8)
    GATES               SATFormer's gate functions (relu is the paper's)
    GATE_IMPLS          how the gate is computed: fused into linear_qkv (default) or its own GEMM
    arch_label(...)     'satformer:separate' -> ('satformer', {'value_residual_gate_impl': 'separate'}): the
                        profilers' labels for one arch two ways in one run (also ARCH:dot_product)
    mixing_layers(...)  the layers that mix V1 (the model, parameter counts, FLOPs, the HF conversion)
    ffn_size(...)       a layer's FFN width (MUDDFormer's vary with depth): the model, parameter counts,
                        FLOPs, the planner and the HF conversion
    UPCYCLE_TARGETS     the archs a Transformer's weights can start
    upcycle_errors(...) why a model cannot start from another arch's weights (Arch.upcycle_errors; model/upcycle.py)
    arch_errors(...)    what an arch refuses, one line each: the trainer's flags and the model config both
                        check these, the messages naming the flag or the config field

A new arch is one module: docs/architectures.md ("Bring your own arch").
"""

import importlib
import pkgutil
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

from megatron_sat.archs.base import Arch
from megatron_sat.archs.registry import get, known, names, register, registered

PAPER_ARCHS = ("transformer", "resformer", "satformer", "denseformer", "muddformer", "hyperconnections")
_NOT_ARCHS = ("base", "registry", "value_residual", "dense")  # the modules of shared parts


def _import_package_archs() -> None:
    """Import the paper's six in their order, then every other arch module of this package."""
    others = sorted(info.name for info in pkgutil.iter_modules(__path__)
                    if info.name not in PAPER_ARCHS + _NOT_ARCHS)
    for name in PAPER_ARCHS + tuple(others):
        importlib.import_module(f"{__name__}.{name}")


_import_package_archs()

ARCHS = registered()  # before any user module (MSAT_ARCH_MODULES) is imported
VALUE_RESIDUAL = tuple(a for a in ARCHS if get(a).value_residual)
DENSE = tuple(a for a in ARCHS if get(a).dense)
BASELINES = tuple(a for a in ARCHS if get(a).baseline)
# the archs a Transformer's weights can start (at or next to its function: Arch.upcycle_errors, model/upcycle.py)
UPCYCLE_TARGETS = tuple(a for a in ARCHS if type(get(a)).upcycle_errors is not Arch.upcycle_errors)
GATES = ("relu", "sigmoid", "tanh", "identity", "softmax", "softmax_sigmoid")
RESFORMER_LAMBDAS = ("learned", "fixed")
GATE_IMPLS = ("fused", "separate")  # megatron_sat.model.attention; same function, same checkpoints
OUTPUT_LAYER_INITS = ("scaled", "unscaled")  # Megatron's std / sqrt(2L) for output projections, or the plain std
LOCAL_ATTENTION = ("sdpa", "dot_product")  # the local backend's core attention: torch SDPA, or Megatron's baddbmm
WEIGHT_DECAY_PARAMS = ("matrices", "all")     # Megatron's rule (no decay on 1-D tensors and biases), or every tensor

SUBJECT = "satformer"  # the paper's arch: the profilers' "satformer vs" comparisons
REFERENCE = "transformer"  # the baseline the profilers' ratios and the parameter counts divide by
PAPER_REFERENCES = ("transformer", "resformer")  # the archs the paper reports loss differences to

__all__ = ["Arch", "get", "known", "names", "register", "ARCHS", "PAPER_ARCHS"]


# label suffixes for profiling one arch two ways in one run (tools/benchmark_step.py, tools/profile_throughput.py):
# variant -> (the archs it applies to: 'gated' = those with SATFormer's gate, None = any; the SATConfig fields it sets)
ARCH_VARIANTS = {
    "separate": ("gated", {"value_residual_gate_impl": "separate"}),  # W_alpha as its own GEMM
    "fused": ("gated", {"value_residual_gate_impl": "fused"}),  # W_alpha's rows inside linear_qkv
    "dot_product": (None, {"local_attention": "dot_product"}),  # Megatron's DotProductAttention, not torch SDPA
}


def arch_label(label: str) -> Tuple[str, Dict[str, str]]:
    """(arch, config fields) of a profiler label: an arch, or ARCH:VARIANT (ARCH_VARIANTS); ValueError with the
    accepted forms otherwise."""
    arch, colon, variant = label.partition(":")
    applies_to, fields = ARCH_VARIANTS.get(variant, ("", {}))
    if not known(arch) or colon and not (applies_to is None or applies_to == "gated" and get(arch).gated):
        raise ValueError(f"unknown arch label {label!r}; use one of {', '.join(ARCHS)}, ARCH:dot_product (Megatron's "
                         f"DotProductAttention), or satformer:IMPL with IMPL one of {', '.join(GATE_IMPLS)} (the "
                         "SATFormer gate's implementation)")
    return arch, (dict(fields) if colon else {})


def arch_label_errors(labels) -> List[str]:
    """arch_label's one-line refusal of each label it does not take (the profilers' --archs check)."""
    errors = []
    for label in labels:
        try:
            arch_label(label)
        except ValueError as e:
            errors.append(str(e))
    return errors


def mixing_layers(config) -> List[int]:
    """1-based numbers of the layers that mix V1 in a model described by SATConfig's field names: layers 2..L, or
    the last k with value_residual_last_k = k; none for an arch without a value residual (layer 1 produces V1)."""
    return get(config.arch).mixing_layers(config)


def ffn_size(config, layer_number: int) -> int:
    """FFN width of 1-based layer_number in a model described by SATConfig's field names (a SATConfig, the HF
    conversion's ModelSpec): ffn_hidden_size, except where the arch varies it (MUDDFormer's param_realloc)."""
    return get(config.arch).ffn_size(config, layer_number)


# how a message names a setting: the trainer's flags (--value-residual-gate) or SATConfig's fields
# (value_residual_gate); TransformerConfig's fp8 field holds the format, and its message names the feature
_FLAG_NAMES = {"fp8": "--fp8-format"}
_FIELD_NAMES = {"fp8": "FP8"}


def arch_errors(arch: str, *, fp8: Optional[str] = None, recompute_granularity: Optional[str] = None,
                hc_expansion_rate: int = 4, value_residual_gate: str = "relu",
                resformer_lambdas: str = "learned", value_residual_gate_impl: str = "fused",
                spelling: str = "flags") -> List[str]:
    """Every reason the arch refuses these settings (empty when it takes them), naming each setting as the
    trainer's flag (spelling 'flags': --arch mamba) or as the model config's field ('fields': arch='mamba')."""
    if spelling not in ("flags", "fields"):
        raise ValueError(f"unknown spelling {spelling!r}; use 'flags' or 'fields'")

    def name(field: str) -> str:
        if spelling == "fields":
            return _FIELD_NAMES.get(field, field)
        return _FLAG_NAMES.get(field, "--" + field.replace("_", "-"))

    def setting(field: str, value: str) -> str:
        return f"{name(field)}={value!r}" if spelling == "fields" else f"{name(field)} {value}"

    if not known(arch):
        return [f"unknown {name('arch')} {arch!r}; choose one of {', '.join(names())}"]
    errors = []
    for field, value, choices in (("value_residual_gate", value_residual_gate, GATES),
                                  ("value_residual_gate_impl", value_residual_gate_impl, GATE_IMPLS),
                                  ("resformer_lambdas", resformer_lambdas, RESFORMER_LAMBDAS)):
        if value not in choices:
            errors.append(f"unknown {name(field)} {value!r}; choose one of {', '.join(choices)}")
    model = SimpleNamespace(fp8=fp8, recompute_granularity=recompute_granularity, hc_expansion_rate=hc_expansion_rate,
                            value_residual_gate=value_residual_gate, resformer_lambdas=resformer_lambdas,
                            value_residual_gate_impl=value_residual_gate_impl)
    return errors + get(arch).errors(model, name, setting)


def upcycle_errors(source: str, model, flag: str = "--pretrained-checkpoint") -> List[str]:
    """Why `model` (ModelArgs' field names) cannot start from the weights of a `source` model, one line each naming
    the trainer's flags; empty when it can (the same arch: nothing to grow)."""
    if source == model.arch:
        return []
    if not known(source) or not get(source).plain:
        return [f"{flag} holds a {source} model and --arch is {model.arch}: only a Transformer's weights start "
                f"another arch; pass --arch {source} (or the checkpoint's recipe)"]

    def setting(field: str, value) -> str:
        return f"--{field.replace('_', '-')} {value}"

    return get(model.arch).upcycle_errors(model, setting)
