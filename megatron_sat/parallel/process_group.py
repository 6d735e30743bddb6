"""torch.distributed from whatever launched this process: torchrun's environment, srun's, or nothing (one rank).

The trainer, the conversion tools, the profiler and the CPU smoke test all start their process group here.
"""

import os
from datetime import timedelta
from typing import Optional

import torch

from megatron_sat import compat
from megatron_sat.parallel.world import free_port, in_slurm_step


def teardown() -> None:
    """Destroy the default process group if this process started one (the end of every program that calls
    init_from_env: the trainer and both conversion tools)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def init_from_env(single_only: bool = False, timeout_minutes: Optional[float] = None) -> None:
    """Initialise the default process group (a no-op when one exists).

    torchrun sets RANK/WORLD_SIZE/MASTER_*; under srun they come from SLURM_PROCID/SLURM_NTASKS of a job step
    (parallel/world.py: not the sbatch script itself; the master from SLURM_LAUNCH_NODE_IPADDR and the job id,
    unless MASTER_ADDR/PORT are set, as slurm/launch.sh does); a lone process becomes rank 0 of 1 on a free local
    port. single_only: refuse a world larger than 1 (ValueError), for tools that run in one process.
    timeout_minutes: how long a collective may wait before it fails (the trainer's --distributed-timeout-minutes;
    torch's default otherwise)."""
    compat.ensure_cpu_compat()
    env = os.environ
    if torch.distributed.is_initialized():
        if single_only and torch.distributed.get_world_size() != 1:
            raise ValueError("this tool runs in one process; do not launch it with torchrun / srun")
        return
    if "RANK" not in env and in_slurm_step(env) and not single_only:
        env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"], LOCAL_RANK=env.get("SLURM_LOCALID", "0"))
        env.setdefault("MASTER_ADDR", env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    if single_only and int(env.get("WORLD_SIZE", "1")) != 1:
        raise ValueError("this tool runs in one process; do not launch it with torchrun / srun")
    if "RANK" not in env or "MASTER_PORT" not in env:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
    kwargs = {} if timeout_minutes is None else dict(timeout=timedelta(minutes=timeout_minutes))
    torch.distributed.init_process_group(backend=compat.dist_backend(), **kwargs)
