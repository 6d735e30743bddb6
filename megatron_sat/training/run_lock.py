"""One job per run folder: RUN/.run.lock, taken by global rank 0 before anything is written into RUN.

    RUN/.run.lock   {"host", "pid", "process_start", "slurm_job", "slurm_restart", "started", "token"};
                    its mtime is the heartbeat (touched every HEARTBEAT_S by a thread of the holder)

The file is created with O_CREAT | O_EXCL, which is atomic on local disks, NFS (v3 and later) and Lustre;
fcntl/flock locks are not used, because on NFS and Lustre they may hold per node only (and die with a
client without leaving a trace). The `filelock` package's SoftFileLock takes the same O_EXCL file but records
no holder and never takes over a stale one, hence this module.

A lock is stale, and taken over with a warning, when its holder is gone:
  * same host: its pid is not running, or runs another process (a process start time that differs);
  * the same Slurm job, another restart (SLURM_RESTART_COUNT): Slurm ends every process of a job before it
    requeues it;
  * any host: the heartbeat is older than STALE_S (default 300 s; MEGATRON_SAT_LOCK_STALE_S) - a job on a
    node that died, or one stopped with SIGSTOP for that long.
Otherwise LockHeld says who holds it (host, pid, Slurm job, since when) and the trainer exits 2.

release() removes the file if it is still this job's (the token matches); the trainer calls it on every way
out (normal end, a signal's save, an error, KeyboardInterrupt) and atexit covers the rest. After a kill -9
the file stays and the next job takes it over as above.
"""

import atexit
import errno
import json
import os
import socket
import threading
import time
import uuid
from typing import Callable, Optional

import psutil

LOCK = ".run.lock"
HEARTBEAT_S = float(os.environ.get("MEGATRON_SAT_LOCK_HEARTBEAT_S", "30"))
STALE_S = float(os.environ.get("MEGATRON_SAT_LOCK_STALE_S", "300"))
_GUARD_STALE_S = 60.0  # a takeover that died between its two steps leaves the guard; older than this it is ignored
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


class LockHeld(RuntimeError):
    """Another job holds the run folder (the message names it)."""


class NotWritable(RuntimeError):
    """The run folder cannot be written (read-only file system, immutable folder, no permission)."""


def _process_start(pid: int) -> Optional[float]:
    try:
        return psutil.Process(pid).create_time()
    except Exception:  # psutil.NoSuchProcess, AccessDenied, ZombieProcess
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def _slurm_job() -> Optional[str]:
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def describe(holder: dict) -> str:
    """'host H, pid P (Slurm job J), since T' of a lock's content."""
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {holder.get('started')}"


