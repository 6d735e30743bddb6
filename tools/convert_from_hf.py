#!/usr/bin/env python
"""Import a Hugging Face folder (any of the six archs in the SATFormer authors' formats, or an official Qwen3 or
Llama checkpoint, Llama 3.1+'s RoPE scaling included) as a checkpoint that the trainer continues from, at any TP/PP
layout.

    python tools/convert_from_hf.py --hf hf/satformer --save runs/sat-import \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --lr 3e-5 --train-iters 1000
    megatron-sat-torchrun --nproc-per-node 4 -m megatron_sat.train --config runs/sat-import/config.json \\
        --pretrained-checkpoint runs/sat-import --save runs/sat-more --data-path DATA --seq-length 4096

Flags other than --hf, --save and --overwrite are the trainer's (python -m megatron_sat.train
--help): layout, LR schedule and optimizer; the model's shape comes from the HF config. --lr, --train-iters and
--seq-length not given here are placeholders in SAVE/config.json, which a run on it must give; the import prints
the command that continues pretraining. On a Qwen3 or Llama folder, --arch satformer starts a SATFormer whose zero
gate computes the Transformer's function. Writes SAVE/iter_0000000 (weights, fresh optimizer, LR schedule,
arguments) and points SAVE/latest_checkpointed_iteration.txt at it; details in megatron_sat/conversion/importer.py.
Exit codes: 0 done, 2 bad input.
"""

import argparse
import logging
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="any other flag is passed to the trainer's argument parser")
    p.add_argument("--hf", required=True, help="Hugging Face model folder")
    p.add_argument("--save", required=True, help="run folder to write the checkpoint into")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --save")
    args, trainer_argv = p.parse_known_args(argv)
    if not os.environ.get("MEGATRON_SAT_VERBOSE"):
        warnings.filterwarnings("ignore")
        logging.getLogger("megatron").setLevel(logging.ERROR)
    # torch and megatron-core after the arguments (--help and bad input answer at once) and the warning filter
    from megatron_sat.conversion import ConversionError, import_hf
    from megatron_sat.parallel.process_group import teardown

    try:
        import_hf(args.hf, args.save, trainer_argv, overwrite=args.overwrite)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
