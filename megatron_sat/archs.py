"""The architectures, and what each one carries and refuses: the one place these facts are written.

Imports nothing heavy (no torch, no megatron), so argument parsing, recipes, the planner, the Slurm
tools and the model config all read the same facts:

    ARCHS               every arch the project trains
    VALUE_RESIDUAL      carry layer 1's values V1 to later layers (ResFormer, SATFormer)
    DENSE               carry every earlier layer's output (DenseFormer, MUDDFormer): no full recompute
    BASELINES           the paper's dense-connection baselines: BF16 only (no FP8)
    GATES               SATFormer's gate functions (relu is the paper's)
    GATE_IMPLS          how the gate is computed: fused into linear_qkv (default) or its own GEMM
    arch_label(...)     'satformer:separate' -> ('satformer', {'value_residual_gate_impl': 'separate'}): the
                        profilers' labels for one arch two ways in one run (also ARCH:dot_product)
    muddformer_ffn_width(...)  MUDDFormer's per-layer FFN widths (model, parameter counts, HF conversion)
    arch_errors(...)    what an arch refuses, one line each (the trainer's flags and the model config
                        both report these)
"""

from typing import Dict, List, Optional, Tuple

ARCHS = ("transformer", "resformer", "satformer", "denseformer", "muddformer", "hyperconnections")
VALUE_RESIDUAL = ("resformer", "satformer")
DENSE = ("denseformer", "muddformer")
BASELINES = ("denseformer", "muddformer", "hyperconnections")
GATES = ("relu", "sigmoid", "tanh", "identity", "softmax", "softmax_sigmoid")
RESFORMER_LAMBDAS = ("learned", "fixed")
GATE_IMPLS = ("fused", "separate")  # megatron_sat.model.attention; same function, same checkpoints
OUTPUT_LAYER_INITS = ("scaled", "unscaled")  # Megatron's std / sqrt(2L) for output projections, or the plain std
LOCAL_ATTENTION = ("sdpa", "dot_product")  # the local backend's core attention: torch SDPA, or Megatron's baddbmm
WEIGHT_DECAY_PARAMS = ("matrices", "all")     # Megatron's rule (no decay on 1-D tensors and biases), or every tensor


# label suffixes for profiling one arch two ways in one run (tools/benchmark_step.py, tools/profile_throughput.py):
# variant -> (the arch it applies to, None = any; the SATConfig fields it sets)
ARCH_VARIANTS = {
    "separate": ("satformer", {"value_residual_gate_impl": "separate"}),  # W_alpha as its own GEMM
    "fused": ("satformer", {"value_residual_gate_impl": "fused"}),  # W_alpha's rows inside linear_qkv
    "dot_product": (None, {"local_attention": "dot_product"}),  # Megatron's DotProductAttention, not torch SDPA
}


def arch_label(label: str) -> Tuple[str, Dict[str, str]]:
    """(arch, config fields) of a profiler label: an arch, or ARCH:VARIANT (ARCH_VARIANTS); ValueError with the
    accepted forms otherwise."""
    arch, colon, variant = label.partition(":")
    applies_to, fields = ARCH_VARIANTS.get(variant, ("", {}))
    if arch not in ARCHS or colon and applies_to not in (None, arch):
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


def muddformer_ffn_width(base: int, num_layers: int, layer_number: int, realloc: bool = True) -> int:
    """MUDDFormer's FFN width of 1-based layer_number (param_realloc): 0.5x at layer 1 to 1.5x at layer L of
    base, rounded to the nearest multiple of 256 and at least 256, as the authors' code does at every size."""
    if not realloc or num_layers == 1:
        return base
    scale = (0.5 * (num_layers - layer_number) + 1.5 * (layer_number - 1)) / (num_layers - 1)
    return max(256, (int(round(scale * base)) + 127) // 256 * 256)


def arch_errors(arch: str, *, fp8: Optional[str] = None, recompute_granularity: Optional[str] = None,
                hc_expansion_rate: int = 4, value_residual_gate: str = "relu",
                resformer_lambdas: str = "learned", value_residual_gate_impl: str = "fused") -> List[str]:
    """Every reason the arch refuses these settings (empty when it takes them)."""
    if arch not in ARCHS:
        return [f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}"]
    errors = []
    if value_residual_gate not in GATES:
        errors.append(f"unknown --value-residual-gate {value_residual_gate!r}; choose one of {', '.join(GATES)}")
    if value_residual_gate_impl not in GATE_IMPLS:
        errors.append(f"unknown --value-residual-gate-impl {value_residual_gate_impl!r}; choose one of "
                      f"{', '.join(GATE_IMPLS)}")
    if resformer_lambdas not in RESFORMER_LAMBDAS:
        errors.append(f"unknown --resformer-lambdas {resformer_lambdas!r}; choose one of "
                      f"{', '.join(RESFORMER_LAMBDAS)}")
    if arch in BASELINES and fp8:
        errors.append(f"--fp8-format is not supported for the {arch} baseline (BF16 only)")
    if arch in DENSE and recompute_granularity == "full":
        errors.append(f"--recompute-granularity full is not supported for --arch {arch} (it carries every "
                      "earlier layer's output from layer to layer); use --recompute-granularity selective")
    if arch == "hyperconnections" and hc_expansion_rate < 1:
        errors.append(f"--hc-expansion-rate must be >= 1 (got {hc_expansion_rate})")
    return errors
