"""Checkpoints with Megatron dist-checkpointing (any layout saves, any layout loads).

Two levels:
  * save_model / load_model: model weights only (tests/workers/equivalence.py; load_weights is
    the trainer's --pretrained-checkpoint).
  * Saver / find_resume_point + load_checkpoint: the trainer's full state, so that a resumed run
    continues exactly: model, optimizer state (optimizer.sharded_state_dict, resharded on load like
    the model), LR scheduler, iteration, consumed samples, RNG states, the arguments and the model's
    resolved fields (a resume with another shape is refused before anything is built).

A save (every rank calls it), synchronous or asynchronous (--async-save, Megatron-Core's async
dist-checkpoint save: the files are written by a forked process while training goes on):
    1. the files go to RUN/iter_XXXXXXX.tmp;
    2. once every rank has written them: manifest.json (sizes, checksums: integrity.py), the rename
       to RUN/iter_XXXXXXX, the tracker (run_folder.py), then retention of older checkpoints.
So a run killed at any moment leaves its last complete checkpoint named by the tracker; a failed save
(disk full) removes its .tmp folder and says so in one line (SaveFailed), on every rank at the same point,
whichever rank's write failed (save_agreement.py).
"""

import errno
import os
import random
import shutil
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from torch.distributed.checkpoint.api import CheckpointException

from megatron_sat.model import upcycle
from megatron_sat.training import integrity, run_folder, save_agreement
from megatron_sat.training.run_folder import TRACKER, CheckpointError, checkpoint_dir  # noqa: F401 (re-exported)
from megatron_sat.training.signals import install_write_results_queue, shielded_async_request

CHECKPOINT_VERSION = 2  # 2: records the model's resolved fields ("model_fields") and writes manifest.json
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}  # reshardable across layouts


# torch.distributed.checkpoint's CheckpointException (how Megatron-Core reports a failed write or read) is a
# BaseException
_WRITE_ERRORS = (Exception, CheckpointException)


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (its .tmp folder is removed; the previous one is intact)."""


def _rank0() -> bool:
    return torch.distributed.get_rank() == 0


def model_sharded_state_dict(chunks) -> dict:
    """One sharded state dict over this rank's chunks; keys are global, so layouts can differ."""
    if len(chunks) == 1:
        return {"model": unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def unwrap(chunk):
    """The GPTModel inside DDP and Float16Module wrappers."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def _load_model_state(chunks, loaded: dict, own: tuple = (), directory: str = "") -> None:
    """Each chunk's weights from `loaded`; strict, except for the parameters named by `own` (another arch's over a
    Transformer, left for model/upcycle.py to fill) and their extra state."""
    for i, c in enumerate(chunks):
        state = loaded["model" if len(chunks) == 1 else f"model{i}"]
        if not own:
            unwrap(c).load_state_dict(state)
            continue
        missing, unexpected = unwrap(c).load_state_dict(state, strict=False)
        left = [k for k in missing if not upcycle.is_own(k, own) and not k.endswith("_extra_state")]
        if left or unexpected:
            raise CheckpointError(f"{directory} does not hold this model's weights: missing {left}, "
                                  f"unexpected {unexpected}")


def save_model(chunks, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    install_write_results_queue()
    dist_checkpointing.save(model_sharded_state_dict(chunks), directory)


def load_model(chunks, directory: str, own: tuple = ()) -> None:
    """The model weights of `directory`; own: parameters the checkpoint lacks (model/upcycle.py's load_filter)."""
    if not dist_checkpointing.check_is_distributed_checkpoint(directory):
        raise FileNotFoundError(f"{directory} is not a Megatron distributed checkpoint")
    sharded = model_sharded_state_dict(chunks)
    if own:
        sharded = upcycle.load_filter(sharded, own, dist_checkpointing.load_tensors_metadata(directory))
    _load_model_state(chunks, dist_checkpointing.load(sharded, directory), own, directory)
    torch.distributed.barrier()


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
    """optimizer None: the model (and RNG) only (--no-load-optim)."""
    model_sd = model_sharded_state_dict(chunks)
    sd = dict(model_sd)
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=OPTIMIZER_METADATA)
    if with_rng:
        sd["rng_state"] = _rng_sharded(None if loading else _rng_state())
    sd.update(common)
    return sd


