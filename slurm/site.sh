# Site settings for megatron-sat's Slurm scripts: THE one file to edit for a cluster.
#
# Sourced twice: by megatron-sat-submit-grid (tools/submit_grid.py) before `sbatch` (the SBATCH_* variables below
# are sbatch's own input environment variables: account, partition, QOS, ...), and by launch.sh inside every job
# (modules, container, Python, NCCL). Keep a copy of your own next to your runs and point MSAT_SITE at it:
#     cp "$(megatron-sat-submit-grid --slurm-dir)/site.sh" site.sh && export MSAT_SITE=$PWD/site.sh
# Every setting is `${VAR:-default}`, so an environment variable set before submitting overrides it too.
# Relative paths are relative to the folder you submit from (the jobs run there: SLURM_SUBMIT_DIR).

# ---- submission (sbatch reads these; empty = the cluster's default)
export SBATCH_ACCOUNT=${SBATCH_ACCOUNT:-}         # e.g. my-project
export SBATCH_PARTITION=${SBATCH_PARTITION:-}     # e.g. gpu
export SBATCH_QOS=${SBATCH_QOS:-}                 # e.g. normal
for _v in SBATCH_ACCOUNT SBATCH_PARTITION SBATCH_QOS; do [ -n "${!_v}" ] || unset "$_v"; done; unset _v
MSAT_GPUS=${MSAT_GPUS:-1}                         # 0 on CPU-only clusters: no --gpus-per-node request
MSAT_CPUS_PER_TASK=${MSAT_CPUS_PER_TASK:-8}       # CPU cores per rank (data loading, host work)
MSAT_SBATCH_EXTRA=${MSAT_SBATCH_EXTRA:-}          # more sbatch flags, e.g. "--exclusive --constraint=h100"

# ---- where things go (relative paths: relative to the folder you submit from)
MSAT_RUNS=${MSAT_RUNS:-runs}                      # run folders: $MSAT_RUNS/<name from hyperparameters>
MSAT_LOGS=${MSAT_LOGS:-logs}                      # Slurm logs: <job name>-<job id>.out, <name>-<array>_<task>.out
MSAT_MAX_RESTARTS=${MSAT_MAX_RESTARTS:-20}        # self-requeues (time limit) before a run gives up

# ---- data (paper runs; the debug recipes use mock data and ignore these)
MSAT_DATA_PATH=${MSAT_DATA_PATH:-}                # indexed dataset prefix, e.g. /data/fineweb-edu/llama2_text_document
MSAT_TOKENIZER=${MSAT_TOKENIZER:-}                # e.g. /data/tokenizers/llama-2
MSAT_WANDB_PROJECT=${MSAT_WANDB_PROJECT:-}        # empty: no wandb

# ---- container: the image every rank runs in (docs/install.md builds it); empty = the Python of MSAT_PYTHON
MSAT_CONTAINER_IMAGE=${MSAT_CONTAINER_IMAGE:-}    # e.g. /shared/images/megatron-sat.sqsh (pyxis) or .sif (apptainer)
MSAT_CONTAINER_RUNTIME=${MSAT_CONTAINER_RUNTIME:-pyxis}   # pyxis (srun --container-image) or apptainer
MSAT_CONTAINER_MOUNTS=${MSAT_CONTAINER_MOUNTS:-}  # e.g. /data:/data,/shared/me:/shared/me (data, runs, this folder)

# ---- environment inside the job
msat_site_setup() {
    # modules (uncomment / edit):
    # module purge; module load cuda/12.4 nccl
    # Python: in a container its own python3 (MSAT_CONTAINER_PYTHON to change); otherwise MSAT_PYTHON
    # (megatron-sat-submit-grid passes the Python it runs under), else a source checkout's .venv, else python3
    if [ -n "$MSAT_CONTAINER_IMAGE" ]; then
        MSAT_PYTHON=${MSAT_CONTAINER_PYTHON:-python3}
    else
        MSAT_PYTHON=${MSAT_PYTHON:-${MSAT_REPO:+$MSAT_REPO/.venv/bin/python}}
        { [ -n "$MSAT_PYTHON" ] && command -v "$MSAT_PYTHON" >/dev/null 2>&1; } || MSAT_PYTHON=python3
    fi
    # more srun flags for the training step, e.g. "--cpu-bind=none --mpi=pmix"
    MSAT_SRUN_EXTRA=${MSAT_SRUN_EXTRA:-}
    # NCCL / networking (InfiniBand example; leave unset to take NCCL's defaults)
    # export NCCL_IB_HCA=mlx5 NCCL_SOCKET_IFNAME=ib0 NCCL_IB_GID_INDEX=3
    export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}   # Megatron's TP/SP overlap wants 1
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    export PYTHONUNBUFFERED=1
}
