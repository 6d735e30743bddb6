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
    offers this; it sets one module global of Megatron-Core 0.19 (checked where it is set). The server is
    kept light: it imports this module alone (megatron-core lazily, below) and holds the results pickled
    (PickledQueue), where Megatron-Core's own imported megatron-core and torch in every rank: seconds of CPU
    per rank at start and at the first save, which the hang watchdog times.
  * An asynchronous save's writer is a forked child (Megatron-Core's TemporalAsyncCaller): it inherits
    the flag-setting handler, and `die_with_parent` makes it end with the trainer.
"""

import ctypes
import ctypes.util
import multiprocessing
import os
import pickle
import signal
import sys
from multiprocessing import resource_tracker
from multiprocessing.managers import SyncManager
from typing import Callable, Optional

JOB_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_PR_SET_PDEATHSIG = 1


class StopSignal:
    """SIGTERM / SIGUSR1 (Slurm's warnings before preemption or the time limit) and SIGINT (Ctrl-C) set a flag;
    the loop all-reduces it at the next step so that every rank saves the same step and exits 0.

    A second SIGINT stops at once (exit 130, as a shell reports Ctrl-C): rank 0 prints one line saying what was
    kept (`kept()`, set by the trainer: the last complete checkpoint); a save in progress stays a .tmp folder,
    which the next start removes. Nothing partial is ever named by the tracker, so nothing is lost."""

    HARD_EXIT = 130

    def __init__(self):
        self.received: Optional[str] = None
        self.interrupts = 0
        self.kept: Callable[[], str] = lambda: "the last complete checkpoint"
        self.is_logger = True
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)
        signal.signal(signal.SIGINT, self._interrupt)

    def _handler(self, signum, frame):
        self.received = self.received or signal.Signals(signum).name

    def _interrupt(self, signum, frame):
        self.interrupts += 1
        if self.interrupts == 1:
            self._handler(signum, frame)
            if self.is_logger:
                _say("SIGINT: saving at the end of this step, then stopping (press Ctrl-C again to stop at once, "
                     "without that save)")
            return
        if self.is_logger:
            try:
                kept = self.kept()
            except Exception as e:  # noqa: BLE001 (reading the run folder must not stop the stop)
                kept = f"the last complete checkpoint ({type(e).__name__} naming it)"
            _say(f"megatron-sat-train: second SIGINT: stopped at once; kept: {kept} (nothing after it was saved)")
        os._exit(self.HARD_EXIT)  # at once: no collective, no finally block that could wait on another rank


def _say(line: str) -> None:
    """One line straight to stdout's file descriptor: a handler may run inside a buffered print of the loop."""
    try:
        sys.stdout.flush()
    except (RuntimeError, ValueError, OSError):  # a reentrant call into the buffer being written
        pass
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent exits (no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def bind_to_launcher() -> None:
    """Under torchrun (its agent sets TORCHELASTIC_RUN_ID): SIGTERM to this rank when the launcher dies, so that it
    saves at its next step and exits rather than training on unsupervised (torchrun starts each rank in a session
    of its own: a signal to the launcher's process group never reaches it). Lone processes and Slurm tasks are
    left alone (a `nohup` run must outlive its shell)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:  # the launcher died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def _manager_init() -> None:
    """Runs first in the Manager server: its signals stay blocked (inherited mask); die with the trainer."""
    die_with_parent()


class PickledQueue:
    """A Manager queue whose items the callers pickle: the server holds bytes, never the write results themselves,
    so it never imports torch to unpickle them (seconds of CPU at each rank's first save, tens under load). The
    server process imports this module (the initializer's) and runs the top of the main module (train.py's parses
    arguments only): no megatron-core, no torch.
    Megatron-Core calls put and get_nowait; get and empty are here for completeness."""

    def __init__(self, queue):
        self._queue = queue  # [bytes] a Manager's Queue proxy: picklable, shared by forked and spawned writers

    def put(self, item, *args, **kwargs) -> None:
        self._queue.put(pickle.dumps(item), *args, **kwargs)

    def get(self, *args, **kwargs):
        return pickle.loads(self._queue.get(*args, **kwargs))

    def get_nowait(self):
        return pickle.loads(self._queue.get_nowait())

    def empty(self) -> bool:
        return self._queue.empty()


_manager = None


def install_write_results_queue() -> None:
    """Start Megatron-Core's write-results Manager shielded from the job's signals (once per process)."""
    global _manager
    if _manager is not None:
        return
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
    filesystem_async._results_queue = PickledQueue(manager.Queue())


def shielded_async_request(request):
    """The same AsyncRequest, whose forked writer ends when the trainer does."""
    if request.async_fn is None:
        return request
    fn = request.async_fn

    def writer(*args, **kwargs):
        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to count (StopSignal), not the writer's
        return fn(*args, **kwargs)

    return request._replace(async_fn=writer)
