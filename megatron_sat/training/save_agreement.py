"""A checkpoint save's rank-local failures, agreed on by every rank (checkpointing.Saver).

A save is a row of collectives with rank-local writes between them. A write that raises on one rank sends that rank
down its error path to a collective the others never call, while they wait in the save's next one: a deadlock, which
the hang watchdog ends as a hang (exit 75, "NOT RESPONDING" heartbeats on a full disk), not as what it is, a failed
save (one line, exit 4). The chaos run's full disk did this once: rank 0's .metadata write failed.

So every rank-local step of a save is attempted (`attempt`: the error, not raised) and the ranks then call `first`
together: one all-gather of each rank's one-line reason, after which every rank knows whether, and why, the save
failed, and abandons it at the same point.

Megatron-Core 0.19's dist-checkpoint save has two writes of rank 0 alone inside its own collectives, out of our reach:
the torch writer's .metadata (FileSystemWriterAsync.finish, then a broadcast of the write status the others wait in)
and metadata.json (serialization.save_config, then a barrier). Under `holding()` (the Saver's save and finalize), a
failure of either is held instead of raised, so that rank 0 goes through the same collectives as the others; the
Saver `take`s it at its commit and agrees on it like its own. Outside `holding()` (save_model, tools) both raise as
before. No library offers this: Megatron-Core agrees on the shard writes only.
"""

import functools
from contextlib import contextmanager
from typing import Callable, Optional

import torch

_held: Optional[BaseException] = None  # the first failure of a coordinator write under holding()
_holding = False


def attempt(step: Callable[[], object], here: bool = True) -> Optional[BaseException]:
    """Run `step` (when `here`: this rank has a part in it); its exception, returned rather than raised."""
    if not here:
        return None
    try:
        step()
    except Exception as e:  # noqa: BLE001 (every failure of a rank-local write is agreed on, then reported)
        return e
    return None


def first(reason: Optional[str]) -> Optional[str]:
    """Collective (every rank, at the same point of the save): the reason of the lowest failing rank, the same on
    every rank; None when no rank failed."""
    reasons = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(reasons, reason)
    return next((r for r in reasons if r is not None), None)


@contextmanager
def holding():
    """Megatron-Core's coordinator writes hold their failure (for `take`) instead of raising it, inside."""
    global _holding
    _install()
    _holding = True
    try:
        yield
    finally:
        _holding = False


def take() -> Optional[BaseException]:
    """The failure held since the last take (None: none); clears it."""
    global _held
    held, _held = _held, None
    return held


def _holds(write):
    @functools.wraps(write)
    def held_write(*args, **kwargs):
        global _held
        if not _holding:
            return write(*args, **kwargs)
        try:
            return write(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (raised on every rank by the Saver, once all have come this far)
            _held = _held or e
            return None

    held_write.msat_holds = True
    return held_write


def _install() -> None:
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    for owner, name in ((filesystem_async.FileSystemWriterAsync, "finish"), (serialization, "save_config")):
        write = getattr(owner, name, None)
        if write is None:  # a megatron-core whose save is laid out otherwise: look again at what rank 0 writes alone
            raise RuntimeError(f"megatron-core has no {owner.__name__}.{name} (megatron_sat/training/save_agreement.py "
                               "was written for 0.19's dist-checkpoint save)")
        if not getattr(write, "msat_holds", False):
            setattr(owner, name, _holds(write))
