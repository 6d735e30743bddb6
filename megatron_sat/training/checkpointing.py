"""Model checkpoints with Megatron dist-checkpointing (any layout saves, any layout loads)."""

import os

import torch
from megatron.core import dist_checkpointing


def model_sharded_state_dict(chunks) -> dict:
    """One sharded state dict over this rank's chunks; keys are global, so layouts can differ."""
    if len(chunks) == 1:
        return {"model": _unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _unwrap(chunk):
    return chunk.module if hasattr(chunk, "module") and not hasattr(chunk, "decoder") else chunk


def save_model(chunks, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(model_sharded_state_dict(chunks), directory)


def load_model(chunks, directory: str) -> None:
    if not dist_checkpointing.check_is_distributed_checkpoint(directory):
        raise FileNotFoundError(f"{directory} is not a Megatron distributed checkpoint")
    loaded = dist_checkpointing.load(model_sharded_state_dict(chunks), directory)
    if len(chunks) == 1:
        _unwrap(chunks[0]).load_state_dict(loaded["model"])
    else:
        for i, c in enumerate(chunks):
            _unwrap(c).load_state_dict(loaded[f"model{i}"])
    torch.distributed.barrier()
