"""MUDDFormer baseline (Xiao et al. 2025): multiway dynamic dense connections.

Layer i reads four streams made from all earlier outputs X_0 (embedding) .. X_{i-1}:

    A   = X^R + Attention(Q from norm_q(X^Q), K from norm_k(X^K), V from norm_v(X^V))
    X_i = A + MLP(norm(A))
    dw [s, b, C, i+1] = W2 GELU(W1 rms(X_i)) + static         (rms without a scale)
    stream_c = post_norm_c( sum_j dw[c, j] * pre_norm_j(X_j) ) + X_i      c in (Q, K, V, R)

The last layer makes only the R stream (C = 1), which goes to the final norm. As in the authors'
configs: 4 ways, pre/post depth-aggregate norms (post weights init 1e-3, W1 ~ N(0, 1/h), W2 = 0,
static = 0) and param_realloc FFN widths (megatron_sat.archs.ffn_size).

Q, K and V are projected with slices of Megatron's fused linear_qkv weight, one GEMM per input, so
the FLOPs equal one fused QKV projection. The streams (X^Q, X^K, X^V, history) travel in Megatron's
`context` slot and across pipeline stages on the wire (megatron_sat.model.dense_transport).
Every op outside attention and MLP is per token: TP, SP and CP need only replicated weights.
"""

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_pg_rank
from torch.utils.checkpoint import checkpoint

from megatron_sat.archs import ffn_size
from megatron_sat.model import dense_transport
from megatron_sat.model.config import SATConfig
from megatron_sat.model.denseformer import weighted_sum


class MultiInputSelfAttention(SelfAttention):
    """SelfAttention whose K and V come from other inputs than Q (`kv_inputs`, set by the layer)."""

    kv_inputs = None

    def _column_input(self, x):
        """What ColumnParallelLinear does to its input: gather the sequence (SP) or copy (no SP)."""
        if self.config.sequence_parallel:
            return gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
        return copy_to_tensor_model_parallel_region(x, group=self.pg_collection.tp)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        if self.kv_inputs is None:
            raise RuntimeError("MultiInputSelfAttention needs kv_inputs (set by MUDDFormerLayer)")
        xk, xv = self.kv_inputs
        ng, hn = self.num_query_groups_per_partition, self.hidden_size_per_attention_head
        per_group = self.num_attention_heads_per_partition // ng
        w = self.linear_qkv.weight.view(ng, per_group + 2, hn, -1)  # Megatron's layout: per group [q..., k, v]
        h = w.shape[-1]
        q = F.linear(self._column_input(hidden_states), w[:, :per_group].reshape(-1, h))  # [s, b, np/tp * hn]
        k = F.linear(self._column_input(xk), w[:, per_group].reshape(-1, h))  # [s, b, ng/tp * hn]
        v = F.linear(self._column_input(xv), w[:, per_group + 1].reshape(-1, h))
        s, b = q.shape[:2]
        q, k, v = q.view(s, b, -1, hn), k.view(s, b, ng, hn), v.view(s, b, ng, hn)
        if self.q_layernorm is not None:
            q = self.q_layernorm(q)
        if self.k_layernorm is not None:
            k = self.k_layernorm(k)
        return q, k, v


