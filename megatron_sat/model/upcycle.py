"""Starting an arch from a Transformer's weights (upcycling): every tensor the Transformer has is its, the arch's own
parameters (Arch.own_fields: SATFormer's W_alpha, ResFormer's lambdas) start as Arch.upcycle_start says.

Two routes use it: the trainer's `--pretrained-checkpoint RUN --arch satformer` of a Transformer run (load_filter
drops the own tensors from what is read, fill sets them at any layout) and the HF import's `--arch`
(conversion/importer.py: full_starts). A drawn start ('normal', std) comes from a generator seeded by the seed and
the tensor's global name (its layer's global number), drawn whole and sliced: the same values at every TP/PP
layout and on every rank.
"""

import dataclasses
import re
import zlib

import torch

GATE_STD = 1e-4  # --upcycle-gate-std's default (docs/training.md: how far this start is from the Transformer)


def generator(name: str, seed: int) -> torch.Generator:
    """A CPU generator seeded by `seed` and the tensor's global name (crc32: the same in every process)."""
    return torch.Generator().manual_seed(int(seed) * 2 ** 32 + zlib.crc32(name.encode()))


def start_tensor(arch, name: str, shape, std: float, seed: int) -> torch.Tensor:
    """Own parameter `name`'s start (float32, CPU), full size."""
    how, value = arch.upcycle_start(name, std)
    if how == "constant":
        return torch.full(tuple(shape), float(value))
    if how == "normal":
        out = torch.zeros(tuple(shape))
        if value > 0:
            out.normal_(0.0, float(value), generator=generator(name, seed))
        return out
    raise ValueError(f"arch {arch.name!r}: unknown start {how!r} of {name}")


def is_own(name: str, own: tuple) -> bool:
    return bool(own) and name.endswith(own)


def full_starts(arch, model, shapes: dict, present, std: float, seed: int) -> dict:
    """{name: start} of every own tensor of `shapes` ({Megatron name: full shape}) not in `present`."""
    own = arch.own_fields(model)
    return {name: start_tensor(arch, name, shape, std, seed) for name, shape in shapes.items()
            if name not in present and is_own(name, own)}


# ---- the trainer's route: a Transformer checkpoint into the built (sharded) model -----------------------------
# The Transformer saves each tensor of its layers stacked over them ('decoder.layers.X' [L, ...]); the archs that
# grow from it save one key per layer ('decoder.layers.N.X': model/gpt.py, their layers differ). Reading one from the
# other, a per-layer tensor is read as layer N's slice of the stacked one.

_LAYER = re.compile(r"^(.*decoder\.layers\.)(\d+)\.(.+)$")


def _from_saved(tensor, saved: dict):
    """A ShardedTensor of the model as the checkpoint holds it (saved: {key: its ShardedTensor metadata})."""
    match = _LAYER.match(tensor.key)
    if tensor.key in saved or not match or match.group(1) + match.group(3) not in saved:
        return tensor
    layers = saved[match.group(1) + match.group(3)].global_shape[0]
    return dataclasses.replace(tensor, key=match.group(1) + match.group(3),
                               global_shape=(layers,) + tuple(tensor.global_shape),
                               global_offset=(int(match.group(2)),) + tuple(tensor.global_offset),
                               axis_fragmentations=(layers,) + tuple(tensor.axis_fragmentations),
                               prepend_axis_num=tensor.prepend_axis_num + 1)


def _factory_from_saved(factory, own: tuple, saved: dict):
    """A ShardedTensorFactory whose built tensors leave out the own ones and are read as the checkpoint holds them;
    its merge puts the model's current values in the own ones' place (fill sets them after the load)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    dropped = {}

    def build(key, data, replica_id, flattened_range):
        built = factory.build_fn(key, data, replica_id, flattened_range)
        if isinstance(built, ShardedTensor):
            return _from_saved(built, saved)
        if not isinstance(built, list):
            return built
        dropped.clear()
        # a copy: the built tensor may be a view made under no_grad (the fused gate's rows at TP > 1)
        dropped.update({i: t.data.detach().clone() for i, t in enumerate(built)
                        if isinstance(t, ShardedTensor) and is_own(t.key, own)})
        return [_from_saved(t, saved) if isinstance(t, ShardedTensor) else t
                for i, t in enumerate(built) if i not in dropped]

    def merge(loaded):
        if not dropped:
            return factory.merge_fn(loaded)
        kept = iter(loaded)
        return factory.merge_fn([dropped[i] if i in dropped else next(kept) for i in range(len(loaded) + len(dropped))])

    return dataclasses.replace(factory, build_fn=build, merge_fn=merge)


def load_filter(sharded: dict, own: tuple, saved: dict) -> dict:
    """A model's sharded state dict as a Transformer checkpoint can fill it: without the arch's own tensors (the
    checkpoint has none), without extra state (Transformer Engine's FP8 scales: they start afresh), each per-layer
    tensor read from the stacked one where the checkpoint stacks it. saved: the checkpoint's tensors' metadata
    (dist_checkpointing.load_tensors_metadata)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    out = {}
    for key, value in sharded.items():
        if isinstance(value, dict):
            value = load_filter(value, own, saved)
        elif isinstance(value, ShardedTensor):
            if is_own(value.key, own):
                continue
            value = _from_saved(value, saved)
        elif isinstance(value, ShardedObject) and value.key.endswith("_extra_state"):
            continue
        elif isinstance(value, ShardedTensorFactory):
            value = _factory_from_saved(value, own, saved)
        out[key] = value
    return out


def _global_name(model, name: str) -> str:
    """A chunk's parameter name with its layer's global number (decoder.layers.{i} is local to a PP stage)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


@torch.no_grad()
def fill(models, arch, model_args, std: float, seed: int) -> int:
    """Set every own parameter of the built `models` (GPTModels, unwrapped) to its start; returns how many tensors
    were set. A fused SATFormer gate (rows of linear_qkv, model/fused_gate.py) gets this TP rank's rows of the
    full W_alpha; a replicated parameter the whole tensor."""
    own = arch.own_fields(model_args)
    count = 0
    for model in models:
        for name, module in model.named_modules():
            layout = getattr(module, "fused_gate_layout", None)
            if layout is not None:
                gate = f"{_global_name(model, name)}.value_residual_gate.weight"
                full = start_tensor(arch, gate, (layout.groups * layout.tp, module.linear_qkv.weight.shape[1]), std,
                                    seed)
                rank = module.pg_collection.tp.rank()
                rows = full[rank * layout.groups:(rank + 1) * layout.groups]
                layout.grouped(module.linear_qkv.weight)[:, layout.group_qkv].copy_(rows)
                count += 1
        for name, p in model.named_parameters():
            if is_own(name, own):
                global_name = _global_name(model, name)
                p.copy_(start_tensor(arch, global_name, p.shape, std, seed).to(p.dtype))
                count += 1
    return count


def note(arch, std: float) -> str:
    """The log line's words for the start."""
    return (arch.upcycle_note or "the arch's own parameters set by its upcycle_start").format(std=std)