# ---------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------

def _reason(err: BaseException, folder: Optional[str] = None) -> str:
    """One line for a failed save or load. A full disk is named as such: by ENOSPC anywhere in the chain,
    or (torch's file writer reports it as "unexpected pos") by less room left on `folder`'s file system
    than the newest complete checkpoint there takes."""
    seen, e = [], err
    while e is not None and len(seen) < 10:
        seen.append(e)
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return "the disk is full (No space left on device): free space or point --save elsewhere"
        e = e.__cause__ or e.__context__
    if folder is not None and os.path.isdir(folder):
        free = shutil.disk_usage(folder).free
        last = run_folder.latest_iteration(folder)
        need = _folder_bytes(checkpoint_dir(folder, last)) if last is not None else 16 << 20
        if free < need:
            return (f"the disk is full ({free / 2**20:.1f} MiB free, a checkpoint takes {need / 2**20:.1f} MiB): "
                    "free space or point --save elsewhere")
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _fresh_folder(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)


def _folder_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)) \
        if os.path.isdir(directory) else 0


class Saver:
    """Writes the trainer's checkpoints into one run folder (every rank holds one and calls it together).

    save(iteration) after the step; poll() every step (finishes asynchronous saves that are done);
    finalize() before exiting. Retention (--save-retain-interval) runs after the tracker names a new
    checkpoint. `debug_delay_s` / `debug_fail_at` stretch or break a save for the fault tests."""

    def __init__(self, root: str, chunks, optimizer, scheduler, *, async_save: bool = False,
                 retain_interval: Optional[int] = None, log: Callable[[str], None] = print,
                 debug_delay_s: float = 0.0, debug_fail_at: Optional[int] = None):
        self.root, self.chunks, self.optimizer, self.scheduler = root, chunks, optimizer, scheduler
        self.retain_interval, self.log = retain_interval, log
        self.debug_delay_s, self.debug_fail_at = debug_delay_s, debug_fail_at
        self.previous = run_folder.latest_iteration(root) if _rank0() and os.path.isdir(root) else None
        self.queue = None
        self.pending: Optional[int] = None
        self.held: List[int] = []  # dropped by retention but held by a reader: deleted once free
        if async_save:
            self.queue = AsyncCallsQueue()
        if root:
            # the writer's results queue (a spawned Manager: seconds, tens of seconds on a loaded machine) starts
            # here, before the training loop, not at the first save: the hang watchdog times a save
            install_write_results_queue()

    def save(self, iteration: int, *, consumed_samples: int, args: Optional[dict] = None,
             model: Optional[dict] = None) -> str:
        self.finalize()  # the previous asynchronous save completes first
        final = checkpoint_dir(self.root, iteration)
        tmp = final + ".tmp"
        self._agree(tmp, save_agreement.attempt(lambda: _fresh_folder(tmp), here=_rank0()))
        common = dict(iteration=iteration, consumed_train_samples=consumed_samples, layout=layout_key(),
                      opt_param_scheduler=self.scheduler.state_dict(), args=args or {}, model_fields=model or {},
                      checkpoint_version=CHECKPOINT_VERSION)
        t0 = time.time()
        try:
            state = _state_dict(self.chunks, self.optimizer, False, common, with_rng=True)
            if self.queue is None:
                with save_agreement.holding():
                    dist_checkpointing.save(state, tmp)
                self._commit(iteration, t0)
            else:
                # Megatron-Core's own async writer ("mcore"): it runs on CPU and GPU alike; "nvrx" (the
                # default, nvidia-resiliency-ext) is CUDA-only and cannot be checked here
                request = dist_checkpointing.save(state, tmp, async_sharded_save=True, async_strategy="mcore")
                request.add_finalize_fn(lambda: self._commit(iteration, t0))
                self.queue.schedule_async_request(shielded_async_request(request))
                self.pending = iteration
                self.log(f"saving checkpoint {final} in the background")
        except SaveFailed:
            raise
        except _WRITE_ERRORS as e:  # any failure of the writer: report it in one line
            self._abandon(tmp, e)
        return final

    def _commit(self, iteration: int, t0: float) -> None:
        """Collective: every rank's files are written. Manifest, rename, tracker, retention; a step that fails on
        any rank (Megatron-Core's .metadata or metadata.json held on rank 0 included) fails the save on every rank."""
        final = checkpoint_dir(self.root, iteration)
        tmp = final + ".tmp"
        failed = save_agreement.take()
        if failed is None and self.debug_fail_at == iteration:
            failed = OSError(errno.EIO, f"debug: save of iteration {iteration} made to fail")
        if failed is None and self.debug_delay_s:
            self.log(f"debug: holding the save of iteration {iteration} for {self.debug_delay_s} s")
            time.sleep(self.debug_delay_s)
        self._agree(tmp, failed)
        # each rank hashes its share (a gather); rank 0 writes the file
        self._agree(tmp, save_agreement.attempt(lambda: integrity.write_manifest(tmp)))
        self._agree(tmp, save_agreement.attempt(lambda: self._publish(iteration, tmp, final), here=_rank0()))
        if _rank0():
            self.log(f"saved checkpoint {final} ({time.time() - t0:.1f} s)")
            doomed = run_folder.retention_candidate(self.previous, iteration, self.retain_interval)
            self._retain(self.held + ([doomed] if doomed is not None else []))
        self.previous = iteration
        self.pending = None
        torch.distributed.barrier()

    def _publish(self, iteration: int, tmp: str, final: str) -> None:
        """Rank 0: the rename, then the tracker. A tracker that cannot be written leaves the checkpoint unnamed:
        renamed back, for _abandon to remove (unless the tracker names this iteration already: a rerun's)."""
        if os.path.exists(final):  # a checkpoint of the same iteration (a rerun): replace it whole
            run_folder.delete_checkpoint(self.root, iteration)
        os.replace(tmp, final)
        try:
            run_folder.write_tracker(self.root, iteration)
        except OSError:
            if run_folder.read_tracker(self.root) != iteration:
                os.replace(final, tmp)
            raise

    def _agree(self, tmp: str, failed: Optional[BaseException]) -> None:
        """Collective: when any rank's step failed, every rank abandons the save, with the first failing rank's
        reason."""
        reason = save_agreement.first(None if failed is None else _reason(failed, self.root))
        if reason is not None:
            self._abandon(tmp, failed, reason)

    def _retain(self, doomed: List[int]) -> None:
        """Delete what retention dropped; a checkpoint a reader holds (an export, an evaluation) is kept until a
        later save finds it free (self.held: within this job; a later job leaves it)."""
        self.held = []
        for iteration in doomed:
            try:
                deleted, readers = run_folder.retain(self.root, iteration)
            except OSError as e:  # the save is complete: a checkpoint left behind is no reason to fail it
                self.held.append(iteration)
                self.log(f"warning: could not delete checkpoint {checkpoint_dir(self.root, iteration)} ({e}); a "
                         "later save tries again")
                continue
            if deleted:
                self.log(f"deleted checkpoint {checkpoint_dir(self.root, iteration)} (--save-retain-interval "
                         f"{self.retain_interval})")
            else:
                self.held.append(iteration)
                self.log(f"kept checkpoint {checkpoint_dir(self.root, iteration)} for now: read by "
                         f"{', '.join(readers)} (--save-retain-interval deletes it at a later save)")

    def _abandon(self, tmp: str, err: Optional[BaseException], reason: Optional[str] = None) -> None:
        """Collective (every rank failed at the same point, or agreed that one did): remove the .tmp folder and
        raise SaveFailed with one line, the same on every rank."""
        self.pending = None
        save_agreement.take()  # a failure held for this save is told by now, or moot
        if reason is None:  # before the partial files are removed: a full disk still shows
            reason = save_agreement.first(_reason(err, self.root))
        if _rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        last = run_folder.latest_iteration(self.root) if os.path.isdir(self.root) else None
        kept = f"{checkpoint_dir(self.root, last)} is intact" if last is not None else "no earlier checkpoint"
        raise SaveFailed(f"could not write checkpoint {tmp[:-4]}: {reason} ({kept})") from err

    def poll(self) -> None:
        """Finish an asynchronous save whose files are written (collective; cheap when none is pending)."""
        if self.queue is not None and self.pending is not None:
            self._finalize(blocking=False)

    def finalize(self) -> None:
        """Wait for a pending asynchronous save and commit it (collective)."""
        if self.queue is not None and self.pending is not None:
            self._finalize(blocking=True)

    def _finalize(self, blocking: bool) -> None:
        pending = self.pending
        try:
            with save_agreement.holding():
                self.queue.maybe_finalize_async_calls(blocking=blocking)
        except SaveFailed:
            raise
        except _WRITE_ERRORS as e:  # the writer process failed on some rank
            self._abandon(checkpoint_dir(self.root, pending) + ".tmp", e)


