"""The faults tests/chaos/chaos.py injects into a running sweep on a local Slurm cluster, and how each is recognised.

Every fault is one Fault (chaos_sweep.py injects it into one run): `needles` are the log lines (regular expressions)
that name it and its recovery in the run's Slurm log after the injection, `restarts` says
whether it costs the trainer a restart (a new attempt in config.json, counted by collect_grid) and `resubmit` whether
the job ends for good, so that the sweep's owner resubmits it (chaos.py does, as a user would).

  kill9_rank       SIGKILL to one random rank; srun --kill-on-bad-exit ends the step, the job FAILs: resubmitted
  node_loss        a node's slurmd and every task on it killed (SlurmCluster.kill_node), the node marked DOWN so
                   slurmctld knows at once; Slurm requeues the job (NODE_FAIL) or it FAILs: resubmitted; the
                   node's slurmd is started again and the node resumed a few seconds later
  hang             SIGSTOP to one rank: the other rank's watchdog names it and exits 75, launch.sh requeues
  suspend          scontrol suspend for twice the hang timeout, then resume: logged as a suspension, no restart
  preempt_usr1     USR1 to the batch shell (the time-limit warning): save, exit 0, self-requeue
  scancel          scancel (SIGTERM): the trainer saves, the job is CANCELLED: resubmitted
  disk_full        the run folder (a small tmpfs) filled so that half a checkpoint is free once retention has
                   deleted what it will (topped up as it does): the next save fails with one
                   line, exit 4, the job FAILs; the filler is removed and the job resubmitted
  torn_metrics     every rank SIGKILLed, then half a record appended to metrics.jsonl (a job killed while writing):
                   the resume sets the line aside
  export, evaluate convert-to-hf / evaluate --checkpoint on the run folder while it trains (no --iteration: the
                   newest checkpoint, which retention may delete): exit 0 with a complete folder, or exit 2 with one
                   line; the run goes on
"""

import errno
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Tuple

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
KINDS = ("kill9_rank", "node_loss", "hang", "suspend", "preempt_usr1", "scancel", "disk_full", "torn_metrics",
         "export", "evaluate")


@dataclass
class Fault:
    kind: str
    needles: Tuple[str, ...]  # regular expressions that name the fault (and its recovery) in the run's Slurm log
    restarts: bool  # the trainer starts again (a new attempt)
    resubmit: bool  # the job ends for good: the owner resubmits it
    detected_by: str  # what the table says detected it


RESUMED = r"resumed from \S+iter_\d{7} \(iteration \d+"
FAULTS = {  # needles: every one must be in the run's Slurm log after the fault (node_loss: see chaos_sweep.named)
    "kill9_rank": Fault("kill9_rank", (r"training exited \d+ at checkpoint \d+/\d+; not requeueing", RESUMED), True,
                        True, "srun --kill-on-bad-exit; launch.sh: training exited"),
    "node_loss": Fault("node_loss", (RESUMED,), True, True, "slurmctld: node DOWN, job NODE_FAIL/FAILED"),
    "hang": Fault("hang", (r"rank \d stopped responding", "NOT RESPONDING", r"the hang watchdog stopped the job",
                           r"requeueing job \d+ to resume from step \d+", RESUMED), True, False,
                  "watchdog: rank N stopped responding, exit 75"),
    "suspend": Fault("suspend", (r"this process was suspended for \d+ s",), False, False,
                     "watchdog: suspended for N s, not a hang"),
    "preempt_usr1": Fault("preempt_usr1", (r"USR1 at \S+ \(time limit near\)", r"stopped at checkpoint \d+/\d+ \(USR1\)",
                                           r"requeueing job \d+ to continue from step \d+", RESUMED), True, False,
                          "launch.sh USR1 trap: checkpoint, requeue"),
    "scancel": Fault("scancel", (r"SIGTERM \(cancel or preemption\)", RESUMED), True, True,
                     "launch.sh TERM trap; job CANCELLED"),
    "disk_full": Fault("disk_full", (r"the disk is full", r"training exited \d+ at checkpoint", RESUMED), True, True,
                       "trainer: the disk is full, exit 4"),
    "torn_metrics": Fault("torn_metrics", (r"set aside in \S+metrics\.jsonl\.torn", RESUMED), True, True,
                          "trainer on resume: torn line set aside"),
    "export": Fault("export", (), False, False, "convert_to_hf exit status"),
    "evaluate": Fault("evaluate", (), False, False, "evaluate exit status"),
}


def rank_processes(folder: str):
    """{SLURM_PROCID: psutil.Process} of the trainer tasks writing into `folder`."""
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmd = proc.info["cmdline"] or []
            if "megatron_sat.train" in " ".join(cmd) and folder in cmd:
                found[int(proc.environ().get("SLURM_PROCID", "-1"))] = proc
        except psutil.Error:
            pass
    return found


