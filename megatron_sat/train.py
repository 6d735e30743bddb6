"""Pretrain a Transformer, ResFormer or SATFormer (or the DenseFormer, MUDDFormer and Hyper-Connections
baselines) on Megatron-Core: one program, laptop CPU to GPU cluster.

    python -m megatron_sat.train --recipe demo                          # `make demo`: CPU, a few minutes
    python -m megatron_sat.train --recipe debug_satformer               # seconds, mock data (debug_<arch>)
    torchrun --nproc-per-node 4 -m megatron_sat.train --recipe debug_satformer \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    python -m megatron_sat.torchrun --nproc-per-node 4 -m megatron_sat.train ...   # preemptible: USR1 saves, exit 0
    srun -n 64 python -m megatron_sat.train --arch satformer --num-layers 24 --hidden-size 2048 \\
        --num-attention-heads 32 --seq-length 4096 --data-path DATA_PREFIX --tokenizer-model TOKENIZER \\
        --micro-batch-size 4 --global-batch-size 512 --train-iters 15000 --lr 8e-4 --min-lr 8e-5 \\
        --save runs/xl --load runs/xl --save-interval 500 --wandb-project satformer

(also installed as `megatron-sat-train`). `--help` lists every flag; see megatron_sat/training/.
Exit codes: 0 done or stopped cleanly (SIGTERM / SIGUSR1 / Ctrl-C / time limit, checkpoint saved), 2 bad
arguments, 3 NaN/Inf loss (nothing saved after the last good checkpoint), 4 a checkpoint could not be written,
75 a hung rank (--hang-timeout-minutes; retry: the rerun resumes), 130 a second Ctrl-C (stopped at once).
Set MEGATRON_SAT_VERBOSE=1 to see megatron-core's warnings and info messages.
"""

import logging
import sys

from megatron_sat.training.arguments import parse_run  # no torch, no megatron-core


def main(argv=None) -> int:
    resolution = parse_run(argv)  # exits with code 2 and a message on bad input, before any heavy import
    args = resolution.args
    # torch and megatron-core are imported after the arguments are parsed (--help and bad input answer at once)
    # and after the known harmless warnings are filtered (megatron-core warns at import)
    from megatron_sat.compat.known_warnings import quiet

    if quiet():  # False under MEGATRON_SAT_VERBOSE=1
        logging.getLogger("megatron").setLevel(logging.ERROR)
    from megatron_sat.parallel.process_group import teardown
    from megatron_sat.training.trainer import train

    task_runner = None
    if args.eval_tasks:  # lm-eval on the model being trained (the trainer may not import analysis/)
        from megatron_sat.analysis.training_tasks import TaskRunner as task_runner  # lm-eval: optional (eval extra)
    try:
        return train(args, task_runner=task_runner, resolution=resolution)
    finally:
        teardown()


if __name__ == "__main__":
    sys.exit(main())
