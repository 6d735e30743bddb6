"""The job's stop signals, and the checkpoint helper processes kept out of their way.

Slurm (`scancel --signal`, `--signal=B:USR1@180`, preemption) and torchrun's agent send SIGTERM or SIGUSR1
to every process of the job, often to the whole process group. The trainer only sets a flag
(StopSignal) and saves at the next step boundary. Its helper processes must neither die from those
signals nor outlive the trainer:

  * Megatron-Core's dist-checkpoint save hands its write results through a multiprocessing Manager
    queue that it starts lazily with the 'spawn' context (filesystem_async.get_write_results_queue), so
    the Manager server (and multiprocessing's resource tracker) start with the default dispositions:
    a SIGUSR1 or SIGTERM to the process group kills them, and the next save dies with BrokenPipeError.
    After a kill -9 of the trainer they stay behind. `install_write_results_queue` starts that Manager
    itself, with the job's signals blocked (the mask survives fork and exec, so the resource tracker it
    spawns is covered too) and PR_SET_PDEATHSIG, then hands its queue to Megatron-Core. No library
    offers this; it sets one module global of Megatron-Core 0.19 (checked at import below).
  * An asynchronous save's writer is a forked child (Megatron-Core's TemporalAsyncCaller): it inherits
    the flag-setting handler, and `die_with_parent` makes it end with the trainer.
"""

import ctypes
import ctypes.util
import signal
from typing import Optional

JOB_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_PR_SET_PDEATHSIG = 1


class StopSignal:
    """SIGTERM / SIGUSR1 (Slurm's warnings before preemption or the time limit) set a flag; the loop
    all-reduces it at the next step so that every rank saves the same step and exits."""

    def __init__(self):
        self.received: Optional[str] = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.received = self.received or signal.Signals(signum).name


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent exits (no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _manager_init() -> None:
    """Runs first in the Manager server: its signals stay blocked (inherited mask); die with the trainer."""
    die_with_parent()


_manager = None


def install_write_results_queue() -> None:
    """Start Megatron-Core's write-results Manager shielded from the job's signals (once per process)."""
    global _manager
    if _manager is not None:
        return
    import multiprocessing
    from multiprocessing import resource_tracker
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):  # a Megatron-Core that no longer has the global
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    old = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    try:
        resource_tracker.ensure_running()  # spawned now, with the mask, if not running yet
        signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)  # ensure_running unblocks SIGTERM and SIGINT
        manager.start(initializer=_manager_init)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    _manager = manager
    filesystem_async._results_queue = manager.Queue()


def shielded_async_request(request):
    """The same AsyncRequest, whose forked writer ends when the trainer does."""
    if request.async_fn is None:
        return request
    fn = request.async_fn

    def writer(*args, **kwargs):
        die_with_parent()
        return fn(*args, **kwargs)

    return request._replace(async_fn=writer)