def signal_rank(folder: str, sig: int, rng: random.Random, every: bool = False) -> str:
    """Send `sig` to one random rank (or to every rank) of the run; returns which ranks it reached."""
    ranks = rank_processes(folder)
    if not ranks:
        raise RuntimeError(f"no trainer process of {folder} found")
    chosen = sorted(ranks) if every else [rng.choice(sorted(ranks))]
    for r in chosen:
        try:
            ranks[r].send_signal(sig)
        except psutil.Error:
            pass
    return "ranks " + ",".join(map(str, chosen))


def _bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(top, name))
            except OSError:  # written or deleted meanwhile
                pass
    return total


def fill_disk(folder: str, retain_interval: int) -> Tuple[str, Tuple[int, int]]:
    """Fill the file system of `folder` so that, once retention has deleted what it will, half of a checkpoint's
    size is free: the next save cannot fit. Returns (what was done, (the filler's target size, the bytes to leave
    free)). The target is sized against what stays (the newest checkpoint, those retention keeps, everything else),
    not against the free space now: a run saving every few steps often holds two checkpoints (or one and a save in
    progress) for a moment, and a filler sized then let saves go on for 26 steps in one run. What does not fit yet,
    `top_up` adds once retention has freed it."""
    names = [d for d in os.listdir(folder) if re.fullmatch(r"iter_\d{7}(\.tmp)?", d)]
    complete = sorted(d for d in names if not d.endswith(".tmp"))
    size = _bytes(os.path.join(folder, complete[-1]))
    going = sum(_bytes(os.path.join(folder, d)) for d in names if d.endswith(".tmp") or int(d[5:]) % retain_interval)
    staying = _bytes(folder) - going + size  # one checkpoint of `size` (the newest, or the save that replaces it)
    st = os.statvfs(folder)
    target = max(st.f_blocks * st.f_frsize - staying - size // 2, 0)
    top_up(folder, target, size // 2)
    return f"filled to {size // 2 // 1024} KiB free (a checkpoint takes {size // 1024} KiB)", (target, size // 2)


def top_up(folder: str, target: int, keep: int) -> None:
    """Grow the filler towards `target` bytes, leaving at least `keep` bytes free (metrics and heartbeats still
    write): what retention freed since, or what did not fit before."""
    filler = os.path.join(folder, ".chaos-filler")
    st = os.statvfs(folder)
    have = os.path.getsize(filler) if os.path.exists(filler) else 0
    left = min(target, have + st.f_bavail * st.f_frsize - keep) - have
    block = b"\0" * (1 << 20)
    try:
        with open(filler, "ab") as f:
            while left > 0:
                left -= f.write(block[:min(left, len(block))])
    except OSError as e:  # a save took the space meanwhile: the next look tops up again
        if e.errno != errno.ENOSPC:
            raise


def free_disk(folder: str) -> None:
    filler = os.path.join(folder, ".chaos-filler")
    if os.path.exists(filler):
        os.remove(filler)


def tear_metrics(folder: str) -> str:
    """Half a record at the end of metrics.jsonl, as a process killed while writing it leaves."""
    path = os.path.join(folder, "metrics.jsonl")
    with open(path, "a") as f:
        f.write('{"step": 999999, "loss": 1.2')
    return "half a record appended"


def start_reader(kind: str, folder: str, out: str, env: dict) -> subprocess.Popen:
    """convert_to_hf or evaluate --checkpoint on the run folder while it trains (its newest checkpoint)."""
    if kind == "export":
        cmd = [sys.executable, os.path.join(ROOT, "tools", "convert_to_hf.py"), "--load", folder, "--output", out]
    else:
        cmd = [sys.executable, os.path.join(ROOT, "tools", "evaluate.py"), "--checkpoint", folder, "--tasks",
               "megatron_sat_tiny_mc", "--include-path", os.path.join(ROOT, "tests", "data", "eval"), "--device",
               "cpu", "--batch-size", "2", "--output", out]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def reader_verdict(kind: str, proc: subprocess.Popen, out: str) -> Tuple[bool, str]:
    """(acceptable, what happened): exit 0 with a complete folder, or exit 2 with one `error:` line, no traceback."""
    text = proc.stdout.read() if proc.stdout else ""
    if "Traceback" in text:
        return False, f"traceback: {text[-500:]}"
    if proc.returncode == 0:
        if kind == "export":
            ok = os.path.isfile(os.path.join(out, "config.json")) and any(
                n.endswith(".safetensors") for n in os.listdir(out))
        else:
            ok = os.path.isdir(out) and bool(os.listdir(out))
        return ok, "exit 0, complete output" if ok else "exit 0 but the output is incomplete"
    errors = [line for line in text.splitlines() if "error:" in line]
    if proc.returncode == 2 and len(errors) == 1:
        return True, f"exit 2: {errors[0][:80]}"
    return False, f"exit {proc.returncode}: {text[-500:]}"


def wait_until(condition: Callable[[], bool], timeout: float, what: str, poll: float = 0.2) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


SIGNALS = {"kill9_rank": signal.SIGKILL, "hang": signal.SIGSTOP}
