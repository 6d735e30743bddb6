"""DenseFormer baseline (Pagliardini et al. 2024): a depth-weighted average after every block.

With X_0 the embedding and X_i the output of block i (a plain pre-norm Megatron layer),

    Y_i = sum_{j=0..i} w_i[j] X_j          w_i init to (0, ..., 0, 1): identity at start
    X_{i+1} = Block_{i+1}(Y_i)

(the authors' configs use dilation 1 and period 1, the only setting built here).

The history (X_0, ..., X_i) travels from layer to layer as a tuple in Megatron's `context` slot
and across pipeline stages appended to the hidden state (megatron_sat.model.dense_transport).
The weighted sum is a loop of scaled adds, so autograd keeps one reference to each X_j rather than
a stacked copy per layer: activation memory grows with L, not L^2.
"""

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_sat.model import dense_transport
from megatron_sat.model.config import SATConfig


def weighted_sum(weights, tensors):
    """sum_j weights[..., j] * tensors[j], without stacking the tensors (no copy to keep).

    weights [k] or [s, b, k] (per token); tensors: k tensors [s, b, h].
    """
    out = weights[..., 0, None] * tensors[0]
    for j in range(1, len(tensors)):
        out = out + weights[..., j, None] * tensors[j]
    return out


class DenseFormerLayer(TransformerLayer):
    """Megatron's TransformerLayer followed by the depth-weighted average over all earlier outputs."""

    emits_carry = False  # set on the last layer of a non-final pipeline chunk by the model

    def __init__(self, config: SATConfig, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        weights = torch.zeros(self.layer_number + 1, dtype=config.params_dtype)  # over X_0..X_i
        weights[-1] = 1.0
        self.dwa_weights = torch.nn.Parameter(weights)
        if config.sequence_parallel:
            self.dwa_weights.sequence_parallel = True

    def forward(self, hidden_states, *args, context=None, **kwargs):
        history = (hidden_states,) if context is None else context  # layer 1 starts from X_0
        out, _ = super().forward(hidden_states, *args, context=None, **kwargs)
        history = history + (out,)
        if len(history) != self.layer_number + 1:
            raise RuntimeError(f"layer {self.layer_number} received {len(history) - 1} earlier outputs")
        y = weighted_sum(self.dwa_weights, history)  # [s, b, h]
        if self.emits_carry:
            y = dense_transport.pack(y, history, dense_transport.wire_width(self.config))
        return y, history
