"""Hang detection: a heartbeat watchdog on every rank (--hang-timeout-minutes).

The loop reports progress (`beat("step 31")`, `beat("evaluation")`, `beat("save of iteration 30")`, ...). A
thread of every rank writes that rank's heartbeat (host, pid, where, how long since its last progress) to
RUN/.watchdog/rank_<R>.json every few seconds. When a rank makes no progress for the timeout (a step, a
collective, an evaluation or a save that never ends), its watchdog

  1. names the ranks that stopped: those whose heartbeat file went stale (the process is stopped, dead, or stuck
     where no thread runs: SIGSTOP, a dead node, a kernel wait) and where each rank was, from the heartbeats;
  2. prints this rank's Python stacks (faulthandler, every thread) and the collectives it issued last (torch's
     flight recorder, which records gloo and NCCL collectives: TORCH_FR_BUFFER_SIZE, set below);
  3. kills a rank on this host whose heartbeat went stale (a stopped process would hold its launcher forever),
     after asking it for its Python stacks (STACKS_SIGNAL, faulthandler's: a rank stuck outside Python, or alive but
     unable to write its heartbeat, prints where it is to its own output; a stopped one cannot);
  4. writes RUN/.watchdog/hang.json (slurm/launch.sh requeues on it: srun reports the killed ranks' signal rather
     than this exit code) and exits with HANG_EXIT (75, EX_TEMPFAIL: try again), saving nothing: a save in
     progress stays a .tmp folder, which the next start removes; the rerun resumes from the last checkpoint.

A suspended job is not a hung one: when the whole job is stopped and continued (scontrol suspend/resume, gang
scheduling, SIGSTOP/SIGCONT of every process, a paused VM), every rank's watchdog thread stopped with it, so each
sees its own clock jump: its wait of one interval took much longer. That time is not counted as time without
progress; the watchdog logs "suspended for N s" and carries on. A rank that stays stopped while the others run (a
hang, also one that starts during or right after a suspension) is still named by the running ranks' watchdogs,
whose threads kept running: within the timeout plus one heartbeat of the others' resumption.

Why written here: nvidia-resiliency-ext's fault tolerance (heartbeats with a rank monitor) needs its own launcher
(ft_launcher) in place of torchrun and of the one-task-per-GPU srun launch (slurm/launch.sh), and its releases for
Python 3.11 stop at 0.4.1; torch's flight recorder records collectives (used above) but detects hangs only in
NCCL's watchdog, not under gloo.

Two timeouts, one outcome. The process groups' own timeout (--distributed-timeout-minutes, M) ends a collective
that waits too long: under gloo with an exception in the waiting rank, under NCCL (TORCH_NCCL_ASYNC_ERROR_HANDLING's
default) by NCCL's own watchdog aborting the process. Neither names the ranks nor exits 75. So timeouts() chooses
the watchdog's timeout T below M (T <= HEADROOM x M, which leaves more than one heartbeat of margin): the watchdog
fires first, as the stuck collective began after the rank's last progress. Should a collective still time out first
(T >= M given by hand, or a collective slower than its beat), the loop hands its exception to collective_failed(),
which makes the same report, marker and exit 75 (under gloo; under NCCL the abort comes first, hence the defaults).
"""

import faulthandler
import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional, Tuple

import psutil

HANG_EXIT = 75  # EX_TEMPFAIL: the job may be retried (slurm/launch.sh requeues it)
FOLDER = ".watchdog"
MARKER = "hang.json"
DEFAULT_HANG_MINUTES = 10.0  # the watchdog's timeout when neither timeout is given
DEFAULT_GROUP_MINUTES = 30.0  # the process groups' when not given: torch's gloo default, Megatron-Core's groups'
HEADROOM = 0.8  # the watchdog's default timeout is this share of the process groups' (and theirs T / HEADROOM)
# a running rank prints its stacks on this signal (faulthandler): a real-time one, which no launcher, scheduler or
# terminal sends (SIGUSR1/2 are preemption warnings, SIGQUIT and SIGWINCH come from terminals)
STACKS_SIGNAL = signal.SIGRTMIN + 7
STACKS_WAIT_S = 1.0  # how long a stuck rank is given to print them before SIGKILL