def save_checkpoint(root: str, iteration: int, chunks, optimizer, scheduler, *, consumed_samples: int,
                    args: Optional[dict] = None, model: Optional[dict] = None) -> str:
    """Write root/iter_XXXXXXX synchronously (every rank calls this) and point the tracker at it."""
    saver = Saver(root, chunks, optimizer, scheduler, log=lambda text: None)
    return saver.save(iteration, consumed_samples=consumed_samples, args=args, model=model)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------

@dataclass
class ResumePoint:
    directory: str
    iteration: int
    common: dict           # the checkpoint's common state: iteration, consumed samples, layout, args, model
    verified: bool         # its manifest was checked (False: no manifest, or --no-verify-checkpoint)
    hold: Optional[run_folder.Hold] = None  # this process's reader mark (a --pretrained-checkpoint load)

    def model_fields(self) -> dict:
        """The model's resolved fields as saved (older checkpoints: the arguments that name them)."""
        if self.common.get("model_fields"):
            return dict(self.common["model_fields"])
        return {k: v for k, v in (self.common.get("args") or {}).items()
                if k in run_folder.RESUME_FIELDS and v is not None}


def _read_common(directory: str) -> dict:
    try:
        return dist_checkpointing.load_common_state_dict(directory)
    except _WRITE_ERRORS as e:  # torch's unpickling errors say nothing about the checkpoint
        raise integrity.CorruptCheckpoint(f"cannot read {directory}: {_reason(e)}") from None


