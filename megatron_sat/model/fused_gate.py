"""SATFormer's gate folded into the fused QKV projection (value_residual_gate_impl='fused').

W_alpha has one row per KV group. Megatron's linear_qkv orders its output rows by KV group,
[q heads, k, v] per group, and tensor parallelism gives each rank whole groups (as Megatron places
its attention output gate). The fused weight adds each group's gate row after its v rows and pads
each rank's shard to a multiple of 16 rows (FP8 GEMMs want them; archs/satformer.py FUSED_ROW_MULTIPLE):

    per TP rank   [ng/tp groups x ((np/ng + 2) hn + 1) rows] + pad rows (zero, never updated)
    global        the TP ranks' shards one after the other (so the padding sits at each shard's end)

so x @ W gives Q, K, V and the gate logits in one GEMM, the gate of a KV head is computed on the rank
that holds the head (no scatter or all-to-all, nothing replicated), and the TE spec keeps its fused
LayerNormColumnParallelLinear. Checkpoints keep the two tensors apart: sharded_state_dict splits the
fused weight into the Transformer's `linear_qkv.weight` and SATFormer's `value_residual_gate.weight`
(a ShardedTensorFactory, as Megatron's SwiGLU fc1), so a checkpoint of either impl loads into the
other at any TP/PP, and converters see the separate layout.

Needs num_query_groups divisible by TP and no QKV bias (`applies`); otherwise the separate gate
(megatron_sat.model.attention.ValueResidualGate) is used. Importing this module needs no Megatron
(the FLOPs and parameter counts read the layout).
"""

from dataclasses import dataclass

import torch

from megatron_sat import archs
from megatron_sat.archs.satformer import fused_padding

GATE_SUFFIX = "value_residual_gate.weight"
QKV_SUFFIX = "linear_qkv.weight"


