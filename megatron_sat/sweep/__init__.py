"""A sweep of training runs on Slurm, from its plan to its jobs' final states (no torch, no megatron-core at import:
slurm/launch.sh resolves a run's name through it at every job start).

    plan.py      the grid's entries (archs x scales x seeds), each entry's trainer arguments resolved as the trainer
                 resolves them, its run-folder name and plan, the job arrays and their sbatch arguments
    submit.py    what tools/submit_grid.py does with a plan: layout dry runs, manifests, sbatch calls, the record
    records.py   <runs>/_grid/<sweep>.json: the job arrays a sweep submitted, its entries without a run folder yet,
                 waiting for its jobs
    pins.py      a job's run name fixed at its first start, so that a config or recipe edited before a requeue is
                 refused in one line instead of starting a new run at step 0
    slurm.py     Slurm's view: squeue's live states, sacct's final states (TIMEOUT, NODE_FAIL, ...) into the rows

The rows of the runs themselves (one per run folder) are megatron_sat/analysis/grid.py's.
"""
