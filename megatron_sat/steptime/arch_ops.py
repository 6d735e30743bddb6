"""What an arch adds to the Transformer block's operators, asked of the arch's module (megatron_sat/archs/:
Arch.step_ops, the Transformer's answer empty): this module gives it the micro-batch's sizes and the operator
constructors, and takes back an ArchLayer.

An ArchLayer holds the layer's extra operators (forward; roofline.py derives their backward), the columns the arch
adds to linear_qkv (over all TP ranks: SATFormer's fused gate) and whether the arch's own stream updates replace
the block's two residual adds (Hyper-Connections). Each operator's group is its name in the breakdown (what
tools/arch_steptime.py shows as the difference). Pipeline messages: the planner's wire channels
(training/planner.py: the baselines' streams and V1), read there.
"""

from dataclasses import dataclass, field
from typing import List

from megatron_sat import archs
from megatron_sat.steptime.roofline import Op, gemm, memory


@dataclass
class ArchLayer:
    ops: List[Op] = field(default_factory=list)
    qkv_columns: int = 0  # columns added to linear_qkv over all TP ranks
    replaces_residual: bool = False  # the arch's stream updates replace the block's two residual adds


@dataclass(frozen=True)
class LayerContext:
    """One micro-batch of one layer on one rank: tokens = b s / CP (the GEMMs' rows), sp_tokens = tokens / TP under
    sequence parallelism (else tokens), tp, and bytes per activation value; and what an arch module builds its
    answer with (so that the arch modules import nothing of the step-time model)."""

    tokens: int
    sp_tokens: int
    tp: int
    act_bytes: int = 2

    gemm = staticmethod(gemm)      # gemm(name, m, n, k, group=...): an [m, k] x [k, n] product
    memory = staticmethod(memory)  # memory(name, bytes, group=..., bwd_bytes=..., count=...): memory-bound kernels

    @staticmethod
    def layer(ops=(), qkv_columns: int = 0, replaces_residual: bool = False) -> ArchLayer:
        return ArchLayer(ops=list(ops), qkv_columns=qkv_columns, replaces_residual=replaces_residual)


def arch_layer(model, layer: int, ctx: LayerContext) -> ArchLayer:
    """The arch's additions to global layer `layer` (its module's step_ops)."""
    return archs.get(model.arch).step_ops(model, layer, ctx)