@dataclass(frozen=True)
class FusedGateLayout:
    """Row layout of one TP rank's fused [Q K V alpha] weight (module docstring)."""

    groups: int  # KV groups on this rank, ng / tp
    q_per_group: int  # np / ng
    head_dim: int  # hn
    tp: int

    @property
    def group_qkv(self) -> int:
        return (self.q_per_group + 2) * self.head_dim

    @property
    def group_width(self) -> int:
        return self.group_qkv + 1

    @property
    def pad(self) -> int:
        return fused_padding(self.groups, self.q_per_group, self.head_dim)

    @property
    def width(self) -> int:
        """Output width per TP rank (a multiple of 16)."""
        return self.groups * self.group_width + self.pad

    @classmethod
    def from_config(cls, config, tp: int) -> "FusedGateLayout":
        ng, nq = config.num_query_groups, config.num_attention_heads
        return cls(groups=ng // tp, q_per_group=nq // ng, head_dim=config.kv_channels, tp=tp)

    def split_output(self, mixed: torch.Tensor):
        """[..., width] -> q [..., groups, np/ng * hn], k, v [..., groups, hn], gate logits [..., groups]
        (views). Two torch.split calls, so that the backward writes the gradient in two concatenations
        (slicing and indexing would each add a zero-filled full-width gradient and a sum)."""
        if self.pad:
            mixed = torch.split(mixed, [self.groups * self.group_width, self.pad], dim=-1)[0]
        grouped = mixed.unflatten(-1, (self.groups, self.group_width))
        hn = self.head_dim
        q, k, v, logits = torch.split(grouped, [self.q_per_group * hn, hn, hn, 1], dim=-1)
        return q, k, v, logits.squeeze(-1)

    def grouped(self, w: torch.Tensor) -> torch.Tensor:
        """Local fused [width, h] -> a view [groups, group_width, h] (the padding left out)."""
        return w[: self.groups * self.group_width].unflatten(0, (self.groups, self.group_width))

    def split_weight(self, w: torch.Tensor):
        """Local fused [width, h] -> (qkv [groups * group_qkv, h], gate [groups, h]), differentiable."""
        grouped = self.grouped(w)
        return grouped[:, : self.group_qkv].flatten(0, 1), grouped[:, self.group_qkv]

    def merge_weight(self, qkv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Inverse of split_weight; the padding rows are zero."""
        h = qkv.shape[-1]
        grouped = torch.cat([qkv.reshape(self.groups, self.group_qkv, h), gate.reshape(self.groups, 1, h)], 1)
        return torch.cat([grouped.flatten(0, 1), qkv.new_zeros(self.pad, h)], 0)

    def split_full_weight(self, w: torch.Tensor):
        """The full fused weight [tp * width, h] (TP shards concatenated) -> (qkv, gate) in global order."""
        parts = [self.split_weight(shard) for shard in w.chunk(self.tp, 0)]
        return torch.cat([p[0] for p in parts], 0), torch.cat([p[1] for p in parts], 0)


def applies(cfg, tp: int) -> bool:
    """Whether the arch's gate is fused at TP size `tp` (its module says: megatron_sat/archs/satformer.py).
    cfg: anything with SATConfig's field names."""
    return archs.get(cfg.arch).fused_gate(cfg, tp)


def padding_rows(cfg, tp: int) -> int:
    """Zero padding rows of one fused layer's weight over all TP ranks (0 when the gate is not fused)."""
    return archs.get(cfg.arch).padding_rows(cfg, tp)


def build_fused_linear(build, layout: FusedGateLayout, in_size: int, out_size: int, config, **kwargs):
    """The linear_qkv of a fused layer, built through `build` (the spec's linear class).

    The Transformer's linear is built first, so that it draws its initial values exactly as a
    Transformer's (and the same random stream continues after it); then the wider one is built
    without initialisation and takes those rows. Its gate rows are set by `init_gate_rows`.
    """
    standard = build(in_size, out_size, config=config, **kwargs)
    perform = config.perform_initialization
    config.perform_initialization = False
    try:
        fused = build(in_size, layout.width * layout.tp, config=config, **kwargs)
    finally:
        config.perform_initialization = perform
    with torch.no_grad():
        fused.weight.zero_()
        layout.grouped(fused.weight)[:, : layout.group_qkv].copy_(
            standard.weight.view(layout.groups, layout.group_qkv, -1))
    del standard
    return fused


def init_gate_rows(weight: torch.Tensor, layout: FusedGateLayout, tp_rank: int, std: float, dtype) -> None:
    """W_alpha ~ N(0, std) drawn as the separate gate draws it (all N_kv rows, on the CPU default
    generator), this rank's rows copied in: both impls start from the same values."""
    full = torch.empty(layout.groups * layout.tp, weight.shape[1], dtype=dtype)
    torch.nn.init.normal_(full, mean=0.0, std=std)
    with torch.no_grad():
        layout.grouped(weight)[:, layout.group_qkv].copy_(full[tp_rank * layout.groups:(tp_rank + 1) * layout.groups])


def sharded_factory(original, layout: FusedGateLayout, sharded_offsets):
    """linear_qkv.weight's sharded tensor -> a factory that saves (and loads) `linear_qkv.weight` in the
    Transformer's layout and `value_residual_gate.weight` [ng, h], both sharded over TP along rows."""
    # imported here: importing this module needs no Megatron (module docstring)
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    prepend = len(sharded_offsets)
    rank = original.global_offset[prepend] // original.local_shape[0]

    @torch.no_grad()
    def build(key, t, replica_id, flattened_range):
        # key: the factory's key when it is built, after the block renamed the layer to its global number
        assert key.endswith(QKV_SUFFIX), key
        gate_key = key[: -len(QKV_SUFFIX)] + GATE_SUFFIX
        if flattened_range is not None:
            raise NotImplementedError("the fused SATFormer gate cannot be saved as a flattened shard; "
                                      "use a fully reshardable checkpoint format")
        qkv, gate = layout.split_weight(t)
        return [
            ShardedTensor.from_rank_offsets(key, qkv.contiguous(), *sharded_offsets, (prepend, rank, layout.tp),
                                            replica_id=replica_id, prepend_axis_num=prepend),
            ShardedTensor.from_rank_offsets(gate_key, gate.contiguous(), *sharded_offsets,
                                            (prepend, rank, layout.tp), replica_id=replica_id,
                                            prepend_axis_num=prepend),
        ]

    def merge(loaded):
        qkv, gate = loaded
        return layout.merge_weight(qkv, gate)

    return ShardedTensorFactory(original.key, original.data, build, merge, original.replica_id,
                                flattened_range=original.flattened_range)


def unfused_weights(model, weights: dict) -> dict:
    """{name: tensor} of `model`'s parameters (at TP1) with every fused linear_qkv.weight replaced by the
    separate impl's linear_qkv.weight and value_residual_gate.weight (differentiable slices)."""
    out = dict(weights)
    for name, module in model.named_modules():
        layout = getattr(module, "fused_gate_layout", None)
        key = f"{name}.{QKV_SUFFIX}"
        if layout is not None and key in out:
            out[key], out[f"{name}.{GATE_SUFFIX}"] = layout.split_full_weight(out[key])
    return out
