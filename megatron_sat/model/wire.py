"""The pipeline's layer split and its message width, torch-free: which global layers each model chunk holds and the
channels the archs add to the [s, b, h] tensor between stages. The planner sizes memory with it and the step-time
model times the messages with it; model/v1_transport.py and model/dense_transport.py build those messages."""

from typing import List

from megatron_sat import archs


def chunk_layers(num_layers: int, chunks: int) -> List[range]:
    """Global 1-based layer numbers of each model chunk, in pipeline order (the uniform split validate asks for)."""
    bounds = [round(c * num_layers / chunks) for c in range(chunks + 1)]
    return [range(bounds[c] + 1, bounds[c + 1] + 1) for c in range(chunks)]


def wire_channels(cfg, chunks: List[range]) -> int:
    """Channels a baseline adds to the pipeline message (parallel/pipeline.py extra_wire_channels)."""
    if len(chunks) == 1:
        return 0
    # dense archs: padded to the widest boundary, before the last chunk (model/dense_transport.py)
    return archs.get(cfg.arch).wire_channels(cfg, chunks[-1][0])


def v1_wire_channels(cfg, t: int, sp: bool) -> int:
    """Channels V1 adds to the pipeline message (model/v1_transport.py wire_width; the planner counts V1's bytes
    under "V1", not as a connection)."""
    if not cfg.uses_value_residual:
        return 0
    return cfg.num_query_groups * cfg.kv_channels // t * (t if sp else 1)