def find_resume_point(root: str, ckpt_step: Optional[int] = None, *, verify: bool = True, fallback: bool = False,
                      log: Callable[[str], None] = print, reader: Optional[str] = None) -> Optional[ResumePoint]:
    """Which checkpoint of root to resume, checked; None when root holds none (collective: every rank).

    reader (a tool's name): mark the checkpoint as read by this process (run_folder.hold) so that the retention
    of a job writing root leaves it alone until load_weights releases it; one deleted as it was chosen is
    replaced by the next complete one, with one line.
    CheckpointError (one line, what to do) for a tracker that names nothing, a corrupt checkpoint
    without --ckpt-fallback, or nothing left to fall back to."""
    if reader is None:
        return _find_resume_point(root, ckpt_step, verify=verify, fallback=fallback, log=log)
    for _ in range(5):
        point = _find_resume_point(root, ckpt_step, verify=False, fallback=fallback, log=log)
        if point is None:
            return None
        try:
            mark = run_folder.hold(root, point.iteration, reader)
        except run_folder.CheckpointGone as e:
            if ckpt_step is not None:
                raise
            log(f"note: {e}; taking the newest complete checkpoint instead")
            continue
        try:
            point = _find_resume_point(root, point.iteration, verify=verify, fallback=False, log=log)
        except BaseException:
            mark.release()
            raise
        point.hold = mark
        return point
    raise CheckpointError(f"{root}: every checkpoint chosen was deleted by retention as it was chosen; try again")


def _find_resume_point(root: str, ckpt_step: Optional[int] = None, *, verify: bool = True, fallback: bool = False,
                       log: Callable[[str], None] = print) -> Optional[ResumePoint]:
    try:
        iteration, warning = run_folder.resolve(root, ckpt_step)
    except CheckpointError:
        if not fallback or ckpt_step is not None:
            raise
        its = run_folder.complete_iterations(root)
        if not its:
            raise
        iteration, warning = its[-1], f"{root}'s tracker is unusable: falling back to {checkpoint_dir(root, its[-1])}"
    if iteration is None:
        return None
    if warning:
        log(f"warning: {warning}")
    while True:
        directory = checkpoint_dir(root, iteration)
        try:
            verified = integrity.verify(directory) if verify else False
            return ResumePoint(directory, iteration, _read_common(directory), verified)
        except integrity.CorruptCheckpoint as e:
            older = run_folder.previous_complete(root, iteration) if fallback else None
            if older is None:
                advice = ("no earlier complete checkpoint to fall back to" if fallback else
                          "pass --ckpt-fallback to resume from the previous complete checkpoint")
                raise CheckpointError(f"checkpoint {directory} is corrupt: {e}; {advice} "
                                      "(or --no-verify-checkpoint to load it anyway)") from None
            log(f"warning: checkpoint {directory} is corrupt ({e}); falling back to {checkpoint_dir(root, older)}")
            iteration = older


