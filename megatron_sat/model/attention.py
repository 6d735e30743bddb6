"""Self-attention that mixes layer 1's values (V1) into its own, for SATFormer and ResFormer.

A subclass of Megatron's SelfAttention that only touches `get_query_key_value_tensors`: after
Megatron has split Q, K and V (and applied QK-norm to Q and K only), it

    layer 1:           keeps V as V1 for later layers,                     V1 [s, b, ng/tp, hn]
    SATFormer n > 1:   V' = V + alpha * V1, alpha = gate(x @ W_alpha)      alpha [s, b, ng/tp]
    ResFormer n > 1:   V' = lambda1[n] * V1 + lambda2[n] * V

and hands V' to RoPE-free core attention (V never gets RoPE), so the KV cache would hold V'.
x is the attention's input, i.e. the normalised hidden state that feeds linear_qkv.

The SATFormer gate has two implementations (config.value_residual_gate_impl):
    fused      W_alpha's rows live in linear_qkv's weight, one per KV group (megatron_sat.model.fused_gate):
               one GEMM gives Q, K, V and the gate logits; the mix runs as one kernel on GPU
               (megatron_sat.model.value_mix). The default.
    separate   ValueResidualGate below: its own GEMM on x, exchanged over TP; eager mix.
Checkpoints store the same tensors for both (fused_gate.sharded_factory).

V1 arrives through `self.v1` (set by ValueResidualTransformerLayer around each call) because
Megatron's attention forward has no argument for it; layer 1 leaves its V there for the layer.
"""

import dataclasses
from typing import Optional

import torch
from megatron.core.tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    all_to_all_sp2hp,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention

from megatron_sat import archs
from megatron_sat.model import fused_gate
from megatron_sat.model.config import SATConfig, gate_function
from megatron_sat.model.value_mix import mix_eager, mix_fused


class ValueResidualGate(torch.nn.Module):
    """alpha = gate(x @ W_alpha^T): one scalar per token and KV head, W_alpha [N_kv, h], no bias.

    Tensor and sequence parallelism: W_alpha is small (h x N_kv) and replicated on every TP rank.
    The gate runs on the x this rank already has and exchanges only N_kv scalars per token:
      * SP on:  x is the local sequence shard [s/tp, b, h]; alpha for all heads [s/tp, b, N_kv] is
        turned into the local heads of the whole sequence [s, b, N_kv/tp] by one all-to-all. The
        weight's gradient is a partial sum over the shard, so it is flagged `sequence_parallel`
        and Megatron all-reduces it over TP like the norms' weights.
      * SP off: x is the full sequence on every rank; alpha is computed for all heads and the local
        heads are kept; the backward all-gathers the N_kv-wide gradient, so dL/dx and dL/dW are
        complete and identical on every rank (no extra all-reduce of the hidden state).
    Gathering x (an [s, b, h] all-gather per layer) would cost h / N_kv times more traffic.
    """

    def __init__(self, config: SATConfig, tp_group):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.fn = gate_function(config.value_residual_gate)
        self.weight = torch.nn.Parameter(
            torch.empty(config.num_query_groups, config.hidden_size, dtype=config.params_dtype)
        )
        if config.perform_initialization:
            torch.nn.init.normal_(self.weight, mean=0.0, std=config.value_residual_gate_init_std)
        if config.sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        alpha = self.fn(torch.nn.functional.linear(x, self.weight))  # [s', b, N_kv]
        tp = self.tp_group.size()
        if tp == 1:
            return alpha
        if self.config.sequence_parallel:
            b = alpha.shape[1]
            return all_to_all_sp2hp(alpha, group=self.tp_group).view(seq_len, b, -1)  # [s, b, N_kv/tp]
        return scatter_to_tensor_model_parallel_region(alpha, group=self.tp_group)  # [s, b, N_kv/tp]


