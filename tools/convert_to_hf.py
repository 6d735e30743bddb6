#!/usr/bin/env python
"""Export a megatron_sat checkpoint (saved at any TP/PP/VPP layout) as a Hugging Face folder, on CPU.

    python tools/convert_to_hf.py --load runs/satformer --output hf/satformer
    python tools/convert_to_hf.py --load runs/satformer/iter_0002000 --output hf/sat-2k --dtype bfloat16 --verify

--load is a run folder (its latest complete iteration, per latest_checkpointed_iteration.txt) or
one iter_XXXXXXX folder; its files are checked against the checkpoint's manifest.json first, as the trainer
checks a resume (a flipped byte or a truncated shard: one line, exit 2; --no-verify-checkpoint to skip). An
unfinished checkpoint (iter_XXXXXXX.tmp, a save in progress) is never read. The output loads offline with
    transformers.AutoModelForCausalLM.from_pretrained(HF_DIR, trust_remote_code=True)
SATFormer, ResFormer, DenseFormer, MUDDFormer, Hyper-Connections: the SATFormer authors' classes and
names, modeling code in the folder; Transformer: transformers' Qwen3 (q/k norm eps set by a subclass).
The tokenizer the run recorded is saved with it (or --tokenizer), found from any working folder (config.json records
its absolute path; for older runs a relative path is tried from the folder the run was launched in, then from here).
A recorded tokenizer that cannot be found stops the export (exit 2, naming the paths tried) unless --no-tokenizer.
The folder is written aside and moved into place when complete. Exit codes: 0 done, 2 bad input, 1 --verify found
the export's logits more than 1e-4 from the checkpoint's (max |a - b| over max |a|, float32; seen about 1e-6).
"""

import argparse
import logging
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="run folder or iter_XXXXXXX folder")
    p.add_argument("--output", required=True, help="HF folder to create")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights dtype (auto: as stored in the checkpoint)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", default=None, help="tokenizer to save with it (default: the run's)")
    tok.add_argument("--no-tokenizer", action="store_true",
                     help="export the model without a tokenizer (where the run's cannot be found)")
    p.add_argument("--max-shard-size-mb", type=int, default=5120, help="split safetensors above this size")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--verify", action="store_true", help="compare the logits of both models on random tokens")
    p.add_argument("--no-verify-checkpoint", dest="verify_checkpoint", action="store_false",
                   help="read the checkpoint without checking its files against its manifest.json (as the trainer's "
                        "flag of that name)")
    args = p.parse_args(argv)
    if not os.environ.get("MEGATRON_SAT_VERBOSE"):
        warnings.filterwarnings("ignore")
        logging.getLogger("megatron").setLevel(logging.ERROR)
    # torch and megatron-core after the arguments (--help and bad input answer at once) and the warning filter
    from megatron_sat.conversion import ConversionError, export_checkpoint
    from megatron_sat.conversion.export import verify_failure
    from megatron_sat.parallel.process_group import teardown

    try:
        info = export_checkpoint(args.load, args.output, dtype=args.dtype, overwrite=args.overwrite,
                                 tokenizer=args.tokenizer, max_shard_bytes=args.max_shard_size_mb * 1024 * 1024,
                                 verify=args.verify, verify_checkpoint=args.verify_checkpoint,
                                 no_tokenizer=args.no_tokenizer)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        teardown()
    failure = verify_failure(info["max_rel_diff"]) if args.verify else None  # both in float32, the same weights
    if failure:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
