# Shared body of megatron-sat's sbatch scripts (sourced by train.sbatch, array.sbatch, profile.sbatch,
# preprocess.sbatch). They run from an installed package (megatron-sat-submit-grid passes MSAT_SLURM_DIR, the
# folder of these files) or from a source checkout (python tools/submit_grid.py also passes MSAT_REPO).
#
#   msat_init                       work folder, site settings ($MSAT_SITE or site.sh here), container, MASTER_ADDR/PORT
#   msat_python ARGS...             one short Python command where the ranks run (inside the container if any)
#   msat_tool NAME ARGS...          a tool of tools/ (tools/NAME.py of the checkout, or the installed megatron_sat_tools.NAME)
#   msat_train RECIPE [FLAGS...]    one training run: run folder from the hyperparameters, resume, requeue
#
# Launch model: one task per GPU through srun (not one torchrun per node). Slurm then starts, tracks and
# signals every rank itself: `scancel --signal` reaches each rank directly, --kill-on-bad-exit tears the step
# down when any rank dies, no second rendezvous is needed (rank/world/local rank come from SLURM_PROCID,
# SLURM_NTASKS, SLURM_LOCALID, which megatron_sat.train reads), and a container plugin (pyxis) wraps each
# task the same way. torchrun's agent would sit between Slurm and the ranks and does not forward SIGUSR1.
#
# Time limit and preemption. The scripts carry `#SBATCH --signal=B:USR1@180 --requeue --open-mode=append`:
#   1. 180 s before the limit Slurm sends USR1 to this batch shell; the trap forwards it to the training step
#      (`scancel --signal=USR1 $SLURM_JOB_ID`: every rank), the trainer saves at the next step and exits 0;
#   2. the shell sees an unfinished run that made progress and calls `scontrol requeue $SLURM_JOB_ID`; the
#      job goes back to the queue with the same id (log appended) and resumes from the run folder (--load).
#   SIGTERM (scancel, or preemption with PreemptMode=REQUEUE) reaches the ranks from Slurm directly; the
#   trainer also saves on it, and the shell does not requeue (a cancel means stop; Slurm requeues preempted
#   jobs itself). MSAT_REQUEUE=0 turns self-requeue off (tools/submit_grid.py --segments chains jobs instead).
#   A hung rank (the trainer's watchdog, --hang-timeout-minutes: exit 75 and RUN/.watchdog/hang.json) is requeued
#   too, up to MSAT_MAX_RESTARTS times, and resumes from the last checkpoint.

msat_die() { echo "megatron-sat slurm: error: $*" >&2; exit 2; }

msat_init() {
    MSAT_SLURM_DIR=${MSAT_SLURM_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
    if [ -z "${MSAT_REPO:-}" ] && [ -f "$MSAT_SLURM_DIR/../megatron_sat/train.py" ]; then
        MSAT_REPO=$(cd "$MSAT_SLURM_DIR/.." && pwd)  # these scripts are a checkout's slurm/ folder
    fi
    if [ -n "${MSAT_REPO:-}" ]; then  # a source checkout: its code first on the path
        [ -f "$MSAT_REPO/megatron_sat/train.py" ] || msat_die "MSAT_REPO=$MSAT_REPO is not a megatron-sat checkout (unset it to use the installed package)"
        export PYTHONPATH="$MSAT_REPO${PYTHONPATH:+:$PYTHONPATH}"
    fi
    # the jobs run where they were submitted from: relative paths (runs, logs, data) mean the same as there
    MSAT_WORKDIR=${MSAT_WORKDIR:-${SLURM_SUBMIT_DIR:-$PWD}}
    cd "$MSAT_WORKDIR" || msat_die "cannot cd to $MSAT_WORKDIR"
    local site=${MSAT_SITE:-$MSAT_SLURM_DIR/site.sh}
    [ -f "$site" ] || msat_die "site settings $site not found"
    # shellcheck disable=SC1090
    source "$site"
    msat_site_setup
    msat_container
    msat_python -c "import megatron_sat" 2>/dev/null || msat_die "megatron-sat does not import with $MSAT_PYTHON${MSAT_CONTAINER_IMAGE:+ in $MSAT_CONTAINER_IMAGE}: install it there (docs/install.md) or set MSAT_PYTHON in $site"
    # sbatch exports the submitting shell's environment: torchrun-style variables left there would give every
    # task the same rank, so ranks come from Slurm only, and the master from this job's node list.
    unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK
    # The rendezvous is the job's first node, by the address Slurm reaches it at (its NodeAddr, which defaults to
    # the node name): node names need not resolve (simulated nodes, some clusters' naming).
    local first addr
    first=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}" 2>/dev/null | head -n 1)
    addr=$(scontrol show node "$first" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | head -n 1 | cut -d= -f2)
    export MASTER_ADDR=${MSAT_MASTER_ADDR:-${addr:-${first:-$(hostname)}}}
    export MASTER_PORT=${MSAT_MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
    MSAT_SIGNAL=""
    MSAT_STEP_PID=""
    trap 'msat_on_usr1' USR1
    MSAT_REQUEUED=0
    trap '[ "$MSAT_REQUEUED" = 1 ] && exit 0; MSAT_SIGNAL=${MSAT_SIGNAL:-TERM}; echo "megatron-sat slurm: SIGTERM (cancel or preemption) at $(date +%T)"' TERM
}

msat_container() {  # srun flags (pyxis) or a command prefix (apptainer) from the site's container settings
    MSAT_SRUN_CONTAINER=()
    MSAT_EXEC=()
    [ -n "${MSAT_CONTAINER_IMAGE:-}" ] || return 0
    case "${MSAT_CONTAINER_RUNTIME:-pyxis}" in
        pyxis) MSAT_SRUN_CONTAINER=(--container-image="$MSAT_CONTAINER_IMAGE" --container-workdir="$PWD"
                                    ${MSAT_CONTAINER_MOUNTS:+--container-mounts="$MSAT_CONTAINER_MOUNTS"}) ;;
        apptainer | singularity) MSAT_EXEC=("$MSAT_CONTAINER_RUNTIME" exec --nv --pwd "$PWD"
                                            ${MSAT_CONTAINER_MOUNTS:+--bind "$MSAT_CONTAINER_MOUNTS"} "$MSAT_CONTAINER_IMAGE") ;;
        *) msat_die "MSAT_CONTAINER_RUNTIME=$MSAT_CONTAINER_RUNTIME: use pyxis or apptainer" ;;
    esac
}