def read_holder(path: str) -> Optional[dict]:
    """The lock's content; {} when unreadable (being written, or cut short); None when there is no lock."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def stale_reason(holder: dict, age_s: float) -> Optional[str]:
    """Why the holder is gone (the lock may be taken over), or None while it may be alive."""
    here = socket.gethostname()
    pid = holder.get("pid")
    if holder.get("host") == here and isinstance(pid, int):
        if not _pid_alive(pid):
            return f"its process {pid} on this host is gone"
        started, recorded = _process_start(pid), holder.get("process_start")
        if started is not None and isinstance(recorded, (int, float)) and abs(started - recorded) > 1.0:
            return f"pid {pid} on this host is now another process"
        return None
    job, restart = _slurm_job(), os.environ.get("SLURM_RESTART_COUNT", "0")
    if job and holder.get("slurm_job") == job and str(holder.get("slurm_restart", "0")) != restart:
        return f"it was taken by an earlier start of this Slurm job ({job}, restart {holder.get('slurm_restart')})"
    if age_s > STALE_S:
        return f"its heartbeat is {age_s:.0f} s old (more than {STALE_S:.0f} s)"
    return None


class RunLock:
    """The lock of one run folder, held by this process (global rank 0 of the job)."""

    def __init__(self, folder: str, log: Callable[[str], None] = print):
        self.folder = os.path.abspath(folder)
        self.path = os.path.join(self.folder, LOCK)
        self.log = log
        self.token = uuid.uuid4().hex
        self.created_folder = False
        self.held = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------------------------------ taking
    def acquire(self) -> "RunLock":
        """Take the lock (creating the folder if need be); LockHeld or NotWritable otherwise."""
        self._make_folder()
        for _ in range(5):  # a takeover by another job may be under way: look again
            if self._create():
                self._start_heartbeat()
                atexit.register(self.release)
                return self
            holder = read_holder(self.path)
            if holder is None:  # released meanwhile
                continue
            try:
                age = time.time() - os.stat(self.path).st_mtime
            except FileNotFoundError:
                continue
            if not holder and age < _GUARD_STALE_S:  # being written by its holder right now
                time.sleep(0.2)
                continue
            reason = stale_reason(holder, age) if holder else "its content is unreadable and it is not being written"
            if reason is None:
                raise LockHeld(f"run folder {self.folder} is in use by another job ({describe(holder)}; heartbeat "
                               f"{age:.0f} s ago): wait for it to end, stop it, or pass another --save. If that job "
                               f"is gone, delete {self.path}")
            self._take_over(holder, reason)
        raise LockHeld(f"run folder {self.folder}: could not take {self.path} (other jobs keep taking it over)")

    def _make_folder(self) -> None:
        try:
            if not os.path.isdir(self.folder):
                os.makedirs(self.folder)
                self.created_folder = True
        except OSError as e:
            raise NotWritable(self._unwritable(e)) from None

    def _unwritable(self, e: OSError) -> str:
        what = {errno.EROFS: "a read-only file system", errno.EPERM: "not permitted (an immutable folder?)",
                errno.EACCES: "permission denied"}.get(e.errno, e.strerror or str(e))
        return f"--save {self.folder} is not writable ({what}): pass a --save folder this job can write"

    def _create(self) -> bool:
        """O_EXCL create with our record; False when a lock exists."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno in _NOT_WRITABLE:
                raise NotWritable(self._unwritable(e)) from None
            raise
        record = dict(host=socket.gethostname(), pid=os.getpid(), process_start=_process_start(os.getpid()),
                      slurm_job=_slurm_job(), slurm_restart=os.environ.get("SLURM_RESTART_COUNT", "0"),
                      started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), token=self.token)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        self.held = True
        return True

    def _take_over(self, holder: dict, reason: str) -> None:
        """Remove a stale lock, guarded so that of two jobs taking it over at once only one removes it."""
        guard = self.path + ".takeover"
        try:
            if time.time() - os.stat(guard).st_mtime > _GUARD_STALE_S:
                os.remove(guard)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:  # another job is taking it over: look again
            time.sleep(0.2)
            return
        try:
            os.close(fd)
            if read_holder(self.path) == holder:  # still the stale one, not a lock taken meanwhile
                os.remove(self.path)
                self.log(f"warning: took over the lock of {self.folder} from a job that is gone "
                         f"({describe(holder) if holder else 'unreadable lock'}: {reason})")
        except FileNotFoundError:
            pass
        finally:
            try:
                os.remove(guard)
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------------------------------------ holding
    def _start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    os.utime(self.path)  # NFS: set by the server's clock
                except OSError:
                    pass

        self._thread = threading.Thread(target=beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self, remove_empty_folder: bool = False) -> None:
        """Remove the lock if it is still ours; with remove_empty_folder, also the folder this lock created if
        nothing else was written into it (a run refused before it started)."""
        if not self.held:
            return
        self.held = False
        self._stop.set()
        holder = read_holder(self.path)
        if holder and holder.get("token") == self.token:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        if remove_empty_folder and self.created_folder:
            try:
                os.rmdir(self.folder)
            except OSError:  # not empty: something was written after all
                pass
