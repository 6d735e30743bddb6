"""A run folder's checkpoints on disk: which one to load, what is stale, what to delete, whether a resume fits.

    RUN/iter_0000100/                       a complete checkpoint (dist checkpoint + manifest.json)
    RUN/iter_0000200.tmp/                   a save in progress, or one killed mid-way (cleaned at start)
    RUN/iter_0000050.del/                   a checkpoint being deleted by retention (cleaned at start)
    RUN/latest_checkpointed_iteration.txt   the newest complete checkpoint, written last and atomically

Nothing here talks to other ranks; the trainer calls the writing functions on global rank 0 only.
Every problem a user can fix raises CheckpointError with one line that says what to do.
"""

import os
import re
import shutil
from typing import Dict, List, Optional, Tuple

from megatron_sat.model import args as model_args  # no torch

TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"^iter_(\d{7,})$")
_STALE = re.compile(r"^iter_\d{7,}\.(tmp|del)$")

# model fields that must match for a checkpoint to be resumed (or its weights loaded): the shape and the
# function of the model, marked so in model/args.py. Precision, recompute and parallel layout may change between runs.
RESUME_FIELDS = model_args.RESUME_FIELDS


class CheckpointError(RuntimeError):
    """A checkpoint problem the user must decide about (the trainer prints it and exits 2)."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def is_unfinished(directory: str) -> bool:
    """An iter_XXXXXXX.tmp (a save in progress or cut short) or .del (a deletion) folder: never to be read."""
    return bool(_STALE.match(os.path.basename(os.path.normpath(directory))))


def is_complete(directory: str) -> bool:
    """A folder that a finished save renamed into place (metadata.json is Megatron's last word)."""
    return os.path.isfile(os.path.join(directory, "metadata.json"))


def complete_iterations(root: str) -> List[int]:
    """Iterations of the complete checkpoints in root, ascending."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _ITER.match(name)
        if m and is_complete(os.path.join(root, name)):
            found.append(int(m.group(1)))
    return sorted(found)


def _listing(root: str) -> str:
    its = complete_iterations(root)
    return f"complete checkpoints there: {', '.join(map(str, its))}" if its else "it holds no complete checkpoint"


def read_tracker(root: str) -> Optional[int]:
    """The iteration named by root's tracker; None without a tracker; CheckpointError if it is not a number."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text[:40]!r}, not an iteration; {_listing(root)}: write one of them "
                              "into it, or pass --ckpt-step N")
    return int(text)


def write_tracker(root: str, iteration: int) -> None:
    pointer = os.path.join(root, TRACKER)
    with open(pointer + ".tmp", "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer + ".tmp", pointer)


def latest_iteration(root: str) -> Optional[int]:
    """What a resume of root would start from: the tracker's iteration, else the newest complete checkpoint."""
    tracked = read_tracker(root)
    if tracked is not None:
        return tracked
    its = complete_iterations(root)
    return its[-1] if its else None


def resolve(root: str, ckpt_step: Optional[int] = None) -> Tuple[Optional[int], Optional[str]]:
    """(iteration to load, a warning or None) for root; (None, None) when root holds nothing to resume.

    The tracker names the checkpoint. Without a tracker (deleted, or a copy of the iter_* folders) the
    newest complete checkpoint is taken, with a warning: a run folder is never restarted from scratch
    while it holds checkpoints."""
    if ckpt_step is not None:
        if not is_complete(checkpoint_dir(root, ckpt_step)):
            raise CheckpointError(f"--ckpt-step {ckpt_step}: {checkpoint_dir(root, ckpt_step)} is not a complete "
                                  f"checkpoint; {_listing(root)}")
        return ckpt_step, None
    tracked = read_tracker(root)
    if tracked is not None:
        if not is_complete(checkpoint_dir(root, tracked)):
            raise CheckpointError(f"{os.path.join(root, TRACKER)} names iteration {tracked} but "
                                  f"{checkpoint_dir(root, tracked)} is missing or incomplete; {_listing(root)}: "
                                  "pass --ckpt-step N (or --ckpt-fallback for the newest of them)")
        return tracked, None
    its = complete_iterations(root)
    if not its:
        return None, None
    return its[-1], (f"{root} has no {TRACKER}: resuming from the newest complete checkpoint "
                     f"{checkpoint_dir(root, its[-1])}")


def previous_complete(root: str, iteration: int) -> Optional[int]:
    """The newest complete checkpoint before `iteration` (for --ckpt-fallback)."""
    older = [i for i in complete_iterations(root) if i < iteration]
    return older[-1] if older else None


def holds_run(root: str) -> bool:
    """True when root already holds checkpoints (complete or named by a tracker)."""
    return os.path.isfile(os.path.join(root, TRACKER)) or bool(complete_iterations(root))


def clean_stale(root: str) -> List[str]:
    """Remove what interrupted saves and deletions left (iter_*.tmp, iter_*.del); returns their names."""
    if not os.path.isdir(root):
        return []
    stale = sorted(name for name in os.listdir(root) if _STALE.match(name))
    for name in stale:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if os.path.exists(os.path.join(root, TRACKER + ".tmp")):  # a tracker write cut short
        os.remove(os.path.join(root, TRACKER + ".tmp"))
    return stale


def delete_checkpoint(root: str, iteration: int) -> None:
    """Rename to .del first (atomic), then remove: an interrupted deletion never looks like a checkpoint."""
    final = checkpoint_dir(root, iteration)
    doomed = final + ".del"
    os.replace(final, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def retain(root: str, previous: Optional[int], new: int, interval: Optional[int]) -> Optional[int]:
    """--save-retain-interval (Megatron-LM's meaning): once the tracker names `new`, the previous checkpoint
    is deleted unless its iteration is a multiple of `interval`. Returns the deleted iteration, if any."""
    if not interval or previous is None or previous == new or previous % interval == 0:
        return None
    if not os.path.isdir(checkpoint_dir(root, previous)):
        return None
    delete_checkpoint(root, previous)
    return previous


def model_differences(saved: Dict, now: Dict) -> List[str]:
    """'field: checkpoint X, now Y' for every resume field that differs. Fields the checkpoint lacks are skipped
    (older checkpoints record fewer), except those whose value before they were recorded is known
    (model/args.py's LEGACY_DEFAULTS)."""
    saved = model_args.with_legacy(saved)
    return [f"{k} {saved[k]!r} in the checkpoint, {now.get(k)!r} now"
            for k in RESUME_FIELDS if k in saved and saved[k] != now.get(k)]
