"""TransformerLayer that threads V1 from layer to layer through Megatron's `context` slot.

Megatron's TransformerBlock already passes `context` from each layer's output to the next
layer's input, in its plain loop and inside full activation recompute (where it is a real input
and output of the checkpointed function, so V1's gradient is recomputed correctly). GPT layers
have no cross-attention, so the slot is free: this layer hands the incoming V1 to its attention,
returns layer 1's V as the new context, and passes any other V1 through unchanged.

The last layer of a stage that is not the last pipeline stage appends V1 to its output
(`emits_carry`), so the schedule sends both to the next stage (megatron_sat.model.v1_transport).
"""

from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_sat.model import v1_transport


class ValueResidualTransformerLayer(TransformerLayer):
    """A Megatron TransformerLayer whose `context` in and out is V1 [s, b, ng/tp, hn]."""

    emits_carry = False  # set on the last layer of a non-final pipeline chunk by the model

    def forward(self, *args, context=None, **kwargs):
        attention = self.self_attention
        attention.v1 = context
        try:
            hidden_states, _ = super().forward(*args, context=None, **kwargs)
            v1 = attention.v1
        finally:
            attention.v1 = None  # never keep a graph alive between steps
        if v1 is None:
            raise RuntimeError(f"layer {self.layer_number}: V1 is missing (layer 1 must come first)")
        if self.emits_carry:
            tp = self.pg_collection.tp.size()
            hidden_states = v1_transport.pack(hidden_states, v1, self.config.sequence_parallel, tp)
        return hidden_states, v1
