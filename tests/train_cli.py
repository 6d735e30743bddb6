"""The trainer's command line from tests: launch (1 process, or torchrun), read metrics.jsonl and the tracker."""

import json
import os
import subprocess
import sys
import time

from megatron_sat.parallel.world import free_port  # noqa: F401 - the tests import it from here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cmd(nproc: int, args) -> list:
    if nproc == 1:
        return [sys.executable, "-m", "megatron_sat.train", *map(str, args)]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", "-m", "megatron_sat.train", *map(str, args)]


def env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def train(*args, nproc=1, expect=0, timeout=600) -> str:
    """Run the trainer to completion; assert its exit code; return stdout + stderr."""
    proc = subprocess.run(cmd(nproc, args), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect, f"exit {proc.returncode} != {expect}:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def start(*args, nproc=1, log_path) -> subprocess.Popen:
    """Start the trainer in its own process group (as a Slurm step or a torchrun job runs), output to log_path."""
    return subprocess.Popen(cmd(nproc, args), cwd=ROOT, env=env(), stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(condition, proc, what: str, timeout: float = 300):
    """Poll until condition() is true; fail naming `what` if the process ends or time runs out first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the trainer exited ({proc.returncode}) before {what}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def rows(folder) -> list:
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written
                pass
    return out


def metrics(folder):
    """({step: train row}, {step: validation loss})."""
    rs = rows(folder)
    return {r["step"]: r for r in rs if "loss" in r}, {r["step"]: r["val_loss"] for r in rs if "val_loss" in r}


def latest(folder):
    path = os.path.join(folder, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return int(f.read())


def iter_dirs(folder) -> list:
    return sorted(p for p in os.listdir(folder) if p.startswith("iter_"))
