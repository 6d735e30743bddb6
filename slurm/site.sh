# Site settings for megatron-sat's Slurm scripts: THE one file to edit for a cluster.
#
# Sourced twice: by tools/submit_grid.py before `sbatch` (the SBATCH_* variables below are sbatch's own input
# environment variables: account, partition, QOS, ...), and by slurm/launch.sh inside every job (modules,
# container, Python, NCCL). Point MSAT_SITE at another file to use it instead (the tests do), e.g.
#     MSAT_SITE=$HOME/my_site.sh python tools/submit_grid.py ...
# Every setting is `${VAR:-default}`, so an environment variable set before submitting overrides it too.

# ---- submission (sbatch reads these; empty = the cluster's default)
export SBATCH_ACCOUNT=${SBATCH_ACCOUNT:-}         # e.g. my-project
export SBATCH_PARTITION=${SBATCH_PARTITION:-}     # e.g. gpu
export SBATCH_QOS=${SBATCH_QOS:-}                 # e.g. normal
for _v in SBATCH_ACCOUNT SBATCH_PARTITION SBATCH_QOS; do [ -n "${!_v}" ] || unset "$_v"; done; unset _v
MSAT_GPUS=${MSAT_GPUS:-1}                         # 0 on CPU-only clusters: no --gpus-per-node request
MSAT_CPUS_PER_TASK=${MSAT_CPUS_PER_TASK:-8}       # CPU cores per rank (data loading, host work)
MSAT_SBATCH_EXTRA=${MSAT_SBATCH_EXTRA:-}          # more sbatch flags, e.g. "--exclusive --constraint=h100"

# ---- where things go (relative paths are relative to the repository)
MSAT_RUNS=${MSAT_RUNS:-runs}                      # run folders: $MSAT_RUNS/<name from hyperparameters>
MSAT_LOGS=${MSAT_LOGS:-logs}                      # Slurm logs: <job name>-<job id>.out, <name>-<array>_<task>.out
MSAT_MAX_RESTARTS=${MSAT_MAX_RESTARTS:-20}        # self-requeues (time limit) before a run gives up

# ---- data (paper runs; the debug recipes use mock data and ignore these)
MSAT_DATA_PATH=${MSAT_DATA_PATH:-}                # indexed dataset prefix, e.g. /data/fineweb-edu/llama2_text_document
MSAT_TOKENIZER=${MSAT_TOKENIZER:-}                # e.g. /data/tokenizers/llama-2
MSAT_WANDB_PROJECT=${MSAT_WANDB_PROJECT:-}        # empty: no wandb

# ---- environment inside the job
msat_site_setup() {
    # modules (uncomment / edit):
    # module purge; module load cuda/12.4 nccl
    # Python: the repository's venv unless MSAT_PYTHON says otherwise (a container has its own)
    MSAT_PYTHON=${MSAT_PYTHON:-$MSAT_REPO/.venv/bin/python}
    [ -x "$MSAT_PYTHON" ] || MSAT_PYTHON=python3
    # container (pyxis/enroot): srun flags added to the training step, e.g.
    # MSAT_SRUN_EXTRA="--container-image=nvcr.io/nvidia/pytorch:25.01-py3 --container-mounts=/data:/data,$MSAT_REPO:$MSAT_REPO"
    MSAT_SRUN_EXTRA=${MSAT_SRUN_EXTRA:-}
    # NCCL / networking (InfiniBand example; leave unset to take NCCL's defaults)
    # export NCCL_IB_HCA=mlx5 NCCL_SOCKET_IFNAME=ib0 NCCL_IB_GID_INDEX=3
    export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}   # Megatron's TP/SP overlap wants 1
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    export PYTHONUNBUFFERED=1
}
