"""Checkpoints with Megatron dist-checkpointing (any layout saves, any layout loads).

Two levels:
  * save_model / load_model: model weights only (tests/workers/equivalence.py; load_weights is
    the trainer's --pretrained-checkpoint).
  * save_checkpoint / load_checkpoint: the trainer's full state, so that a resumed run continues
    exactly: model, optimizer state (optimizer.sharded_state_dict, resharded on load like the
    model), LR scheduler, iteration, consumed samples, RNG states, and the arguments.

Folder layout of a run (Megatron-LM's names):
    SAVE/iter_0000100/                       one complete dist checkpoint
    SAVE/latest_checkpointed_iteration.txt   the newest complete one, written last and atomically
A checkpoint is written to iter_XXXXXXX.tmp, renamed when every rank has finished, and only then
named in the pointer file, so a run killed mid-save never leaves a half-written checkpoint that
a later run would load.
"""

import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_sat import compat

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 1
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}  # reshardable across layouts


def model_sharded_state_dict(chunks) -> dict:
    """One sharded state dict over this rank's chunks; keys are global, so layouts can differ."""
    if len(chunks) == 1:
        return {"model": _unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _unwrap(chunk):
    """The GPTModel inside DDP and Float16Module wrappers."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def _load_model_state(chunks, loaded: dict) -> None:
    if len(chunks) == 1:
        _unwrap(chunks[0]).load_state_dict(loaded["model"])
    else:
        for i, c in enumerate(chunks):
            _unwrap(c).load_state_dict(loaded[f"model{i}"])


def save_model(chunks, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(model_sharded_state_dict(chunks), directory)


def load_model(chunks, directory: str) -> None:
    if not dist_checkpointing.check_is_distributed_checkpoint(directory):
        raise FileNotFoundError(f"{directory} is not a Megatron distributed checkpoint")
    _load_model_state(chunks, dist_checkpointing.load(model_sharded_state_dict(chunks), directory))
    torch.distributed.barrier()


# ---------------------------------------------------------------------------------------------
# full trainer checkpoints
# ---------------------------------------------------------------------------------------------

def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """The iteration named by root's pointer file, or None when there is no complete checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return int(f.read().strip())


def checkpoint_to_load(root: str, ckpt_step: Optional[int] = None) -> Optional[str]:
    """The folder of ckpt_step's checkpoint, or of root's latest complete one (None when there is none)."""
    iteration = ckpt_step if ckpt_step is not None else read_tracker(root)
    return None if iteration is None else checkpoint_dir(root, iteration)


def load_weights(root: str, chunks) -> str:
    """Load only the model weights of root's latest checkpoint; returns its folder.

    The caller refreshes the optimizer's main parameters (optimizer.reload_model_params()).
    """
    directory = checkpoint_to_load(root)
    if directory is None:
        raise FileNotFoundError(f"{root} holds no complete checkpoint ({TRACKER} is missing)")
    load_model(chunks, directory)
    return directory


def layout_key() -> dict:
    return dict(tp=parallel_state.get_tensor_model_parallel_world_size(),
                pp=parallel_state.get_pipeline_model_parallel_world_size(),
                vpp=parallel_state.get_virtual_pipeline_model_parallel_world_size())


def _rng_state() -> dict:
    state = dict(random=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
                 tracker=tensor_parallel.get_cuda_rng_tracker().get_states())
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded(data) -> ShardedObject:
    """Per (PP, TP) rank; DP ranks hold replicas of the same streams."""
    return ShardedObject(
        "rng_state", data,
        global_shape=(parallel_state.get_pipeline_model_parallel_world_size(),
                      parallel_state.get_tensor_model_parallel_world_size()),
        global_offset=(parallel_state.get_pipeline_model_parallel_rank(),
                       parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def _state_dict(chunks, optimizer, loading: bool, common: dict, with_rng: bool) -> dict:
    model_sd = model_sharded_state_dict(chunks)
    sd = dict(model_sd)
    sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=OPTIMIZER_METADATA)
    if with_rng:
        sd["rng_state"] = _rng_sharded(None if loading else _rng_state())
    sd.update(common)
    return sd


def save_checkpoint(root: str, iteration: int, chunks, optimizer, scheduler, *, consumed_samples: int,
                    args: Optional[dict] = None) -> str:
    """Write root/iter_XXXXXXX (every rank calls this) and point the tracker at it; returns the folder."""
    rank0 = torch.distributed.get_rank() == 0
    final = checkpoint_dir(root, iteration)
    tmp = final + ".tmp"
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    torch.distributed.barrier()
    common = dict(iteration=iteration, consumed_train_samples=consumed_samples, layout=layout_key(),
                  opt_param_scheduler=scheduler.state_dict(), args=args or {},
                  checkpoint_version=CHECKPOINT_VERSION)
    dist_checkpointing.save(_state_dict(chunks, optimizer, False, common, with_rng=True), tmp)
    torch.distributed.barrier()
    if rank0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = os.path.join(root, TRACKER)
        with open(pointer + ".tmp", "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer + ".tmp", pointer)
    torch.distributed.barrier()
    return final


def _check_optimizer_loadable(optimizer) -> None:
    """megatron-core 0.19.2 cannot resume a DistributedOptimizer that runs torch's AdamW (neither Apex nor TE
    present). The CPU compatibility layer mends that (megatron_sat/compat/cpu.py, P9); on a GPU, say so."""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    if compat.is_cpu_mode() or HAVE_APEX_OR_TE:
        return
    if any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer])):
        raise RuntimeError("resuming the distributed optimizer on a GPU needs Transformer Engine or Apex "
                           "(megatron-core 0.19.2 cannot resume it with torch's AdamW)")


def load_checkpoint(root: str, chunks, optimizer, scheduler, ckpt_step: Optional[int] = None) -> Optional[dict]:
    """Restore everything from root's latest (or ckpt_step's) checkpoint.

    Returns the checkpoint's common state (iteration, consumed_train_samples, layout, args, ...)
    and 'rng_restored'; None when root holds no complete checkpoint and no ckpt_step was asked for.
    RNG states are restored only when TP and PP match the saved layout (they are per rank).
    """
    directory = checkpoint_to_load(root, ckpt_step)
    if directory is None:
        return None
    if not dist_checkpointing.check_is_distributed_checkpoint(directory):
        raise FileNotFoundError(f"{directory} is not a complete Megatron distributed checkpoint")
    common = dist_checkpointing.load_common_state_dict(directory)
    saved, now = common["layout"], layout_key()
    same_ranks = saved["tp"] == now["tp"] and saved["pp"] == now["pp"]
    _check_optimizer_loadable(optimizer)
    loaded = dist_checkpointing.load(_state_dict(chunks, optimizer, True, {}, with_rng=same_ranks), directory)
    _load_model_state(chunks, loaded)
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(common["opt_param_scheduler"])
    if same_ranks:
        _set_rng_state(loaded["rng_state"])
    torch.distributed.barrier()
    return dict(common, rng_restored=same_ranks, directory=directory)
