"""Per-layer and per-stage costs of one micro-batch on one rank: the Transformer block's operators (plus the arch's,
arch_ops.py), the tensor- and context-parallel communication they need, and what overlapping hides.

Operators of a layer's forward (t TP, T = b s / CP tokens; T' = T / t with sequence parallelism, else T; a bytes
per activation value; f the layer's FFN width):

    input norm         memory 2 T' h a            QKV GEMM    [T, h] x [h, (nq + 2 ng) d / t (+ arch columns)]
    QK norm, RoPE      memory 2 T (nq + ng) d / t a each          flash attention  b, nq / t heads, s / CP queries, s keys
    output projection  [T, nq d / t] x [nq d / t, h]             residual add  memory 3 T' h a
    pre-MLP norm       memory 2 T' h a            FC1         [T, h] x [h, f (x 2 gated) / t]
    activation         memory (3 gated | 2) T f / t a            FC2   [T, f / t] x [f / t, h]    residual add
    FP8                each GEMM's activation input cast to FP8 (reads 2, writes 1 byte a value) before it
Per model: the embedding lookup (first stage), the final norm, the logits GEMM [T, h] x [h, V / t] and the cross
entropy (last stage): Megatron's vocab-parallel cross entropy upcasts the logits to fp32 and makes max, subtract,
exp, sum and softmax passes (CE_FWD_BYTES per logit) and its backward three more (CE_BWD_BYTES).

Tensor parallelism (t > 1), per layer and micro-batch, on [T, h] (T h a bytes): with sequence parallelism two
all-gathers and two reduce-scatters forward, and backward the same plus two all-gathers of the inputs again for the
weight gradients; without, two all-reduces each way. `tp_comm_overlap` (Transformer Engine's userbuffers; needs
sequence parallelism) hides each collective behind the GEMM it feeds or follows, only up to that GEMM's time.
Context parallelism: the ring passes K and V (2 T ng d / t a) CP - 1 times forward (twice that backward, with the
gradients) behind the attention, exposed only past it.
Recompute: selective re-runs the core attention's forward in backward; full re-runs the layer's forward.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import megatron_sat.steptime.collectives as collectives
from megatron_sat.steptime.arch_ops import LayerContext, arch_layer
from megatron_sat.steptime.hardware import Cluster
from megatron_sat.steptime.roofline import Op, attention, gemm, memory, op_time

CE_FWD_BYTES = 38  # per logit: read bf16, write fp32 (6), max (4), subtract (8), exp (8), sum (4), softmax (8)
CE_BWD_BYTES = 22  # per logit: the softmax gradient (8), the scale (8), the bf16 cast (6)


@dataclass
class Cost:
    """Seconds of one pass (forward or backward) of some layers for one micro-batch: compute by group, and the
    exposed communication."""

    compute: Dict[str, float] = field(default_factory=dict)
    tp_comm: float = 0.0  # tensor/sequence-parallel collectives, as exposed
    cp_comm: float = 0.0  # context-parallel ring, as exposed

    def add(self, group: str, seconds: float) -> None:
        self.compute[group] = self.compute.get(group, 0.0) + seconds

    def merge(self, other: "Cost") -> None:
        for k, v in other.compute.items():
            self.add(k, v)
        self.tp_comm += other.tp_comm
        self.cp_comm += other.cp_comm

    @property
    def total(self) -> float:
        return sum(self.compute.values()) + self.tp_comm + self.cp_comm


def layer_ops(model, layer: int, layout, seq_length: int) -> tuple:
    """(operators of global layer `layer`'s forward, the GEMMs a TP collective pairs with, attention op)."""
    t, cp, b = layout.tp, layout.cp, layout.micro_batch_size
    h, d = model.hidden_size, model.kv_channels
    nq, ng = model.num_attention_heads, model.num_query_groups
    a = 2 if layout.precision in ("bf16", "fp16", "fp8") else 4
    tokens = b * seq_length // cp
    sp_tokens = tokens // t if layout.sequence_parallel else tokens
    ctx = LayerContext(tokens=tokens, sp_tokens=sp_tokens, tp=t, act_bytes=a)
    extra = arch_layer(model, layer, ctx)
    f = model.ffn(layer)
    gated = model.gated_linear_unit
    qkv = gemm("QKV", tokens, ((nq + 2 * ng) * d + extra.qkv_columns) // t, h)
    proj = gemm("output projection", tokens, h, nq * d // t)
    fc1 = gemm("FC1", tokens, f * (2 if gated else 1) // t, h)
    fc2 = gemm("FC2", tokens, h, f // t)
    att = attention("flash attention", b, nq // t, seq_length // cp, seq_length, d)
    heads_qk = tokens * (nq + ng) * d / t * a
    ops: List[Op] = [memory("input norm", 2 * sp_tokens * h * a), qkv]
    if model.qk_layernorm:
        ops.append(memory("QK norm", 2 * heads_qk))
    ops += [memory("RoPE", 2 * heads_qk), att, proj, memory("pre-MLP norm", 2 * sp_tokens * h * a), fc1,
            memory("activation", (3 if gated else 2) * tokens * f / t * a), fc2]
    if not extra.replaces_residual:
        ops.append(memory("residual adds", 2 * 3 * sp_tokens * h * a, count=2))
    if layout.precision == "fp8":
        ops.append(memory("FP8 casts", 3 * tokens * (2 * h + nq * d / t + f / t), count=4))
    ops += extra.ops
    return ops, (qkv, proj, fc1, fc2), att


def layer_cost(model, layer: int, layout, c: Cluster, seq_length: int) -> tuple:
    """(forward Cost, backward Cost) of global layer `layer` for one micro-batch on one rank, recompute included in
    the backward."""
    hw = c.gpu
    prec = layout.precision
    ops, paired, att = layer_ops(model, layer, layout, seq_length)
    fwd, bwd = Cost(), Cost()
    for op in ops:
        fwd.add(op.group, op_time(hw, op, prec))
        bwd.add(op.group, op_time(hw, op, prec, backward=True))
    t, cp = layout.tp, layout.cp
    a = 2 if prec in ("bf16", "fp16", "fp8") else 4
    tokens = layout.micro_batch_size * seq_length // cp
    if t > 1:
        msg = tokens * model.hidden_size * a  # one [T, h]
        stride = 1
        if layout.sequence_parallel:
            one = collectives.all_gather(c, msg, t, stride)  # = reduce-scatter's
            fwd_comm = [one] * 4
            bwd_comm = [one] * 4
            bwd_extra = 2 * one  # the inputs gathered again for the weight gradients
        else:
            one = collectives.all_reduce(c, msg, t, stride)
            fwd_comm, bwd_comm, bwd_extra = [one, one], [one, one], 0.0
        if layout.tp_comm_overlap and layout.sequence_parallel:
            fwd.tp_comm = sum(max(0.0, x - op_time(hw, g, prec)) for x, g in zip(fwd_comm, paired))
            bwd.tp_comm = sum(max(0.0, x - op_time(hw, g, prec, backward=True)) for x, g in zip(bwd_comm, paired))
            bwd.tp_comm += max(0.0, bwd_extra - 0.5 * sum(op_time(hw, g, prec, backward=True) for g in paired))
        else:
            fwd.tp_comm, bwd.tp_comm = sum(fwd_comm), sum(bwd_comm) + bwd_extra
    if cp > 1:
        kv = 2 * tokens * model.num_query_groups * model.kv_channels / t * a
        ring = (cp - 1) * collectives.send(c, kv, across_nodes=collectives.members_per_node(cp, t, c.gpus_per_node) < cp)
        fwd.cp_comm = max(0.0, ring - op_time(hw, att, prec))
        bwd.cp_comm = max(0.0, 2 * ring - op_time(hw, att, prec, backward=True))
    if layout.recompute == "selective":
        bwd.add("recompute", op_time(hw, att, prec))
    elif layout.recompute == "full" and not model.is_dense:  # the dense archs refuse full (as selective)
        bwd.add("recompute", fwd.total)
    elif layout.recompute == "full":
        bwd.add("recompute", op_time(hw, att, prec))
    return fwd, bwd


def embedding_cost(model, layout, c: Cluster, seq_length: int) -> tuple:
    """(forward, backward) of the embedding lookup on the first stage."""
    tokens = layout.micro_batch_size * seq_length // layout.cp
    rows = tokens * model.hidden_size
    fwd, bwd = Cost(), Cost()
    fwd.add("elementwise", op_time(c.gpu, memory("embedding", 2 * rows * 2)))
    bwd.add("elementwise", op_time(c.gpu, memory("embedding", 0, bwd_bytes=rows * (2 + 4 + 4)), backward=True))
    t = layout.tp
    if t > 1:  # the vocab-parallel lookup's partial rows summed: reduce-scatter (SP) or all-reduce
        fn = collectives.reduce_scatter if layout.sequence_parallel else collectives.all_reduce
        fwd.tp_comm = fn(c, rows * 2, t)
    return fwd, bwd


def head_cost(model, layout, c: Cluster, seq_length: int, vocab_size: int) -> tuple:
    """(forward, backward) of the final norm, the logits GEMM and the cross entropy on the last stage."""
    hw, t, prec = c.gpu, layout.tp, layout.precision
    tokens = layout.micro_batch_size * seq_length // layout.cp
    sp_tokens = tokens // t if layout.sequence_parallel else tokens
    h = model.hidden_size
    logits = tokens * vocab_size / t
    ops = [memory("final norm", 2 * sp_tokens * h * 2), gemm("logits", tokens, vocab_size // t, h, group="logits"),
           memory("cross entropy", CE_FWD_BYTES * logits, group="cross_entropy", bwd_bytes=CE_BWD_BYTES * logits,
                  count=6)]
    fwd, bwd = Cost(), Cost()
    for op in ops:
        fwd.add(op.group, op_time(hw, op, prec))
        bwd.add(op.group, op_time(hw, op, prec, backward=True))
    if t > 1 and layout.sequence_parallel:  # the final norm's output gathered; its gradient reduce-scattered
        one = collectives.all_gather(c, tokens * h * 2, t)
        fwd.tp_comm = one if not layout.tp_comm_overlap else max(0.0, one - op_time(hw, ops[1], prec))
        bwd.tp_comm = one if not layout.tp_comm_overlap else max(0.0, one - op_time(hw, ops[1], prec, True))
    elif t > 1:  # the input gradient of the column-parallel output layer, all-reduced
        bwd.tp_comm = collectives.all_reduce(c, tokens * h * 2, t)
    if t > 1:  # the vocab-parallel cross entropy's three small all-reduces (max, sum, target logit) per token
        small = 3 * collectives.all_reduce(c, tokens * 4, t)
        fwd.tp_comm += small
    return fwd, bwd


def cost_key(layout, seq_length: int) -> tuple:
    """The layout's fields a layer's, the embedding's and the head's costs depend on (with the model and the
    cluster): the key under which stage_costs' memo keeps them."""
    return (layout.tp, layout.cp, layout.micro_batch_size, layout.sequence_parallel, layout.precision,
            layout.tp_comm_overlap, layout.recompute, seq_length)


def stage_costs(model, layout, c: Cluster, seq_length: int, vocab_size: int,
                chunk_layers: List[range], memo: Optional[dict] = None) -> tuple:
    """(forward[r][v], backward[r][v]) Costs of every pipeline stage's chunks for one micro-batch.

    memo: a dict shared by calls for the same model and cluster (the layout search's), in which each layer's and
    each chunk's Costs are kept under cost_key, so that layouts sharing those fields cost them once. The Costs
    returned may be shared through it: read them, do not change them."""
    pp, chunks = layout.pp, layout.vpp or 1
    memo = {} if memo is None else memo
    key = cost_key(layout, seq_length)

    def one(layer: int) -> tuple:
        k = ("layer", layer, key)
        if k not in memo:
            memo[k] = layer_cost(model, layer, layout, c, seq_length)
        return memo[k]

    def chunk(layers: range, first: bool, last: bool) -> tuple:
        k = ("chunk", layers.start, layers.stop, layers.step, first, last, key, vocab_size if last else None)
        if k in memo:
            return memo[k]
        f, b = Cost(), Cost()
        for layer in layers:
            lf, lb = one(layer)
            f.merge(lf)
            b.merge(lb)
        if first:
            ek = ("embedding", key)
            if ek not in memo:
                memo[ek] = embedding_cost(model, layout, c, seq_length)
            f.merge(memo[ek][0])
            b.merge(memo[ek][1])
        if last:
            hf, hb = head_cost(model, layout, c, seq_length, vocab_size)
            f.merge(hf)
            b.merge(hb)
        memo[k] = (f, b)
        return memo[k]

    fwd: List[List[Cost]] = []
    bwd: List[List[Cost]] = []
    last = pp * chunks - 1
    for r in range(pp):
        fr, br = [], []
        for v in range(chunks):
            g = v * pp + r
            f, b = chunk(chunk_layers[g], g == 0, g == last)
            fr.append(f)
            br.append(b)
        fwd.append(fr)
        bwd.append(br)
    return fwd, bwd
