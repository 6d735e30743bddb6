"""The RNG round trip of a trainer checkpoint (tests/test_faults.py::test_rng_state_round_trip).

    python tests/workers/checkpoint_rng.py TMP_DIR

One rank: a tiny SATFormer, its optimizer and scheduler, one step; save a checkpoint, then draw from every
generator the checkpoint holds (Python, NumPy, torch, Megatron's model-parallel RNG tracker). Scramble
them all, resume the checkpoint, draw again: the draws must be equal, so that anything random after a
resume (dropout today is 0, but not in every recipe) repeats what the uninterrupted run drew.
"""

import os
import random
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conversion import _args, _build, _step, _wrap  # (tests/workers/conversion.py)


def draws() -> list:
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():  # the stream dropout in TP regions draws from
        tracked = torch.rand(3).tolist()
    return [random.random(), float(np.random.rand()), torch.rand(3).tolist(), tracked]


def main(root: str) -> None:
    from megatron_sat.conversion.megatron_io import init_single_process
    from megatron_sat.training import checkpointing as ckpt

    init_single_process()
    args = _args("satformer")
    config, chunks = _build(args)
    chunks, opt, sched = _wrap(config, chunks, args)
    _step(chunks, opt, config, num_micro=2)  # the optimizer has state to save
    run = os.path.join(root, "run")
    ckpt.save_checkpoint(run, 3, chunks, opt, sched, consumed_samples=6, args=vars(args))
    after_save = draws()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(99)
    assert draws() != after_save, "scrambling the generators changed nothing: the check below would be empty"
    point = ckpt.find_resume_point(run, log=print)
    assert point is not None and point.verified, "the checkpoint was not verified against its manifest"
    loaded = ckpt.restore(point, chunks, opt, sched)
    assert loaded["rng_restored"] and loaded["iteration"] == 3
    after_resume = draws()
    assert after_resume == after_save, (after_save, after_resume)
    print("draws after the resume equal those after the save:", after_resume)


if __name__ == "__main__":
    main(sys.argv[1])