class ValueResidualSelfAttention(SelfAttention):
    """SelfAttention that produces (layer 1) or mixes (later layers) the value residual V1."""

    def __init__(self, config: SATConfig, submodules, layer_number: int, *args, **kwargs):
        mixes_v1 = layer_number in config.mixing_layers
        gated = mixes_v1 and archs.get(config.arch).gated  # a SATFormer gate (its module: megatron_sat/archs/)
        fused = gated and config.fused_value_residual_gate
        if fused:  # linear_qkv is built wider, with the gate rows (megatron_sat.model.fused_gate)
            build = submodules.linear_qkv

            def build_fused(in_size, out_size, **kw):
                layout = fused_gate.FusedGateLayout.from_config(config, kw["tp_group"].size())
                return fused_gate.build_fused_linear(build, layout, in_size, out_size, **kw)

            submodules = dataclasses.replace(submodules, linear_qkv=build_fused)
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.produces_v1 = layer_number == 1
        self.mixes_v1 = mixes_v1
        self.gated = gated  # has a SATFormer gate (telemetry)
        self.v1: Optional[torch.Tensor] = None  # set by the layer around each forward
        self.last_alpha: Optional[torch.Tensor] = None  # detached gate of the last forward (telemetry)
        self.lambda1_fn = None  # ResFormer learned mode: set by the model (lambda1 is shared)
        self.fused_gate_layout = None  # this layer's gate rows in linear_qkv (fused impl)
        if fused:
            tp = self.pg_collection.tp
            self.fused_gate_layout = fused_gate.FusedGateLayout.from_config(config, tp.size())
            self.linear_qkv_out_dim = self.fused_gate_layout.width * tp.size()
            if config.perform_initialization:
                fused_gate.init_gate_rows(self.linear_qkv.weight, self.fused_gate_layout, tp.rank(),
                                          config.value_residual_gate_init_std, config.params_dtype)
            self.gate_fn = gate_function(config.value_residual_gate)
        elif self.gated:
            self.value_residual_gate = ValueResidualGate(config, self.pg_collection.tp)
        if self.mixes_v1 and archs.get(config.arch).learned_lambdas(config):
            self.value_residual_lambda2 = torch.nn.Parameter(
                torch.full((1,), 0.5, dtype=config.params_dtype)
            )
            self.value_residual_lambda2.tp_partial_grad = True  # summed over TP (parallel/grads.py)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        if self.fused_gate_layout is not None:
            return self._fused_query_key_value(hidden_states, output_gate, split_qkv)
        query, key, value = super().get_query_key_value_tensors(
            hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv
        )  # q [s, b, np/tp, hn]; k, v [s, b, ng/tp, hn]
        if self.produces_v1:
            self.v1 = value
        elif self.mixes_v1:
            value = self._mix(value, hidden_states)
        return query, key, value

    def _fused_query_key_value(self, hidden_states, output_gate, split_qkv):
        """Megatron's split of the fused projection (ng divisible by TP), plus the gate logits."""
        if output_gate or not split_qkv:
            raise RuntimeError("the fused SATFormer gate needs split Q, K, V and no attention output gate")
        layout = self.fused_gate_layout
        mixed, _ = self.linear_qkv(hidden_states)  # [s, b, width]
        query, key, value, logits = layout.split_output(mixed)  # k, v [s, b, ng/tp, hn]; logits [s, b, ng/tp]
        query = query.reshape(query.size(0), query.size(1), -1, self.hidden_size_per_attention_head)  # [s, b, np/tp, hn]
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        alpha = self._gate_values(logits)  # [s, b, ng/tp]
        self.last_alpha = alpha.detach()
        return query, key, mix_fused(value, alpha, self._v1())

    def _gate_values(self, logits: torch.Tensor) -> torch.Tensor:
        """alpha from this rank's logits [s, b, ng/tp]; the softmax gates normalise over all KV heads,
        so under TP they gather the N_kv logits of a token (its backward reduce-scatters)."""
        tp = self.pg_collection.tp
        if tp.size() == 1 or self.config.value_residual_gate not in ("softmax", "softmax_sigmoid"):
            return self.gate_fn(logits)
        full = all_gather_last_dim_from_tensor_parallel_region(logits, group=tp)  # [s, b, ng]
        n = logits.shape[-1]
        return self.gate_fn(full)[..., tp.rank() * n:(tp.rank() + 1) * n]

    def _v1(self) -> torch.Tensor:
        if self.v1 is None:
            raise RuntimeError(
                f"layer {self.layer_number} mixes V1 but none reached it: the model must pass V1 "
                "between layers and pipeline stages (use megatron_sat.model.gpt.build_model and "
                "megatron_sat.parallel.pipeline.forward_backward)"
            )
        return self.v1

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron's, with a fused linear_qkv.weight saved as the Transformer's weight plus the gate's."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.fused_gate_layout is not None:
            key = f"{prefix}linear_qkv.weight"
            sd[key] = fused_gate.sharded_factory(sd[key], self.fused_gate_layout, sharded_offsets)
        return sd

    def _mix(self, value: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        v1 = self._v1()
        if self.gated:
            alpha = self.value_residual_gate(x, seq_len=value.shape[0])  # [s, b, ng/tp]
            self.last_alpha = alpha.detach()
            return mix_eager(value, alpha, v1)  # [s, b, ng/tp, hn]
        if self.config.resformer_lambdas == "fixed":
            return 0.5 * v1 + 0.5 * value
        return self.lambda1_fn(self.layer_number) * v1 + self.value_residual_lambda2 * value
