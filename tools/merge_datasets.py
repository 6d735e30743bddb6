#!/usr/bin/env python
"""Join indexed datasets (the shards of slurm/preprocess.sbatch) into one dataset, or into a blend file.

Exact commands (from the repository root)::

    python tools/merge_datasets.py --shard-dir data/shards --output-prefix data/corpus_text_document
    python tools/merge_datasets.py --input data/a_text_document data/b_text_document --output-prefix data/ab
    python tools/merge_datasets.py --shard-dir data/shards --blend-file data/corpus.blend   # no copy:
    python -m megatron_sat.train ... --data-path $(cat data/corpus.blend)

--shard-dir takes every shard listed in DIR/shards.json, in input order, and refuses to merge while any is
unfinished (it names them: rerun the array job, which skips the finished ones). The merged dataset is the shards
back to back (megatron-core's IndexedDatasetBuilder.add_index), byte-identical to preprocessing all inputs in one
process; it is written aside and moved into place. A blend file lists "tokens prefix" pairs (weights = token
counts). Bad input (missing or unfinished shards, datasets of different tokenizers, a dataset without its
.meta.json, whose tokenizer is unknown: --allow-missing-meta merges it anyway, the merged .meta.json then records
no tokenizer) exits 2 with one line.
"""

import argparse
import os
import sys

try:
    import megatron_sat  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat.data.shards import merge_datasets, shard_prefixes, write_blend


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--shard-dir", help="a folder written by tools/preprocess_data.py --shard-dir")
    src.add_argument("--input", nargs="+", help="dataset prefixes, in order")
    p.add_argument("--output-prefix", default=None, help="write the merged dataset PREFIX.bin/.idx/.meta.json")
    p.add_argument("--blend-file", default=None, help="write a blend 'tokens prefix ...' to this file")
    p.add_argument("--allow-missing-meta", action="store_true",
                   help="merge datasets without a .meta.json (their tokenizer unknown); the merged .meta.json then "
                        "records no tokenizer")
    args = p.parse_args(argv)
    if not args.output_prefix and not args.blend_file:
        p.error("give --output-prefix and/or --blend-file")
    try:
        prefixes = shard_prefixes(args.shard_dir) if args.shard_dir else args.input
        if args.output_prefix:
            meta = merge_datasets(prefixes, args.output_prefix, args.allow_missing_meta)
            print(f"merge_datasets: {len(prefixes)} datasets, {meta['num_docs']:,} documents, "
                  f"{meta['num_tokens']:,} tokens -> {meta['output_prefix']}.bin/.idx", flush=True)
        if args.blend_file:
            write_blend(prefixes, args.blend_file, args.allow_missing_meta)
            print(f"merge_datasets: blend of {len(prefixes)} datasets -> {args.blend_file}", flush=True)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr, flush=True)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
