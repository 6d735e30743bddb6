"""What each arch adds to the Transformer block's operators: one function per arch (the one place the step-time
model knows an arch; each function is meant to move into its arch module, megatron_sat/model/archs/<arch>.py).

Each operator's breakdown group is its own name (what tools/arch_steptime.py shows as the difference). Every
function takes (model, layer, ctx) - a ModelArgs, a 1-based global layer number and the LayerContext of one
micro-batch on one rank - and returns an ArchLayer: the layer's extra operators (forward; roofline.py derives their
backward), the columns it adds to linear_qkv (over all TP ranks) and whether the layer's Transformer residual adds
are replaced by the arch's own stream updates. Sizes, per token (ctx.tokens: b s / CP; ctx.sp_tokens: / TP under
sequence parallelism, where the replicated per-token work is split), a bytes per value:

    transformer        nothing
    resformer          mixing layers: V' = l1 V1 + l2 V, one kernel: reads V1, V, writes V' (3 g d / t values);
                       backward: the gradients of V1 (accumulated) and V (5 g d / t)
    satformer          mixing layers: the gate's ng rows (fused into linear_qkv; separate: its own [h, ng] GEMM,
                       replicated), the gate function on ng values and the mix alpha V1 + V in one kernel (reads V1,
                       V, alpha, writes V'); backward as ResFormer's (the fused kernel of model/fused_gate.py).
                       The fused layout's zero padding (under 16 rows a rank) is left out
    denseformer        depth-weighted average after layer i over k = i + 1 outputs X_0..X_i: reads k h, writes h;
                       backward reads the gradient and the k inputs and accumulates k gradients (1 + 3k) h
    muddformer         C = 4 ways out (1 at layer L), k = i + 1 inputs: the dynamic weights [h -> Ck] GEMM and
                       [Ck -> Ck] GEMM, pre-norm reads of X_0..X_i (2k h), C weighted sums (C (k + 1) h), the key
                       and value input norms and C post-norms (2 (2 + C) h); the FFN width is the layer's own
                       (param_realloc, through model.ffn)
    hyperconnections   n streams, per sublayer (two a layer): dynamic weights from the normed streams ([n h] norm:
                       2 n h; [h -> n + 2] GEMM over T n rows), the width mix (reads n h, writes (n + 1) h) and the
                       depth update (reads n h + h, writes n h); layer L sums the streams ((n + 1) h). These replace
                       the block's residual adds

Pipeline messages: the planner's wire channels (training/planner.py: the baselines' streams and V1), read there.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List

from megatron_sat.profiling.steptime.roofline import Op, gemm, memory


@dataclass(frozen=True)
class LayerContext:
    """One micro-batch of one layer on one rank: tokens = b s / CP (the GEMMs' rows), sp_tokens = tokens / TP under
    sequence parallelism (else tokens), tp, and bytes per activation value."""

    tokens: int
    sp_tokens: int
    tp: int
    act_bytes: int = 2


@dataclass
class ArchLayer:
    ops: List[Op] = field(default_factory=list)
    qkv_columns: int = 0  # columns added to linear_qkv over all TP ranks
    replaces_residual: bool = False  # the arch's stream updates replace the block's two residual adds


def transformer(model, layer: int, ctx: LayerContext) -> ArchLayer:
    return ArchLayer()


def _value_mix(model, ctx: LayerContext, name: str) -> Op:
    values = ctx.tokens * model.num_query_groups * model.kv_channels / ctx.tp
    return memory(name, 3 * values * ctx.act_bytes, group=name, bwd_bytes=5 * values * ctx.act_bytes)


def resformer(model, layer: int, ctx: LayerContext) -> ArchLayer:
    if layer not in model.mixing_layers:
        return ArchLayer()
    return ArchLayer(ops=[_value_mix(model, ctx, "resformer lambda mix")])


def satformer(model, layer: int, ctx: LayerContext) -> ArchLayer:
    if layer not in model.mixing_layers:
        return ArchLayer()
    ng, h = model.num_query_groups, model.hidden_size
    fused = model.value_residual_gate_impl == "fused" and ng % ctx.tp == 0 and not model.add_bias_linear
    mix = _value_mix(model, ctx, "satformer gate + mix")
    if fused:
        return ArchLayer(ops=[mix], qkv_columns=ng)
    return ArchLayer(ops=[gemm("satformer gate GEMM", ctx.tokens, ng, h, group="satformer gate GEMM"), mix])


def denseformer(model, layer: int, ctx: LayerContext) -> ArchLayer:
    k, u = layer + 1, ctx.sp_tokens * model.hidden_size * ctx.act_bytes
    name = "denseformer weighted sum"
    return ArchLayer(ops=[memory(name, (k + 1) * u, group=name, bwd_bytes=(1 + 3 * k) * u)])


def muddformer(model, layer: int, ctx: LayerContext) -> ArchLayer:
    h, k = model.hidden_size, layer + 1
    c = 1 if layer == model.num_layers else 4
    u = ctx.sp_tokens * h * ctx.act_bytes
    ops = [
        gemm("muddformer dynamic weights W1", ctx.sp_tokens, c * k, h, group="muddformer dynamic weights W1"),
        gemm("muddformer dynamic weights W2", ctx.sp_tokens, c * k, c * k, group="muddformer dynamic weights W2"),
        memory("muddformer pre-norms", 2 * k * u, group="muddformer pre-norms"),
        memory("muddformer weighted sums", c * (k + 1) * u, group="muddformer weighted sums", count=c),
        memory("muddformer norms", 2 * (2 + c) * u, group="muddformer norms", count=2 + c),
    ]
    return ArchLayer(ops=ops)


def hyperconnections(model, layer: int, ctx: LayerContext) -> ArchLayer:
    h, n = model.hidden_size, model.hc_expansion_rate
    u = ctx.sp_tokens * h * ctx.act_bytes
    ops = []
    for sub in ("attention", "mlp"):
        if model.hc_dynamic:
            ops += [memory(f"hc {sub} stream norm", 2 * n * u, group="hc stream norms"),
                    gemm(f"hc {sub} dynamic weights", ctx.sp_tokens * n, n + 2, h, group="hc dynamic weights")]
        ops += [memory(f"hc {sub} width mix", (2 * n + 1) * u, group="hc width mix"),
                memory(f"hc {sub} depth update", (2 * n + 1) * u, group="hc depth update")]
    if layer == model.num_layers:
        ops.append(memory("hc stream sum", (n + 1) * u, group="hc width mix"))
    return ArchLayer(ops=ops, replaces_residual=True)


ARCH_OPS: Dict[str, Callable[..., ArchLayer]] = {
    "transformer": transformer, "resformer": resformer, "satformer": satformer,
    "denseformer": denseformer, "muddformer": muddformer, "hyperconnections": hyperconnections,
}


def arch_layer(model, layer: int, ctx: LayerContext) -> ArchLayer:
    """The arch's additions to global layer `layer` (ValueError for an arch with no entry)."""
    fn = ARCH_OPS.get(model.arch)
    if fn is None:
        raise ValueError(f"step-time model: no operators for arch {model.arch!r} (add one to steptime/arch_ops.py)")
    return fn(model, layer, ctx)
