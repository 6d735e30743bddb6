"""The GPT model for every arch, and `build_model` that makes this rank's pipeline chunks.

CarryGPTModel is Megatron's GPTModel plus a second activation that layers pass to each other
through Megatron's `context` slot and that must cross pipeline-stage boundaries:
    resformer, satformer      V1                                   (model/v1_transport.py)
    denseformer, muddformer   all earlier layer outputs (+ streams) (model/dense_transport.py)
  * input:  the received [hidden | carry] message is split in `set_input_tensor`; the carry
            enters the decoder as the first layer's `context`;
  * output: the chunk's last layer appends the carry to the hidden state (unless last stage).
Hyper-Connections needs no second activation (its n streams are the hidden state, n*h wide) and
the Transformer is Megatron's GPTModel.
ResFormer's learned lambda1 = s * softmax(logits) spans all layers after the first, so (logits, s) live in a small
module replicated on every chunk; megatron_sat.parallel.grads sums their gradients over chunks and
pipeline stages so that all replicas stay identical.
"""

from typing import List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule

from megatron_sat import archs, compat
from megatron_sat.model import dense_transport, v1_transport
from megatron_sat.model.config import SATConfig
from megatron_sat.model.rope import scale_rotary
from megatron_sat.model.specs import layer_spec


class ResFormerLambdas(MegatronModule):
    """lambda1[n] = s * softmax(logits)[n - 2] for layers n = 2..L; a replica on every model chunk.

    As the SATFormer authors' model: L - 1 logits (init 0) and s init to L. With value_residual_last_k only the
    last k layers mix V1, but the softmax still runs over all L - 1 logits, so those of the other layers
    keep a share of the weight (and a gradient).
    """

    def __init__(self, config: SATConfig, primary: bool):
        super().__init__(config=config)
        L = config.num_layers
        self.logits = torch.nn.Parameter(torch.zeros(L - 1, dtype=config.params_dtype))
        self.scale = torch.nn.Parameter(torch.full((1,), float(L), dtype=config.params_dtype))
        for p in (self.logits, self.scale):
            p.pipeline_replicated = True  # gradients summed over all chunks (parallel/grads.py)
            p.tp_partial_grad = True  # each TP rank sees only its KV heads (parallel/grads.py)
            p.shared = not primary  # counted once in the gradient norm, like tied embeddings

    def lambda1(self, layer_number: int) -> torch.Tensor:
        return self.scale * torch.softmax(self.logits, dim=0)[layer_number - 2]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        replica = (int(self.logits.shared), parallel_state.get_tensor_model_parallel_rank(),
                   parallel_state.get_data_parallel_rank(with_context_parallel=True))
        return {
            f"{prefix}{name}": ShardedTensor.from_rank_offsets(f"{prefix}{name}", p, replica_id=replica)
            for name, p in (("logits", self.logits), ("scale", self.scale))
        }


class CarryGPTModel(GPTModel):
    """GPTModel whose pipeline messages carry V1 or the dense history next to the hidden state."""

    def __init__(self, config: SATConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self._carry_input = None
        layers = self.decoder.layers
        if not self.post_process and len(layers) > 0:
            layers[-1].emits_carry = True
        if archs.get(config.arch).learned_lambdas(config):
            self.value_residual_lambdas = ResFormerLambdas(config, primary=self.pre_process)
            for layer in layers:
                if layer.self_attention.mixes_v1:
                    layer.self_attention.lambda1_fn = self.value_residual_lambdas.lambda1

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, list):
            assert len(input_tensor) == 1, "a GPT stage receives one tensor"
            input_tensor = input_tensor[0]
        if input_tensor is None:
            self._carry_input = None
            self.decoder.set_input_tensor(None)
            return
        if self.config.is_dense:
            first_layer = self.decoder.layers[0].layer_number
            hidden, self._carry_input = dense_transport.unpack(input_tensor, self.config, first_layer)
        else:
            tp = self.pg_collection.tp.size()
            hidden, self._carry_input = v1_transport.unpack(
                input_tensor, self.config.hidden_size, self.config.kv_channels, self.config.sequence_parallel, tp
            )
        self.decoder.set_input_tensor(hidden)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        # Layers differ (layer 1 has no gate; dense layers grow with depth): checkpoint them one key per layer
        # (global layer numbers, still independent of the layout) instead of one stacked tensor.
        metadata = dict(metadata or {}, non_homogeneous_layers=True)
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)

    def forward(self, *args, extra_block_kwargs=None, **kwargs):
        if not self.pre_process:
            extra_block_kwargs = dict(extra_block_kwargs or {}, context=self._carry_input)
        return super().forward(*args, extra_block_kwargs=extra_block_kwargs, **kwargs)


def build_model(
    config: SATConfig,
    vocab_size: int,
    max_sequence_length: int,
    backend: Optional[str] = None,
    rotary_base: int = 10000,
    share_embeddings_and_output_weights: bool = True,
) -> List[GPTModel]:
    """This rank's model chunks (one, or one per virtual stage), on the current device.

    parallel_state must be initialised (megatron_sat.parallel.layout.initialize).
    """
    cls = CarryGPTModel if config.uses_value_residual or config.is_dense else GPTModel
    spec = layer_spec(config, backend)
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    stages = range(vp) if vp else [None]
    chunks = []
    for vp_stage in stages:
        model = cls(
            config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type="rope",
            rotary_base=rotary_base,
            vp_stage=vp_stage,
        )
        scale_rotary(model, config)  # Llama 3.1+ RoPE scaling, all four of its values (model/rope.py)
        chunks.append(model.to(compat.device()))
    return chunks
