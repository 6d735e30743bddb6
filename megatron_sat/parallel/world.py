"""The world a launcher started this process in, read from its environment without importing torch (argument
checks run before any heavy import).

    torchrun   WORLD_SIZE (and RANK, LOCAL_RANK, MASTER_ADDR/PORT)
    srun       SLURM_NTASKS inside a job step (SLURM_PROCID and SLURM_STEP_ID set). An sbatch script itself also
               has SLURM_PROCID=0 and the job's SLURM_NTASKS but no SLURM_STEP_ID (Slurm 22.05, seen here): it is
               one process, not a rank of the job's world.
"""

import os
import socket
from typing import Mapping, Optional


def in_slurm_step(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is a task of an srun job step (not the batch script, not a lone process)."""
    env = os.environ if env is None else env
    return "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and bool(env.get("SLURM_NTASKS"))


def world_from_env(default: int = 1) -> int:
    """The world size the launcher set: torchrun's WORLD_SIZE, else srun's SLURM_NTASKS inside a job step, else
    `default` (1: a lone process; the profiler passes 0 to tell "started alone" apart)."""
    env = os.environ
    if env.get("WORLD_SIZE"):
        return int(env["WORLD_SIZE"])
    if in_slurm_step(env):
        return int(env["SLURM_NTASKS"])
    return default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (a lone rank's MASTER_PORT, a test's torchrun)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
