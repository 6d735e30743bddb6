"""A run folder's checkpoints on disk: which one to load, what is stale, what to delete, whether a resume fits.

    RUN/iter_0000100/                       a complete checkpoint (dist checkpoint + manifest.json)
    RUN/iter_0000200.tmp/                   a save in progress, or one killed mid-way (cleaned at start)
    RUN/iter_0000050.del/                   a checkpoint being deleted by retention (cleaned at start)
    RUN/latest_checkpointed_iteration.txt   the newest complete checkpoint, written last and atomically
    RUN/.readers/iter_0000100.HOST.PID.json a process reading that checkpoint (an export, an evaluation, a
                                            --pretrained-checkpoint load): retention leaves it alone
    RUN/.readers/iter_0000100.deleting      retention is deciding about that checkpoint (readers wait for it)

Reader marks (hold / readers below) are written by hand: retention must not delete a checkpoint under a process
that reads it, and neither megatron-core nor torch's checkpointing knows of readers. A mark is {host, pid,
process_start, tool, started}; its mtime is a heartbeat (touched every run_lock.HEARTBEAT_S). A mark is stale,
and removed by retention, when its process is gone (same host: the pid is not running or is another process) or,
on another host, when its heartbeat is older than run_lock.STALE_S. The order of the two sides makes it safe:
retention writes .deleting, then looks for marks, deletes or keeps, removes .deleting; a reader writes its mark,
waits while .deleting is there, then checks that the checkpoint is still complete (else it takes the next one).

Nothing here talks to other ranks; the trainer calls the writing functions on global rank 0 only.
Every problem a user can fix raises CheckpointError with one line that says what to do.
"""

import atexit
import json
import os
import re
import shutil
import socket
import threading
import time
from typing import Dict, List, Optional, Tuple

from megatron_sat.model import args as model_args  # no torch
from megatron_sat.training import run_lock

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
    try:
        with open(pointer + ".tmp", "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        if os.path.exists(pointer + ".tmp"):
            os.remove(pointer + ".tmp")  # a full disk: no stray file beside the tracker, which is as it was
        raise
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


def retention_candidate(previous: Optional[int], new: int, interval: Optional[int]) -> Optional[int]:
    """--save-retain-interval (Megatron-LM's meaning): once the tracker names `new`, the previous checkpoint
    is to be deleted unless its iteration is a multiple of `interval`. Returns that iteration, if any."""
    if not interval or previous is None or previous == new or previous % interval == 0:
        return None
    return previous


def retain(root: str, iteration: int) -> Tuple[bool, List[str]]:
    """Delete checkpoint `iteration` unless a live reader holds it: (deleted, descriptions of its readers).
    A checkpoint already gone counts as deleted."""
    if not os.path.isdir(checkpoint_dir(root, iteration)):
        return True, []
    folder = os.path.join(root, READERS)
    deciding = _deciding(root, iteration)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(deciding, "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        deciding = None  # a folder without room for the note: readers' marks are still read below
    try:
        held = readers(root, iteration)
        if held:
            return False, held
        delete_checkpoint(root, iteration)
        return True, []
    finally:
        if deciding:
            try:
                os.remove(deciding)
                os.rmdir(folder)  # no reader left: no empty folder in the run (fails while a mark is there)
            except OSError:
                pass


# --- readers' marks (see the module docstring) ---------------------------------------------------------------
READERS = ".readers"
DECIDING_WAIT_S = 60.0  # a reader waits this long for retention's decision (a .deleting older is left behind)


class CheckpointGone(CheckpointError):
    """The checkpoint a reader chose was deleted (by retention) before its mark was written."""


def _deciding(root: str, iteration: int) -> str:
    return os.path.join(root, READERS, f"iter_{iteration:07d}.deleting")


class Hold:
    """A reader's mark on one checkpoint; release() (or the process's exit) removes it."""

    def __init__(self, path: Optional[str]):
        self.path = path
        self._stop = threading.Event()
        if path:
            atexit.register(self.release)
            threading.Thread(target=self._beat, name="megatron-sat-reader-mark", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(run_lock.HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        if self.path:
            try:
                os.remove(self.path)
            except OSError:
                pass
            self.path = None


def hold(root: str, iteration: int, tool: str) -> Hold:
    """Mark checkpoint `iteration` of run folder `root` as read by this process until release() or exit.

    CheckpointGone when retention deleted it first (the caller takes the next complete one). A run folder this
    process cannot write gets no mark (Hold(None)): its reads are then not protected from retention."""
    name = f"iter_{iteration:07d}.{socket.gethostname()}.{os.getpid()}.json"
    path = os.path.join(root, READERS, name)
    record = dict(host=socket.gethostname(), pid=os.getpid(), process_start=run_lock._process_start(os.getpid()),
                  tool=tool, started=time.strftime("%Y-%m-%dT%H:%M:%S"))
    for attempt in range(3):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)
            break
        except FileNotFoundError:  # retention removed the empty folder between the two: make it again
            if attempt == 2:
                return Hold(None)
        except OSError:
            return Hold(None)
    mark = Hold(path)
    deciding, deadline = _deciding(root, iteration), time.time() + DECIDING_WAIT_S
    while os.path.exists(deciding) and time.time() < deadline:
        time.sleep(0.02)
    if not is_complete(checkpoint_dir(root, iteration)):
        mark.release()
        raise CheckpointGone(f"{checkpoint_dir(root, iteration)} was deleted (--save-retain-interval of the run "
                             "writing it) as it was chosen")
    return mark


def readers(root: str, iteration: int) -> List[str]:
    """'tool (host H, pid P)' of every live reader of checkpoint `iteration`; stale marks are removed."""
    folder = os.path.join(root, READERS)
    prefix = f"iter_{iteration:07d}."
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix) and n.endswith(".json")]
    except OSError:
        return []
    live = []
    for name in names:
        path = os.path.join(folder, name)
        try:
            age = time.time() - os.path.getmtime(path)
        except OSError:
            continue
        mark = run_lock.read_holder(path)
        if mark is None:
            continue
        if not mark:  # being written (or cut short): a reader until it is old
            if age < run_lock.STALE_S:
                live.append(f"a reader writing {name}")
            continue
        if run_lock.stale_reason(mark, age) is not None:
            try:
                os.remove(path)
            except OSError:
                pass
            continue
        live.append(f"{mark.get('tool')} (host {mark.get('host')}, pid {mark.get('pid')})")
    return live


def model_differences(saved: Dict, now: Dict) -> List[str]:
    """'field: checkpoint X, now Y' for every resume field that differs. Fields the checkpoint lacks are skipped
    (older checkpoints record fewer), except those whose value before they were recorded is known
    (model/args.py's LEGACY_DEFAULTS)."""
    saved = model_args.with_legacy(saved)
    return [f"{k} {saved[k]!r} in the checkpoint, {now.get(k)!r} now"
            for k in RESUME_FIELDS if k in saved and saved[k] != now.get(k)]