def _restore_step_zero(optimizer, state) -> None:
    """megatron-core saves Adam's common step only when it is non-zero (`if step:`), so a checkpoint saved before
    the first update (fp16: every step so far skipped on overflow) holds moments without their step, which torch's
    Adam refuses on load: give them the step 0 that was saved."""
    inner = state.get("optimizer") if isinstance(state, dict) else None
    states = inner.get("state") if isinstance(inner, dict) else None
    if (isinstance(getattr(optimizer, "optimizer", None), torch.optim.Adam | torch.optim.AdamW)
            and isinstance(states, dict) and states and "common_step" not in states
            and not any(isinstance(v, dict) and "step" in v for v in states.values())):
        states["common_step"] = torch.tensor(0.0)


def restore(point: ResumePoint, chunks, optimizer, scheduler, align: Optional[Callable[[dict], None]] = None, *,
            load_optim: bool = True, load_rng: bool = True) -> dict:
    """Load everything from a resume point; returns its common state plus 'rng_restored' and 'directory'.

    RNG states are restored only when TP and PP match the saved layout (they are per rank). align(loaded optimizer
    state) runs before the optimizer loads it (schedule.align_param_groups: a changed LR schedule). As Megatron-LM's
    --no-load-optim / --no-load-rng: load_optim False leaves the optimizer and the LR scheduler as built (the
    caller refreshes the optimizer's main parameters), load_rng False the RNG states."""
    saved, now = point.common["layout"], layout_key()
    same_ranks = load_rng and saved["tp"] == now["tp"] and saved["pp"] == now["pp"]
    try:
        loaded = dist_checkpointing.load(_state_dict(chunks, optimizer if load_optim else None, True, {},
                                                     with_rng=same_ranks), point.directory)
    except _WRITE_ERRORS as e:
        raise CheckpointError(f"cannot load {point.directory}: {_reason(e)}") from None
    _load_model_state(chunks, loaded)
    if load_optim:
        if align is not None:
            align(loaded["optimizer"])
        _restore_step_zero(optimizer, loaded["optimizer"])
        try:
            optimizer.load_state_dict(loaded["optimizer"])
        except (KeyError, ValueError) as e:  # megatron-core's "Could not find parameter group with key ..."
            first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            raise CheckpointError(f"the optimizer state in {point.directory} does not fit this run's optimizer "
                                  f"({type(e).__name__}: {first}): start from its weights with --pretrained-checkpoint "
                                  f"{os.path.dirname(point.directory)} and a new --save") from None
        scheduler.load_state_dict(point.common["opt_param_scheduler"])
    if same_ranks:
        _set_rng_state(loaded["rng_state"])
    torch.distributed.barrier()
    return dict(point.common, rng_restored=same_ranks, directory=point.directory)


def load_checkpoint(root: str, chunks, optimizer, scheduler, ckpt_step: Optional[int] = None) -> Optional[dict]:
    """Restore everything from root's latest (or ckpt_step's) checkpoint; None when root holds none."""
    point = find_resume_point(root, ckpt_step, log=lambda text: None)
    return None if point is None else restore(point, chunks, optimizer, scheduler)


def load_weights(point: ResumePoint, chunks, own: tuple = ()) -> str:
    """Load only the model weights of a checkpoint; returns its folder.

    own: name suffixes of parameters the checkpoint lacks (another arch's over a Transformer, Arch.own_fields),
    left as they are (model/upcycle.py fills them). The caller refreshes the optimizer's main parameters
    (optimizer.reload_model_params())."""
    try:
        load_model(chunks, point.directory, own)
    except _WRITE_ERRORS as e:
        raise CheckpointError(f"cannot load the weights of {point.directory}: {_reason(e)}") from None
    finally:
        if point.hold is not None:
            point.hold.release()
    return point.directory
