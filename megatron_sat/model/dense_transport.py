"""Carrying DenseFormer's and MUDDFormer's layer history across pipeline-stage boundaries.

A densely connected layer reads every earlier output X_0..X_{i-1} (and, for MUDDFormer, the next
layer's Q, K and V input streams), so a stage boundary must carry all of them. As with V1
(megatron_sat.model.v1_transport) they are appended to the one tensor Megatron's schedules send:

    wire = [hidden | streams... | X_0 | ... | X_{f-1} | zero padding]      [s', b, W]

where f is the first global layer of the receiving chunk. Megatron's schedules expect one shape
for every message of a run, so the wire is padded to the widest boundary (the one before the last
model chunk). Megatron's `variable_seq_lengths` would send exact shapes but adds a blocking shape
exchange to every message; the padding costs bandwidth only, and only with PP.

Every tensor here is [s', b, h] in the same (sequence-parallel or not) layout, so packing is a
concatenation along the channel dim with no communication. Nothing here is in Megatron-Core.
"""

from typing import Sequence, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_sat import archs


def stream_count(config) -> int:
    """Input streams besides the residual one that a dense arch hands to the next layer."""
    return archs.get(config.arch).stream_count


def wire_width(config) -> int:
    """Extra channels on the pipeline message: streams plus the history before the last chunk."""
    if not getattr(config, "is_dense", False):
        return 0
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if pp == 1:
        return 0
    last_first_layer = 1 + get_transformer_layer_offset(config, vp - 1 if vp else None, pp - 1)
    return archs.get(config.arch).wire_channels(config, last_first_layer)


def pack(hidden: torch.Tensor, tensors: Sequence[torch.Tensor], width: int = None) -> torch.Tensor:
    """hidden [s', b, h] and tensors, each [s', b, h] -> the padded wire [s', b, h + width]."""
    parts = [hidden, *tensors]
    if width is None:
        width = hidden.shape[-1] * (len(parts) - 1)
    pad = width - hidden.shape[-1] * (len(parts) - 1)
    if pad < 0:
        raise RuntimeError(f"dense history needs {-pad} more wire channels than the {width} reserved")
    if pad:
        parts.append(hidden.new_zeros(*hidden.shape[:-1], pad))
    return torch.cat(parts, dim=-1)  # [s', b, h + width]


def unpack(wire: torch.Tensor, config, first_layer: int) -> Tuple[torch.Tensor, tuple]:
    """Inverse of `pack` for a chunk whose first global layer is first_layer.

    Returns hidden [s', b, h] and the carry the chunk's first layer expects as `context`:
    the history (X_0..X_{f-1}) for DenseFormer, (X^Q, X^K, X^V, history) for MUDDFormer.
    """
    h, streams = config.hidden_size, stream_count(config)
    parts = wire[..., : h * (1 + streams + first_layer)].split(h, dim=-1)
    hidden, rest = parts[0], parts[1:]
    history = tuple(rest[streams:])
    if streams:
        return hidden, (*rest[:streams], history)
    return hidden, history