def timeouts(hang_minutes: Optional[float], group_minutes: Optional[float]) -> Tuple[float, float]:
    """(T, M) in minutes: the watchdog's timeout and the process groups', from --hang-timeout-minutes and
    --distributed-timeout-minutes (None: not given), such that the watchdog fires before a collective times out.

    Neither given: T = 10, M = 30. M given: T = 0.8 M. T given: M = max(30, T / 0.8). A stuck collective began after
    its rank's last progress, so it times out no sooner than M after it; the watchdog fires by T plus one heartbeat
    (T / 10, at least 0.2 s and at most 5 s) after it: 0.88 M at most (M of 2.5 s or more). Both given: as given
    (T 0 turns the watchdog off)."""
    hang = hang_minutes
    if hang is None:
        hang = DEFAULT_HANG_MINUTES if group_minutes is None else HEADROOM * group_minutes
    group = group_minutes if group_minutes is not None else max(DEFAULT_GROUP_MINUTES, hang / HEADROOM)
    return hang, group


def is_collective_timeout(error: BaseException) -> bool:
    """A collective that waited past the process groups' timeout (gloo: "Timed out waiting 15000ms for recv
    operation"; NCCL, under TORCH_NCCL_ASYNC_ERROR_HANDLING=2: "Watchdog caught collective operation timeout"),
    not a peer that died (gloo: "Connection closed by peer", which stays an error: srun ends the job)."""
    text = str(error)
    return isinstance(error, RuntimeError) and ("Timed out" in text or "timed out" in text or "timeout" in text)


