"""The architectures, and what each one carries and refuses: the one place these facts are written.

Imports nothing heavy (no torch, no megatron), so argument parsing, recipes, the planner, the Slurm
tools and the model config all read the same facts:

    ARCHS               every arch the project trains
    VALUE_RESIDUAL      carry layer 1's values V1 to later layers (ResFormer, SATFormer)
    DENSE               carry every earlier layer's output (DenseFormer, MUDDFormer): no full recompute
    BASELINES           the paper's dense-connection baselines: BF16 only (no FP8)
    GATES               SATFormer's gate functions (relu is the paper's)
    arch_label(...)     'satformer:dot_product' -> (arch, config overrides): A/B variants benchmarked side by side
    muddformer_ffn_width(...)  MUDDFormer's per-layer FFN widths (model, parameter counts, HF conversion)
    arch_errors(...)    what an arch refuses, one line each (the trainer's flags and the model config
                        both report these)
"""

from typing import List, Optional

ARCHS = ("transformer", "resformer", "satformer", "denseformer", "muddformer", "hyperconnections")
VALUE_RESIDUAL = ("resformer", "satformer")
DENSE = ("denseformer", "muddformer")
BASELINES = ("denseformer", "muddformer", "hyperconnections")
GATES = ("relu", "sigmoid", "tanh", "identity", "softmax", "softmax_sigmoid")
RESFORMER_LAMBDAS = ("learned", "fixed")
OUTPUT_LAYER_INITS = ("scaled", "unscaled")  # Megatron's std / sqrt(2L) for output projections, or the plain std
LOCAL_ATTENTION = ("sdpa", "dot_product")  # the local backend's core attention: torch SDPA, or Megatron's baddbmm
WEIGHT_DECAY_PARAMS = ("matrices", "all")     # Megatron's rule (no decay on 1-D tensors and biases), or every tensor


# label suffixes for benchmarking one arch two ways in one run (tools/benchmark_step.py, tools/profile_throughput.py)
ARCH_VARIANTS = {
    "dot_product": {"local_attention": "dot_product"},  # Megatron's DotProductAttention instead of torch SDPA
}


def arch_label(label: str):
    """'arch' or 'arch:variant' -> (arch, SATConfig overrides); ValueError naming the choices otherwise."""
    arch, _, variant = label.partition(":")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} in {label!r}; choose one of {', '.join(ARCHS)}")
    if variant and variant not in ARCH_VARIANTS:
        raise ValueError(f"unknown variant {variant!r} in {label!r}; choose one of {', '.join(ARCH_VARIANTS)}")
    return arch, dict(ARCH_VARIANTS.get(variant, {}))


def muddformer_ffn_width(base: int, num_layers: int, layer_number: int, realloc: bool = True) -> int:
    """MUDDFormer's FFN width of 1-based layer_number (param_realloc): 0.5x at layer 1 to 1.5x at layer L of
    base, rounded to the nearest multiple of 256 and at least 256, as the authors' code does at every size."""
    if not realloc or num_layers == 1:
        return base
    scale = (0.5 * (num_layers - layer_number) + 1.5 * (layer_number - 1)) / (num_layers - 1)
    return max(256, (int(round(scale * base)) + 127) // 256 * 256)


def arch_errors(arch: str, *, fp8: Optional[str] = None, recompute_granularity: Optional[str] = None,
                hc_expansion_rate: int = 4, value_residual_gate: str = "relu",
                resformer_lambdas: str = "learned") -> List[str]:
    """Every reason the arch refuses these settings (empty when it takes them)."""
    if arch not in ARCHS:
        return [f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}"]
    errors = []
    if value_residual_gate not in GATES:
        errors.append(f"unknown --value-residual-gate {value_residual_gate!r}; choose one of {', '.join(GATES)}")
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
