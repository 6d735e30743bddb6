"""The architectures, and what each one carries and refuses: the one place these facts are written.

Imports nothing heavy (no torch, no megatron), so argument parsing, recipes, the planner, the Slurm
tools and the model config all read the same facts:

    ARCHS               every arch the project trains
    VALUE_RESIDUAL      carry layer 1's values V1 to later layers (ResFormer, SATFormer)
    DENSE               carry every earlier layer's output (DenseFormer, MUDDFormer): no full recompute
    BASELINES           the paper's dense-connection baselines: BF16 only (no FP8)
    GATES               SATFormer's gate functions (relu is the paper's)
    GATE_IMPLS          how the gate is computed: fused into linear_qkv (default) or its own GEMM
    arch_label(...)     'satformer:separate' -> ('satformer', {'value_residual_gate_impl': 'separate'})
                        (the profilers' labels for an arch with a non-default implementation)
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
WEIGHT_DECAY_PARAMS = ("matrices", "all")     # Megatron's rule (no decay on 1-D tensors and biases), or every tensor


def arch_label(label: str) -> Tuple[str, Dict[str, str]]:
    """(arch, config fields) of a profiler label: an arch, or 'satformer:<impl>' with impl one of GATE_IMPLS
    (value_residual_gate_impl); ValueError with the accepted forms otherwise."""
    arch, colon, impl = label.partition(":")
    if arch not in ARCHS or colon and (arch != "satformer" or impl not in GATE_IMPLS):
        raise ValueError(f"unknown arch label {label!r}; use one of {', '.join(ARCHS)}, or satformer:IMPL with IMPL "
                         f"one of {', '.join(GATE_IMPLS)} (the SATFormer gate's implementation)")
    return arch, ({"value_residual_gate_impl": impl} if colon else {})


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
