"""One forward-backward step over this rank's model chunks, with V1 on the pipeline wire.

`forward_backward` is Megatron's get_forward_backward_func() (no pipelining, 1F1B, or interleaved
1F1B, as parallel_state dictates), given a P2PCommunicator whose messages are wide enough for what
the arch carries across stages besides the hidden state:
    resformer, satformer      V1                          (megatron_sat.model.v1_transport)
    denseformer, muddformer   streams and layer history   (megatron_sat.model.dense_transport)
    hyperconnections          the other n-1 residual streams (the hidden state is [s', b, n*h])
"""

import itertools

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_sat import archs
from megatron_sat.model import dense_transport, v1_transport
from megatron_sat.model.v1_transport import WideP2PCommunicator


def _process_groups() -> ProcessGroupCollection:
    return ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["tp", "cp", "pp", "embd", "pos_embd", "dp", "dp_cp", "tp_dp_cp"]
    )


def extra_wire_channels(config, tp_size: int) -> int:
    """Channels the arch adds to Megatron's [s', b, h] pipeline message."""
    if config.is_dense:  # the history, padded to the widest boundary
        return dense_transport.wire_width(config)
    # the arch's own channels (Hyper-Connections' other streams), V1 of a value-residual arch
    return archs.get(config.arch).wire_channels(config, 0) + v1_transport.wire_width(config, tp_size)


def forward_backward(model, config, *, forward_step_func, data_iterator, num_microbatches,
                     seq_length, micro_batch_size, forward_only=False):
    """Run one step's forward (and backward) passes; returns Megatron's list of loss dicts."""
    chunks = model if isinstance(model, list) else [model]
    kwargs = {}
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        groups = _process_groups()
        kwargs = dict(
            p2p_communicator=WideP2PCommunicator(groups.pp, config, extra_wire_channels(config, groups.tp.size())),
            pg_collection=groups,
        )
    if len(chunks) > 1 and not isinstance(data_iterator, list):
        # every virtual stage reads the same micro-batches, each through its own iterator
        data_iterator = list(itertools.tee(data_iterator, len(chunks)))
    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        **kwargs,
    )
