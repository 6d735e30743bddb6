"""Carrying V1 across pipeline-stage boundaries, forward and backward.

Megatron's pipeline schedules send exactly one tensor between stages, shaped
[s/cp (/tp with SP), mbs, hidden]. Value-residual models append V1 to it along the last dim:

    wire = [hidden | V1]        [s', b, h + W]

so the schedules, their overlap and their deallocation keep working, V1's gradient rides back on
the same message, and no extra collective is issued. Within a stage V1 travels between layers
through Megatron's `context` slot of TransformerLayer (see megatron_sat.model.layer).

V1 is [s, b, ng/tp, hn] on every TP rank (KV heads split over TP, whole sequence). With sequence
parallelism the hidden part is a sequence shard [s/tp, b, h], so V1 is laid out as
[s/tp, b, tp * ng/tp * hn]: the same elements in another order, no communication.

Nothing here is in Megatron-Core: it has no notion of a second activation crossing stages. The
P2PCommunicator subclass widens the one shape it is told to expect (`_communicate` is where every
send and receive of both the 1F1B and the interleaved schedule goes through).
"""

from typing import Tuple

import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator


def wire_width(config, tp_size: int) -> int:
    """Extra channels that V1 adds to the pipeline message (0 without a value residual)."""
    if not getattr(config, "uses_value_residual", False):
        return 0
    local = config.v1_channels // tp_size
    return local * tp_size if config.sequence_parallel else local


def pack(hidden: torch.Tensor, v1: torch.Tensor, sequence_parallel: bool, tp_size: int) -> torch.Tensor:
    """[s', b, h] and V1 [s, b, g, hn] -> the stage output [s', b, h + W]."""
    s, b = v1.shape[:2]
    v1 = v1.reshape(s, b, -1)  # [s, b, g*hn]
    if sequence_parallel and tp_size > 1:
        v1 = v1.view(tp_size, s // tp_size, b, -1).permute(1, 2, 0, 3).reshape(s // tp_size, b, -1)
    return torch.cat([hidden, v1], dim=-1)  # [s', b, h + W]


def unpack(
    wire: torch.Tensor, hidden_size: int, kv_channels: int, sequence_parallel: bool, tp_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack`: [s', b, h + W] -> hidden [s', b, h], V1 [s, b, g, hn]."""
    hidden, v1 = wire[..., :hidden_size], wire[..., hidden_size:]
    s_local, b = wire.shape[:2]
    if sequence_parallel and tp_size > 1:
        v1 = v1.reshape(s_local, b, tp_size, -1).permute(2, 0, 1, 3).reshape(s_local * tp_size, b, -1)
    v1 = v1.reshape(v1.shape[0], b, -1, kv_channels)  # [s, b, g, hn]
    return hidden, v1


class WideP2PCommunicator(P2PCommunicator):
    """P2PCommunicator whose messages are `extra` channels wider than the schedule asks for."""

    def __init__(self, pp_group, config, extra: int):
        super().__init__(pp_group=pp_group, config=config)
        self.extra = extra

    def _communicate(self, *, tensor_shape, **kwargs):
        if tensor_shape is not None and self.extra:
            tensor_shape = (*tensor_shape[:-1], tensor_shape[-1] + self.extra)
        return super()._communicate(tensor_shape=tensor_shape, **kwargs)
