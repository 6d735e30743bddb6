"""The Megatron side of conversion: find a checkpoint, read its recorded configuration, build the
model at TP1/PP1 in one CPU process and move full tensors in and out of it.

Checkpoints are the trainer's (megatron_sat/training/checkpointing.py):
    RUN/iter_XXXXXXX/                      a dist checkpoint; its common state holds 'args' (the
                                           trainer's arguments) next to iteration, layout, ...
    RUN/latest_checkpointed_iteration.txt  the newest complete one
    RUN/config.json                        the run's resolved configuration (vocab_size, tokenizer, ...)
A checkpoint saved at any TP/PP/VPP loads here: dist-checkpointing reshards to TP1/PP1.
"""

import json
import os
import sys
from typing import Callable, List, Optional, Tuple

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from megatron_sat.conversion.mapping import ConversionError, ModelSpec, convertible, unsupported_arch
from megatron_sat.model.args import from_record, record
from megatron_sat.model.config import make_config
from megatron_sat.model.gpt import build_model
from megatron_sat.parallel.layout import Layout, initialize
from megatron_sat.parallel.process_group import init_from_env
from megatron_sat.training.integrity import CorruptCheckpoint
from megatron_sat.training.integrity import verify as check
from megatron_sat.training.run_folder import (
    TRACKER,
    CheckpointError,
    CheckpointGone,
    Hold,
    checkpoint_dir,
    complete_iterations,
    hold,
    is_unfinished,
    read_tracker,
)