def enable_flight_recorder(entries: int = 64) -> None:
    """Keep the last `entries` collectives of every process group (set before the groups are created)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))


def _last_collectives(limit: int = 4) -> str:
    try:
        # a private torch API: where it is missing, the report says so instead of this module failing to import
        from torch._C._distributed_c10d import _dump_fr_trace

        entries = pickle.loads(_dump_fr_trace(True, True, False)).get("entries", [])[-limit:]
    except Exception as e:  # noqa: BLE001 (a missing recorder must not stop the report)
        return f"(flight recorder unavailable: {type(e).__name__})"
    return ", ".join(f"#{e.get('collective_seq_id')} {e.get('profiling_name')} on group {e.get('process_group')}"
                     for e in entries) or "none recorded"


class Watchdog:
    """One per rank: beat() from the loop; a daemon thread watches. timeout_s <= 0: off (beat is a no-op)."""

    def __init__(self, run_folder: str, rank: int, world: int, timeout_s: float,
                 log: Callable[[str], None] = print, interval_s: Optional[float] = None):
        self.folder = os.path.join(run_folder, FOLDER)
        self.rank, self.world, self.timeout_s, self.log = rank, world, timeout_s, log
        self.interval_s = interval_s or max(0.2, min(5.0, timeout_s / 10))
        self.where, self.last = "starting", time.time()
        self.paused: Optional[str] = None
        self.suspended_s = 0.0  # the time this process was seen not running (a suspension), in total
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._firing = threading.Lock()  # one report: the thread's or collective_failed()'s
        self.unwritten: Optional[Tuple[float, str]] = None  # since when, and why, this rank's heartbeat fails to write

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def start(self) -> "Watchdog":
        if not self.enabled:
            return self
        try:
            os.makedirs(self.folder, exist_ok=True)
            if self.rank == 0 and os.path.exists(os.path.join(self.folder, MARKER)):
                os.remove(os.path.join(self.folder, MARKER))  # an earlier hang of this run: its rerun is under way
        except OSError as e:
            self.log(f"warning: no hang watchdog: cannot write heartbeats to {self.folder} ({e.strerror})")
            self.timeout_s = 0
            return self
        self.beat("starting the training loop")
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
        try:
            # the first heartbeat now, not one interval later: a rank stopped within its first seconds (a fast
            # resume) is then reported as NOT RESPONDING with where it was, not as having no heartbeat at all
            self._write(time.time())
        except OSError:
            pass  # a full disk: the thread tries again
        self._thread = threading.Thread(target=self._run, name="megatron-sat-watchdog", daemon=True)
        self._thread.start()
        return self

    def beat(self, where: str) -> None:
        """Progress: the loop reached `where` (a step, an evaluation pass, a save)."""
        self.where, self.last = where, time.time()

    def pause(self, why: Optional[str]) -> None:
        """Stop counting while `why` runs (None: count again, from now)."""
        self.paused = why
        self.last = time.time()

    def close(self) -> None:
        """Stop watching; remove this rank's heartbeat (and the folder, by the last rank to leave)."""
        self._stop.set()
        if self._thread is None:
            return
        faulthandler.unregister(STACKS_SIGNAL)
        self._thread.join(timeout=2 * self.interval_s + 1)
        for path in (self._path(self.rank), self._path(self.rank) + ".tmp"):
            try:
                os.remove(path)
            except OSError:
                pass
        try:
            os.rmdir(self.folder)  # fails while another rank's file (or a hang marker) is still there
        except OSError:
            pass

    def collective_failed(self, error: BaseException, group_minutes: float) -> None:
        """A collective timed out before the watchdog fired: the watchdog's report, marker and exit 75 all the same
        (does not return). Called by the loop with the exception (is_collective_timeout) while the watchdog runs."""
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        # a peer's heartbeat may still look fresh (a timeout shorter than the staleness window): wait until each
        # other rank either wrote a heartbeat since the failure (alive) or went stale (stopped), so that the report
        # names the stopped one; at most the staleness window
        failed_at = time.time()
        deadline = failed_at + self._stale_after()
        while time.time() < deadline:
            beats = [self._read(r) for r in range(self.world) if r != self.rank]
            if all(hb is None or hb["written_at"] > failed_at or time.time() - hb["written_at"] > self._stale_after()
                   for hb in beats):
                break
            time.sleep(0.1)
        self._fire(time.time(), cause=f"a collective timed out (--distributed-timeout-minutes {group_minutes:g}: "
                                      f"{first})")

    # --- the thread --------------------------------------------------------------------------
    def _path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank_{rank}.json")

    def _write(self, now: float) -> None:
        record = dict(rank=self.rank, host=socket.gethostname(), pid=os.getpid(), where=self.where,
                      progress_at=self.last, written_at=now, paused=self.paused,
                      suspended_s=round(self.suspended_s, 1))
        tmp = self._path(self.rank) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self._path(self.rank))

    def _suspension(self, before: float, now: float) -> float:
        """Seconds this process was not running during a wait of one interval from `before` to `now` (0: none).

        The thread sleeps one interval between looks; a look much later than that means the process (the whole job,
        when every rank sees it) was stopped or the machine paused. A short scheduling delay under load is not
        counted (below the larger of 5 s and two intervals: a thread starved that long on a loaded machine), so a
        stopped peer is still named within the timeout plus one heartbeat."""
        excess = now - before - self.interval_s
        return excess if excess > max(5.0, 2 * self.interval_s) else 0.0

    def _run(self) -> None:
        before = time.time()
        while not self._stop.wait(self.interval_s):
            now = time.time()
            gone = self._suspension(before, now)
            before = now
            if gone:
                # progress measured from before the stop: move it by the stopped time (never past now: a beat of
                # the loop since the resumption counts as it is)
                self.last = min(self.last + gone, now)
                self.suspended_s += gone
                self.log(f"megatron-sat watchdog (rank {self.rank}): this process was suspended for {gone:.0f} s "
                         f"(the job stopped and continued: scontrol suspend/resume, SIGSTOP/SIGCONT, a paused "
                         f"machine); not counted as a hang, carrying on at: {self.where}")
            try:
                self._write(now)
                self.unwritten = None
            except OSError as e:  # a full or vanished disk: the loop will report it; keep watching, and say so
                self.unwritten = self.unwritten or (now, e.strerror or type(e).__name__)
            if self.paused is None and now - self.last > self.timeout_s:
                self._fire(now)

    def _read(self, rank: int) -> Optional[dict]:
        try:
            with open(self._path(rank)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _stale_after(self) -> float:
        """A heartbeat older than this: its rank stopped (two missed heartbeats and 2 s of scheduling slack)."""
        return 2 * self.interval_s + 2.0

    def _fire(self, now: float, cause: Optional[str] = None) -> None:
        if not self._firing.acquire(blocking=False):
            time.sleep(3600)  # the other path reports and ends the process
        stale_after = self._stale_after()
        lines, stopped = [], []
        for r in range(self.world):
            if r == self.rank:  # alive (this is its report): its heartbeat may be stale only for want of disk space
                lines.append(f"  rank {r} ({socket.gethostname()} pid {os.getpid()}): this rank, alive, no progress "
                             f"for {now - self.last:.0f} s: {self.where}")
                continue
            hb = self._read(r)
            if hb is None:
                lines.append(f"  rank {r}: no heartbeat at all")
                stopped.append(r)
                continue
            silent = now - hb["written_at"]
            state = (f"NOT RESPONDING for {silent:.0f} s (stopped, dead, or stuck outside Python)"
                     if silent > stale_after else f"alive, no progress for {now - hb['progress_at']:.0f} s")
            if silent > stale_after:
                stopped.append(r)
            heard = time.strftime("%H:%M:%S", time.localtime(hb["written_at"]))
            lines.append(f"  rank {r} ({hb['host']} pid {hb['pid']}): {state}; last heard at {heard}: {hb['where']}")
        culprit = (f"rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} stopped responding"
                   if stopped else "no rank stopped responding: every rank waits (a deadlock, or a slow step, "
                   "evaluation or save: raise --hang-timeout-minutes if so)")
        if self.unwritten:
            since, error = self.unwritten
            lines.append(f"  rank {self.rank}'s own heartbeat could not be written since "
                         f"{time.strftime('%H:%M:%S', time.localtime(since))} ({error}): a rank shown NOT RESPONDING "
                         f"may be alive and unable to write its heartbeat too (free space on {self.folder})")
        why = cause or f"no progress for {now - self.last:.0f} s (--hang-timeout-minutes {self.timeout_s / 60:g})"
        report = (f"megatron-sat watchdog (rank {self.rank}): {why} at: {self.where}; {culprit}.\n"
                  + "\n".join(lines)
                  + f"\n  rank {self.rank}'s last collectives: {_last_collectives()}"
                  + f"\n  rank {self.rank}'s Python stacks follow; exiting with code {HANG_EXIT} (nothing saved; "
                  "the rerun resumes from the last checkpoint)")
        sys.stderr.write(report + "\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        host = socket.gethostname()
        for r in stopped:
            hb = self._read(r)
            if hb and hb.get("host") == host and hb.get("pid") not in (None, os.getpid()):
                _stacks_then_kill(hb["pid"])  # a stopped process would hold its launcher forever
        try:
            tmp = os.path.join(self.folder, MARKER + f".{self.rank}.tmp")
            with open(tmp, "w") as f:
                json.dump(dict(rank=self.rank, stopped=stopped, where=self.where, time=now, exit_code=HANG_EXIT), f)
            os.replace(tmp, os.path.join(self.folder, MARKER))
        except OSError as e:
            sys.stderr.write(f"megatron-sat watchdog (rank {self.rank}): cannot write {MARKER} in {self.folder} "
                             f"({e.strerror or e}): slurm/launch.sh will not requeue this job\n")
            sys.stderr.flush()
            try:
                os.remove(tmp)
            except OSError:
                pass
        os._exit(HANG_EXIT)


def _can_answer(pid: int) -> bool:
    """The process runs (or sleeps): not stopped, traced, a zombie or gone."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP,
                                                    psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def _stacks_then_kill(pid: int) -> None:
    """SIGKILL a local rank whose heartbeat went stale; first, unless it is stopped or gone (it could not answer),
    ask it for its stacks (STACKS_SIGNAL: faulthandler prints them to its stderr, from C, also while its main
    thread is stuck in a collective or holds the GIL) and give it STACKS_WAIT_S to print them."""
    try:
        if _can_answer(pid):
            os.kill(pid, STACKS_SIGNAL)
            time.sleep(STACKS_WAIT_S)
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