def rms_no_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class DepthAggregate(torch.nn.Module):
    """Makes the next layer's C input streams from X_0..X_i, with weights that depend on X_i."""

    def __init__(self, config: SATConfig, norm_builder, layer_number: int):
        super().__init__()
        h, k = config.hidden_size, layer_number + 1  # k earlier outputs: X_0..X_i
        self.ways = 1 if layer_number == config.num_layers else 4
        self.eps = config.layernorm_epsilon
        dtype = config.params_dtype
        self.w1 = torch.nn.Parameter(torch.empty(self.ways * k, h, dtype=dtype))
        torch.nn.init.normal_(self.w1, mean=0.0, std=1.0 / h)
        self.w2 = torch.nn.Parameter(torch.zeros(self.ways * k, self.ways * k, dtype=dtype))
        self.static_weight = torch.nn.Parameter(torch.zeros(self.ways, k, dtype=dtype))
        make_norm = lambda: norm_builder(config=config, hidden_size=h, eps=config.layernorm_epsilon)  # noqa: E731
        self.pre_norms = torch.nn.ModuleList([make_norm() for _ in range(k)])
        self.post_norms = torch.nn.ModuleList([make_norm() for _ in range(self.ways)])
        with torch.no_grad():
            for norm in self.post_norms:
                norm.weight.fill_(1e-3)
        if config.sequence_parallel:
            for p in (self.w1, self.w2, self.static_weight):
                p.sequence_parallel = True

    def forward(self, history):
        x = history[-1]  # X_i [s, b, h]
        s, b = x.shape[:2]
        dw = F.linear(F.gelu(F.linear(rms_no_scale(x, self.eps), self.w1)), self.w2)  # [s, b, C*k]
        dw = dw.view(s, b, self.ways, -1) + self.static_weight  # [s, b, C, k]
        # The pre-normed copies of X_0..X_i would be kept for backward: k new [s, b, h] tensors in every layer,
        # O(L^2) per stage. They are recomputed in backward instead (torch's non-reentrant checkpoint keeps only
        # the inputs, references to tensors the history holds anyway), for one more pass of k norms.
        sums = checkpoint(self._weighted_sums, dw, *history, use_reentrant=False)
        return [self.post_norms[c](sums[c]) + x for c in range(self.ways)]

    def _weighted_sums(self, dw, *history):
        normed = [norm(xj) for norm, xj in zip(self.pre_norms, history)]
        return tuple(weighted_sum(dw[:, :, c], normed) for c in range(self.ways))  # C x [s, b, h]


class MUDDFormerLayer(TransformerLayer):
    """A Megatron TransformerLayer with separate Q/K/V/residual inputs and a depth aggregate."""

    emits_carry = False  # set on the last layer of a non-final pipeline chunk by the model

    def __init__(self, config: SATConfig, submodules, layer_number: int = 1, *args, vp_stage=None,
                 pg_collection=None, **kwargs):
        pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        number = layer_number + get_transformer_layer_offset(config, vp_stage, get_pg_rank(pg_collection.pp))
        layer_config = dataclasses.replace(config, ffn_hidden_size=ffn_size(config, number))
        super().__init__(layer_config, submodules, layer_number, *args, vp_stage=vp_stage,
                         pg_collection=pg_collection, **kwargs)
        assert self.layer_number == number
        eps = config.layernorm_epsilon
        self.key_input_layernorm = submodules.norm(config=config, hidden_size=config.hidden_size, eps=eps)
        self.value_input_layernorm = submodules.norm(config=config, hidden_size=config.hidden_size, eps=eps)
        self.depth_aggregate = DepthAggregate(config, submodules.norm, self.layer_number)

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, **kwargs):
        xr = hidden_states
        if context is None:  # layer 1: every stream is the embedding X_0
            xq = xk = xv = hidden_states
            history = (hidden_states,)
        else:
            xq, xk, xv, history = context
        attention = self.self_attention
        attention.kv_inputs = (self.key_input_layernorm(xk), self.value_input_layernorm(xv))
        try:
            out, bias = attention(
                self.input_layernorm(xq), attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin, attention_bias=attention_bias,
                inference_context=inference_context, packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
            )
        finally:
            attention.kv_inputs = None  # never keep a graph alive between steps
        hidden = xr + (out if bias is None else out + bias)
        out, bias = self.mlp(self.pre_mlp_layernorm(hidden))
        hidden = hidden + (out if bias is None else out + bias)  # X_i [s, b, h]
        history = history + (hidden,)
        if len(history) != self.layer_number + 1:
            raise RuntimeError(f"layer {self.layer_number} received {len(history) - 1} earlier outputs")
        streams = self.depth_aggregate(history)
        if self.layer_number == self.config.num_layers:
            return streams[0], None  # the R stream, to the final norm
        xq, xk, xv, xr = streams
        carry = (xq, xk, xv, history)
        if self.emits_carry:
            xr = dense_transport.pack(xr, (xq, xk, xv) + history, dense_transport.wire_width(self.config))
        return xr, carry