EMBEDDING_KEY = "embedding.word_embeddings.weight"
# Transformer Engine keeps some norms inside the next linear; the local spec maps its names to
# those, except SATFormer's TE layer with the separate gate, which keeps input_layernorm apart. Try either name.
KEY_ALIASES = (("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
               ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"))


def init_single_process() -> None:
    """megatron's CPU compatibility and a one-rank process group (unless one exists already)."""
    try:
        init_from_env(single_only=True)
    except ValueError as e:
        raise ConversionError(str(e)) from None


_HOLDS: List[Hold] = []  # this process's reader marks: held until it exits


def _hold(run: str, iteration: int) -> None:
    """Mark the checkpoint as read by this process (retention of the job writing `run` leaves it alone until this
    process exits). CheckpointGone when it was deleted as it was chosen."""
    _HOLDS.append(hold(run, iteration, os.path.basename(sys.argv[0]) or "a checkpoint reader"))


def find_checkpoint(path: str, verify: bool = True, log: Optional[Callable[[str], None]] = None
                    ) -> Tuple[str, Optional[str]]:
    """(iteration folder, run folder or None) for a run folder or an iter_XXXXXXX folder, checked against its
    manifest as the trainer checks a resume (megatron_sat/training/integrity.py); verify=False skips that
    (--no-verify-checkpoint). Every reader of checkpoints (export, evaluate --checkpoint) comes through here,
    and marks the checkpoint as read (run_folder.hold) so that a job's --save-retain-interval does not delete it
    under this process; a run folder's checkpoint deleted as it was chosen is replaced by the next complete one.

    An unfinished checkpoint (iter_XXXXXXX.tmp: a save in progress or cut short; .del: being deleted) is never
    read nor offered. ConversionError (one line, what to do) for anything else that is not a complete one."""
    path = os.path.abspath(path)
    if is_unfinished(path):
        run = os.path.dirname(path)
        its = complete_iterations(run)
        hint = f"pass {run} or {checkpoint_dir(run, its[-1])}" if its else f"{run} holds no complete checkpoint yet"
        raise ConversionError(f"{path} is an unfinished checkpoint (a save in progress, or one cut short): {hint}")
    if not os.path.isdir(path):
        raise ConversionError(f"checkpoint {path} does not exist")
    if os.path.isfile(os.path.join(path, "metadata.json")):
        if not dist_checkpointing.check_is_distributed_checkpoint(path):
            raise ConversionError(f"{path} is not a complete Megatron distributed checkpoint")
        parent = os.path.dirname(path)
        run = parent if os.path.isfile(os.path.join(parent, TRACKER)) or \
            os.path.isfile(os.path.join(parent, "config.json")) else None
        name = os.path.basename(path)
        if run and name.startswith("iter_") and name[5:].isdigit():
            try:
                _hold(run, int(name[5:]))
            except CheckpointGone as e:
                raise ConversionError(f"{e}; pass {run} for its newest complete checkpoint") from None
        _verify(path, verify, log)
        return path, run
    for _attempt in range(5):
        try:
            iteration = read_tracker(path)
        except CheckpointError as e:  # a tracker that is not a number
            raise ConversionError(str(e)) from None
        if iteration is None or not dist_checkpointing.check_is_distributed_checkpoint(checkpoint_dir(path, iteration)):
            break
        try:
            _hold(path, iteration)
            break
        except CheckpointGone as e:
            if log:
                log(f"note: {e}; reading the newest complete checkpoint instead")
    else:
        raise ConversionError(f"{path}: every checkpoint its tracker named was deleted by retention as it was "
                              "chosen; run again")
    if iteration is None:
        its = complete_iterations(path)
        hint = (f" (its complete checkpoints: {', '.join(os.path.basename(checkpoint_dir(path, i)) for i in its[-3:])}"
                ": pass one of them)") if its else ""
        unfinished = sorted(d for d in os.listdir(path) if is_unfinished(os.path.join(path, d)))
        if unfinished and not its:
            hint = f" (only unfinished checkpoints: {', '.join(unfinished[-3:])}; wait for the save to finish)"
        raise ConversionError(f"{path} has no {TRACKER} and is not a checkpoint folder{hint}")
    directory = checkpoint_dir(path, iteration)
    if not dist_checkpointing.check_is_distributed_checkpoint(directory):
        raise ConversionError(f"{directory}, named by {TRACKER}, is missing or incomplete")
    _verify(directory, verify, log)
    return directory, path


def _verify(directory: str, verify: bool, log: Optional[Callable[[str], None]]) -> None:
    """The trainer's manifest check (each process hashes every file: these readers run before or without a
    process group)."""
    if not verify:
        if log:
            log(f"warning: {directory} is read without checking its files (--no-verify-checkpoint)")
        return
    try:
        verified = check(directory, collective=False)
    except CorruptCheckpoint as e:
        raise ConversionError(f"checkpoint {directory} is corrupt: {e}; pass --no-verify-checkpoint to read it "
                              "anyway") from None
    if not verified and log:
        log(f"note: {directory} has no manifest.json (written before manifests existed): its files are not verified")


def recorded_config(iter_dir: str, run_dir: Optional[str]) -> Tuple[dict, dict]:
    """(trainer args, run config.json or {}) recorded with the checkpoint."""
    common = dist_checkpointing.load_common_state_dict(iter_dir)
    args = dict(common.get("args") or {})
    run_config = {}
    if run_dir and os.path.isfile(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json")) as f:
            run_config = json.load(f)
    if not args.get("arch"):
        args = dict(run_config)
    if not args.get("arch"):
        raise ConversionError(f"{iter_dir} records no model configuration (no 'args' in the checkpoint and no "
                              "config.json next to it): it was not written by megatron_sat's trainer")
    return args, run_config


def tensor_metadata(iter_dir: str) -> dict:
    return dist_checkpointing.load_tensors_metadata(iter_dir)


def spec_from_args(args: dict, metadata: dict) -> ModelSpec:
    """ModelSpec from the trainer's recorded arguments (model/args.py's from_record: the one way recorded arguments
    become a model, older runs' missing fields from LEGACY_DEFAULTS); vocabulary and tying from the stored tensors.
    The converter and lm-eval's checkpoint loader both build from it."""
    if args["arch"] not in convertible():
        raise unsupported_arch(args["arch"], "the checkpoint's arch")
    if EMBEDDING_KEY not in metadata:
        raise ConversionError(f"the checkpoint has no {EMBEDDING_KEY}")
    vocab, hidden = metadata[EMBEDDING_KEY].global_shape
    model = from_record(args)
    if hidden != model.hidden_size:
        raise ConversionError(f"the checkpoint's embedding is {hidden} wide but its args say "
                              f"hidden_size={model.hidden_size}")
    # the positions: an import records its HF config's (Megatron-LM's --max-position-embeddings), a run its own
    # unless given; else the sequence length it trained at
    positions = args.get("max_position_embeddings") or args.get("seq_length") or 4096
    return ModelSpec(**record(model), vocab_size=vocab, max_position_embeddings=positions,
                     rotary_base=args.get("rotary_base") or 10000, tied="output_layer.weight" not in metadata)


def make_model(spec: ModelSpec, dtype: torch.dtype, **config_overrides):
    """(config, [model]) at TP1/PP1 on this one process; parallel state is (re)initialised.

    SATFormer is built with the separate gate, whose parameters are the tensors both gate impls store in
    checkpoints (linear_qkv.weight and value_residual_gate.weight, megatron_sat.model.fused_gate), so
    a checkpoint of either impl loads here and named_parameters() has the names mapping.py converts."""
    fields = dict(record(spec), value_residual_gate_impl="separate", params_dtype=dtype, bf16=dtype == torch.bfloat16)
    fields.update(config_overrides)
    initialize(Layout())
    config = make_config(**fields)
    chunks = build_model(config, vocab_size=spec.vocab_size, max_sequence_length=spec.max_position_embeddings,
                         backend="local", rotary_base=spec.rotary_base,
                         share_embeddings_and_output_weights=spec.tied)
    return config, chunks


def load_weights(model, iter_dir: str, metadata: dict) -> None:
    """Model weights from the dist checkpoint into `model` (TP1/PP1), resharding from any layout."""
    sharded = model.sharded_state_dict()
    for value in sharded.values():
        if isinstance(value, ShardedTensor) and value.key not in metadata:
            for a, b in KEY_ALIASES:
                for old, new in ((a, b), (b, a)):
                    if value.key.endswith(old) and value.key[: -len(old)] + new in metadata:
                        value.key = value.key[: -len(old)] + new
    tensors = [t for v in sharded.values() for t in (_built(v) if isinstance(v, ShardedTensorFactory) else [v])
               if isinstance(t, ShardedTensor)]  # a factory (e.g. the fused gate) stores the tensors it builds
    keys = {t.key for t in tensors}
    missing = sorted(keys - set(metadata))
    if missing:
        raise ConversionError("the checkpoint lacks tensors this model needs (wrong arch or sizes in its "
                              f"recorded configuration?): {', '.join(missing[:6])}")
    unused = sorted(k for k in set(metadata) - keys if not k.startswith(("optimizer.", "rng_state", "common_state"))
                    and "_extra_state" not in k)
    if unused:
        raise ConversionError("the checkpoint holds model tensors that its recorded configuration does not use "
                              f"(wrong arch or sizes recorded?): {', '.join(unused[:6])}")
    for s in tensors:
        if tuple(metadata[s.key].global_shape) != tuple(s.global_shape):
            raise ConversionError(f"shape mismatch for {s.key}: checkpoint {tuple(metadata[s.key].global_shape)}, "
                                  f"model {tuple(s.global_shape)} (sizes recorded wrongly?)")
    loaded = dist_checkpointing.load(sharded, iter_dir)  # also returns the common state: keep the model's
    model.load_state_dict({k: v for k, v in loaded.items() if k in sharded})


def _built(factory) -> list:
    """The ShardedTensors a ShardedTensorFactory saves (the tensors the checkpoint holds for it)."""
    built = factory.build()
    return list(built.values()) if isinstance(built, dict) else list(built)


def full_state(model) -> dict:
    """{name: tensor} of a TP1/PP1 model (tied output layer left out)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p is not None}


def set_full_state(model, state: dict) -> None:
    params = dict(model.named_parameters())
    extra = sorted(set(state) - set(params))
    missing = sorted(set(params) - set(state))
    if extra or missing:
        raise ConversionError(f"weights do not fit the model: missing {missing[:6]}, unexpected {extra[:6]}")
    with torch.no_grad():
        for name, tensor in state.items():
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise ConversionError(f"{name}: {tuple(tensor.shape)} does not fit {tuple(params[name].shape)}")
            params[name].copy_(tensor)