msat_python() {  # one short Python command where the ranks run (a pyxis container needs a one-task srun step)
    if [ ${#MSAT_SRUN_CONTAINER[@]} -gt 0 ]; then
        srun --nodes=1 --ntasks=1 --export=ALL "${MSAT_SRUN_CONTAINER[@]}" "$MSAT_PYTHON" "$@"
    else
        "${MSAT_EXEC[@]}" "$MSAT_PYTHON" "$@"
    fi
}

msat_tool() {  # msat_tool NAME ARGS...: a command-line tool of tools/ (the checkout's, else the installed one)
    local name=$1
    shift
    if [ -n "${MSAT_REPO:-}" ]; then msat_python "$MSAT_REPO/tools/$name.py" "$@"; else msat_python -m "megatron_sat_tools.$name" "$@"; fi
}

msat_on_usr1() {
    MSAT_SIGNAL=USR1
    echo "megatron-sat slurm: USR1 at $(date +%T) (time limit near): asking every rank to checkpoint and exit"
    if [ -n "$MSAT_STEP_PID" ]; then
        scancel --signal=USR1 "$SLURM_JOB_ID" 2>/dev/null || kill -USR1 "$MSAT_STEP_PID" 2>/dev/null
    fi
}

msat_tracker() {  # latest complete checkpoint iteration of run folder $1 (0 when none)
    local it
    it=$(cat "$1/latest_checkpointed_iteration.txt" 2>/dev/null) || it=0
    echo "${it:-0}"
}

msat_wait_step() {  # wait for the background step, surviving trap interruptions; sets MSAT_RC
    while :; do
        wait "$MSAT_STEP_PID"
        MSAT_RC=$?
        if [ "$MSAT_RC" -gt 128 ] && kill -0 "$MSAT_STEP_PID" 2>/dev/null; then continue; fi
        break
    done
    MSAT_STEP_PID=""
}

msat_train() {
    [ $# -ge 1 ] || msat_die "usage: msat_train RECIPE [trainer flags...]"
    local recipe=$1
    shift
    # The run this job continues: its name is pinned at the job's first start (megatron_sat/sweep/pins.py), so that
    # a config file or recipe edited before a requeue is refused (exit 2, one line saying what changed) instead of
    # starting a new run at step 0 beside the half-trained one. One pin per sweep entry: array.sbatch sets MSAT_PIN
    # per manifest line; a plain job's is per job id.
    local pin=${MSAT_PIN:-}
    [ -z "$pin" ] && [ -n "${SLURM_JOB_ID:-}" ] && pin="$MSAT_RUNS/_grid/pins/job_${SLURM_JOB_ID}.json"
    local resolved rc
    export MSAT_JOB=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID:-}}
    MSAT_JOB=${MSAT_JOB:-${SLURM_JOB_ID:-}}  # recorded in the pin
    resolved=$(msat_tool submit_grid --resolve "$recipe" ${pin:+--pin "$pin"} -- "$@")
    rc=$?
    [ "$rc" -eq 2 ] && exit 2  # refused (the resolver's one line says why)
    [ "$rc" -eq 0 ] || msat_die "cannot resolve recipe $recipe $*"
    local RUN_NAME TRAIN_ITERS NEEDS_DATA
    eval "$resolved"
    local run_dir=${MSAT_RUN_DIR:-$MSAT_RUNS/$RUN_NAME}
    mkdir -p "$run_dir" || msat_die "cannot create $run_dir"
    local start
    start=$(msat_tracker "$run_dir")
    if [ "$start" -ge "$TRAIN_ITERS" ]; then
        echo "megatron-sat slurm: $run_dir is complete ($start/$TRAIN_ITERS steps); nothing to do"
        return 0
    fi
    local extra=()
    if [ "$NEEDS_DATA" = 1 ]; then
        [ -n "$MSAT_DATA_PATH" ] || msat_die "recipe $recipe needs data: set MSAT_DATA_PATH and MSAT_TOKENIZER in slurm/site.sh (or pass --data-path/--mock-data)"
        extra+=(--data-path "$MSAT_DATA_PATH")
        [ -n "$MSAT_TOKENIZER" ] && extra+=(--tokenizer-model "$MSAT_TOKENIZER")
    fi
    [ -n "$MSAT_WANDB_PROJECT" ] && extra+=(--wandb-project "$MSAT_WANDB_PROJECT" --wandb-exp-name "$RUN_NAME")
    echo "megatron-sat slurm: job ${SLURM_JOB_ID:-?}${SLURM_ARRAY_TASK_ID:+ (array ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID})}" \
         "restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-?}, ${SLURM_NTASKS:-1} tasks, master $MASTER_ADDR:$MASTER_PORT"
    echo "megatron-sat slurm: run $run_dir from step $start of $TRAIN_ITERS${MSAT_SWEEP:+ (sweep $MSAT_SWEEP: wandb group, config.json)}"
    local cmd=("$MSAT_PYTHON" -m megatron_sat.train --recipe "$recipe" "$@" "${extra[@]}"
               --save "$run_dir" --load "$run_dir" --no-progress-bar)
    echo "megatron-sat slurm: srun ${MSAT_SRUN_CONTAINER[*]} ${MSAT_EXEC[*]} ${cmd[*]}"
    local hang_marker="$run_dir/.watchdog/hang.json"
    rm -f "$hang_marker"
    # shellcheck disable=SC2086
    srun --kill-on-bad-exit=1 --export=ALL "${MSAT_SRUN_CONTAINER[@]}" $MSAT_SRUN_EXTRA "${MSAT_EXEC[@]}" "${cmd[@]}" &
    MSAT_STEP_PID=$!
    msat_wait_step
    local rc=$MSAT_RC now
    now=$(msat_tracker "$run_dir")
    if [ "$now" -ge "$TRAIN_ITERS" ]; then
        echo "megatron-sat slurm: run complete ($now/$TRAIN_ITERS steps) in $run_dir"
        return 0
    fi
    # A hung rank: the trainer's watchdog (--hang-timeout-minutes) exits 75 and writes the marker (srun reports
    # the highest code or signal of its tasks, so the ranks it kills may hide the 75). Requeue, progress or not.
    if [ "$rc" -ne 0 ] && { [ "$rc" -eq 75 ] || [ -f "$hang_marker" ]; }; then
        echo "megatron-sat slurm: the hang watchdog stopped the job (exit $rc) at checkpoint $now/$TRAIN_ITERS"
        if [ "${MSAT_REQUEUE:-1}" = 1 ] && [ "${SLURM_RESTART_COUNT:-0}" -lt "$MSAT_MAX_RESTARTS" ]; then
            echo "megatron-sat slurm: requeueing job $SLURM_JOB_ID to resume from step $now"
            MSAT_REQUEUED=1
            scontrol requeue "$SLURM_JOB_ID" || msat_die "scontrol requeue $SLURM_JOB_ID failed"
            sleep 5
            return 0
        fi
        echo "megatron-sat slurm: not requeueing (MSAT_REQUEUE=${MSAT_REQUEUE:-1}, restarts ${SLURM_RESTART_COUNT:-0} of $MSAT_MAX_RESTARTS)" >&2
        return 75
    fi
    if [ "$rc" -ne 0 ]; then
        echo "megatron-sat slurm: training exited $rc at checkpoint $now/$TRAIN_ITERS; not requeueing" >&2
        return "$rc"
    fi
    echo "megatron-sat slurm: stopped at checkpoint $now/$TRAIN_ITERS (${MSAT_SIGNAL:-no signal})"
    if [ "$MSAT_SIGNAL" = TERM ]; then
        return 0
    fi
    if [ "${MSAT_REQUEUE:-1}" = 1 ] && [ "$now" -gt "$start" ] && [ "${SLURM_RESTART_COUNT:-0}" -lt "$MSAT_MAX_RESTARTS" ]; then
        echo "megatron-sat slurm: requeueing job $SLURM_JOB_ID to continue from step $now"
        MSAT_REQUEUED=1
        scontrol requeue "$SLURM_JOB_ID" || msat_die "scontrol requeue $SLURM_JOB_ID failed"
        sleep 5  # the requeue ends this allocation; do not report a state before it does
        return 0
    fi
    echo "megatron-sat slurm: not requeueing (MSAT_REQUEUE=${MSAT_REQUEUE:-1}, restarts ${SLURM_RESTART_COUNT:-0}, progress $start -> $now)"
    return 0
}
