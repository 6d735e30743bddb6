#!/usr/bin/env python
"""Tokenize a corpus (jsonl, .jsonl.gz/.zst, parquet, txt, Hugging Face datasets) into a Megatron indexed dataset
(.bin + .idx) for megatron-sat.

Exact command (from the repository root)::

    python tools/preprocess_data.py \\
        --input data/raw/corpus.jsonl \\
        --tokenizer /path/to/Llama-2-7b-hf \\
        --output-prefix data/corpus_text_document \\
        --workers 8

This writes ``data/corpus_text_document.bin``, ``.idx`` and ``.meta.json``; pass
``data/corpus_text_document`` to the trainer as its data path (or in a blend).

Sharded (a Slurm job array, slurm/preprocess.sbatch; one dataset per input file, finished ones skipped)::

    python tools/preprocess_data.py --input shards/ --tokenizer TOK --shard-dir data/shards \
        --task-index 0 --num-tasks 4 --workers 8        # ... for each task 0..3, then
    python tools/merge_datasets.py --shard-dir data/shards --output-prefix data/corpus_text_document

* ``--input`` takes one or more .jsonl/.json files, optionally .gz or .zst compressed (one JSON
  object per line; the document is the field named by ``--json-key``, default ``text``), .parquet
  files (``--json-key`` names the text column; read by row batches), .txt files (``--txt-mode``:
  the whole file, each paragraph, or each line is a document), folders (searched recursively) or
  globs of them, a folder written by ``datasets``' ``save_to_disk`` (``--hf-split``), or a hub
  dataset name ``ORG/NAME`` (``hf:ORG/NAME/sub/folder`` for part of it): its snapshot in the local
  Hugging Face cache, streamed from the hub only when not cached and the hub can be reached.
* ``--workers N`` tokenizer processes, each reading and tokenizing chunks of ``--chunksize`` documents (plain
  jsonl: blocks of chunksize x 4 KiB); the output is byte-identical for any N. A byte-level BPE runs on tiktoken
  where a check at start proves it gives the tokenizer's own ids (else the Rust ``tokenizers`` library, with a
  one-line note; ``--no-fast-bpe`` forces it). See docs/preprocessing_speed.md.
* ``--tokenizer`` is a local Hugging Face tokenizer folder (the paper uses the Llama-2
  tokenizer, 32,000 tokens), a ``tokenizer.json`` file, or a hub name where the hub is
  reachable.
* With no corpus and no tokenizer at hand, build the embedded default corpus (the Python
  language reference and standard-library docstrings, no download) and a BPE tokenizer::

      python tools/preprocess_data.py --default-corpus data/raw \\
          --train-tokenizer data/tokenizer --vocab-size 8192 \\
          --output-prefix data/default_text_document

Megatron-LM's command line works unchanged (its tools/preprocess_data.py flags), with the same .bin/.idx bytes
as the native flags::

    python tools/preprocess_data.py --input data.jsonl --output-prefix processed_data \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model /path/to/tokenizer --workers 8 --append-eod
    # writes processed_data_text_document.{bin,idx} (Megatron-LM's names: PREFIX_KEY_document per --json-keys
    # key), the same bytes as --tokenizer /path/to/tokenizer --output-prefix processed_data_text_document

With --tokenizer-type (Megatron-LM's command line) the end-of-document token is appended only with
--append-eod, as in Megatron-LM; with the native flags every document gets it (--no-eod to leave it out).
--partitions, --log-interval and --keep-sequential-samples are accepted and change nothing (one ordered
pass, any --workers gives the same bytes); sentence splitting (--split-sentences) is not done here.

Bad input (a missing, corrupt or empty
input file, a missing column, a line that is not JSON or not UTF-8, an unloadable tokenizer, an
unwritable output folder) exits 2 with a one-line message naming the file and line or row; the
outputs are written aside and moved into place at the end, so nothing is left half-written.
``--skip-bad`` skips and counts bad documents and empty shards instead (reported in the summary).
The same logic is importable::

    from tools.preprocess_data import preprocess   # or megatron_sat.data.preprocess
    preprocess(["a.jsonl"], "/path/to/tokenizer", "data/a_text_document", workers=4)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

try:
    import megatron_sat  # noqa: F401
except ImportError:  # run from a checkout without installing: put the repo root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat.data.corpus import write_default_corpus
from megatron_sat.data.preprocess import DEFAULT_CHUNKSIZE, PreprocessResult, preprocess
from megatron_sat.data.readers import expand_inputs
from megatron_sat.data.shards import preprocess_shards
from megatron_sat.data.tokenizer import train_bpe_tokenizer

__all__ = ["preprocess", "PreprocessResult", "main"]


def get_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Tokenize jsonl/txt into a Megatron .bin/.idx dataset (megatron-sat).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--input", nargs="+", default=None,
                   help="inputs: .jsonl/.json (.gz, .zst), .parquet, .txt files, folders or globs of them, "
                        "save_to_disk folders, hub dataset names")
    p.add_argument("--default-corpus", metavar="DIR", default=None,
                   help="write the embedded default corpus to DIR/default_corpus.jsonl and "
                        "use it as (additional) input")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder, tokenizer.json file, or hub name")
    p.add_argument("--train-tokenizer", metavar="DIR", default=None,
                   help="train a byte-level BPE on the inputs, save it to DIR, and use it")
    p.add_argument("--vocab-size", type=int, default=8192,
                   help="vocabulary size for --train-tokenizer")
    p.add_argument("--output-prefix", default=None,
                   help="output path prefix; writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json")
    p.add_argument("--shard-dir", default=None, metavar="DIR",
                   help="instead of --output-prefix: one dataset per input file in DIR (finished ones skipped), "
                        "this task's group only (--task-index/--num-tasks); join them with tools/merge_datasets.py")
    p.add_argument("--task-index", type=int, default=None,
                   help="with --shard-dir: this task (default: the Slurm array task id - its minimum, else 0)")
    p.add_argument("--num-tasks", type=int, default=None,
                   help="with --shard-dir: tasks in all (default: the Slurm array task count, else 1)")
    p.add_argument("--json-key", default="text", help="jsonl field / parquet or dataset column holding the text")
    p.add_argument("--hf-split", default="train", help="split of a save_to_disk folder or hub dataset")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip and count bad documents (not JSON, not UTF-8, no text) and empty shards instead "
                        "of stopping at the first")
    p.add_argument("--txt-mode", choices=["file", "paragraph", "line"], default="file",
                   help="what one document is in a .txt input")
    p.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)),
                   help="tokenizer processes")
    p.add_argument("--chunksize", type=int, default=DEFAULT_CHUNKSIZE,
                   help="documents per chunk a worker tokenizes in one batch call (output does not depend on it)")
    p.add_argument("--eod-token", default=None,
                   help="end-of-document token text (default: the tokenizer's eos token)")
    p.add_argument("--add-bos", action="store_true", help="prepend the bos token to documents")
    p.add_argument("--no-eod", action="store_true", help="do not append the eod token")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-fast-bpe", action="store_true",
                   help="always tokenize with the tokenizers library (by default a byte-level BPE runs on tiktoken "
                        "where that is checked to give the tokenizer's own ids)")
    m = p.add_argument_group("Megatron-LM's command line (tools/preprocess_data.py of Megatron-LM)").add_argument
    m("--tokenizer-type", default=None, metavar="TYPE",
      help="HuggingFaceTokenizer (with --tokenizer-model); selects Megatron-LM's output names and --append-eod")
    m("--tokenizer-model", default=None, help="= --tokenizer (a tokenizer folder, tokenizer.json or hub name)")
    m("--json-keys", nargs="+", default=None, metavar="KEY",
      help="keys to tokenize, one dataset PREFIX_KEY_document per key (with --tokenizer-type)")
    m("--append-eod", action="store_true", help="with --tokenizer-type: append the eod token (Megatron-LM)")
    m("--vocab-file", default=None, help=argparse.SUPPRESS)
    m("--merge-file", default=None, help=argparse.SUPPRESS)
    m("--split-sentences", action="store_true", help="refused: sentence splitting is not done here")
    m("--keep-newlines", action="store_true", help="accepted with no effect (it goes with --split-sentences)")
    m("--lang", default="english", help="accepted with no effect (it goes with --split-sentences)")
    m("--partitions", type=int, default=1, help="accepted with no effect: one ordered pass")
    m("--log-interval", type=int, default=None, help="accepted with no effect: a progress bar reports")
    m("--keep-sequential-samples", action="store_true", help="accepted with no effect: the order is always kept")
    args = p.parse_args(argv)
    _megatron_lm_form(p, args)
    if not args.input and not args.default_corpus:
        p.error("give --input and/or --default-corpus")
    if (args.output_prefix is None) == (args.shard_dir is None):
        p.error("give exactly one of --output-prefix and --shard-dir")
    env = os.environ
    if args.task_index is None:
        args.task_index = int(env.get("SLURM_ARRAY_TASK_ID", 0)) - int(env.get("SLURM_ARRAY_TASK_MIN", 0))
    if args.num_tasks is None:
        args.num_tasks = int(env.get("SLURM_ARRAY_TASK_COUNT", 1))
    if args.shard_dir and len(args.keys) > 1:
        p.error("--shard-dir takes one text key: run once per --json-keys key, each with its own --shard-dir")
    if args.shard_dir and not 0 <= args.task_index < args.num_tasks:
        p.error(f"--task-index {args.task_index} must be in 0..{args.num_tasks - 1} (--num-tasks {args.num_tasks})")
    if (args.tokenizer is None) == (args.train_tokenizer is None):
        p.error("give exactly one of --tokenizer and --train-tokenizer")
    if args.workers < 1:
        p.error("--workers must be >= 1")
    return args


def _megatron_lm_form(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Map Megatron-LM's flags onto the native ones: args.keys (the text fields) and args.prefixes (the output
    prefix of each), args.append_eod."""
    if args.tokenizer_model is not None:
        if args.tokenizer is not None and args.tokenizer != args.tokenizer_model:
            p.error("give --tokenizer or --tokenizer-model, not both")
        args.tokenizer = args.tokenizer_model
    megatron = args.tokenizer_type is not None
    if megatron and args.tokenizer_type != "HuggingFaceTokenizer":
        p.error(f"--tokenizer-type {args.tokenizer_type} is not read here: use --tokenizer-type HuggingFaceTokenizer "
                "--tokenizer-model DIR (a Hugging Face tokenizer folder, tokenizer.json or hub name)")
    if args.vocab_file or args.merge_file:
        p.error("--vocab-file / --merge-file (GPT2BPETokenizer) are not read here: pass the tokenizer as a Hugging "
                "Face folder or tokenizer.json with --tokenizer-type HuggingFaceTokenizer --tokenizer-model")
    if args.split_sentences:
        p.error("--split-sentences is not supported: documents are tokenized whole (drop the flag)")
    if args.json_keys and not megatron and len(args.json_keys) > 1:
        p.error("several --json-keys need --tokenizer-type (Megatron-LM's output names PREFIX_KEY_document)")
    args.keys = list(args.json_keys or [args.json_key])
    args.append_eod = args.append_eod if megatron else not args.no_eod
    if megatron and args.no_eod:
        p.error("with --tokenizer-type, leave out --append-eod instead of giving --no-eod")
    if megatron and args.output_prefix is not None:  # Megatron-LM's names: PREFIX_KEY_document
        args.prefixes = [f"{args.output_prefix}_{key}_document" for key in args.keys]
    else:
        args.prefixes = [args.output_prefix]


def main(argv=None) -> int:
    """Run the tool: 0 when done (the console script's exit status); a bad input exits 2 with its one-line
    message."""
    try:
        _main(argv)
        return 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        raise


def _main(argv=None) -> PreprocessResult:
    args = get_args(argv)
    inputs = list(args.input or [])
    if args.default_corpus:
        info = write_default_corpus(args.default_corpus)
        print(f"preprocess_data: default corpus {info.path}: {info.num_docs} documents, "
              f"{info.num_chars:,} characters (Python {info.python_version})", flush=True)
        inputs.append(info.path)
    tokenizer = args.tokenizer
    if args.train_tokenizer:
        t0 = time.time()
        try:
            expand_inputs(inputs)
            tokenizer = train_bpe_tokenizer(inputs, args.vocab_size, args.train_tokenizer,
                                            json_key=args.keys[0])
        except (OSError, ValueError) as e:
            raise SystemExit(f"preprocess_data: error: {e}") from None
        print(f"preprocess_data: trained byte-level BPE (vocab {tokenizer.vocab_size}) in "
              f"{time.time() - t0:.1f} s -> {args.train_tokenizer}", flush=True)
    kwargs = dict(
        workers=args.workers,
        json_key=args.keys[0],
        txt_mode=args.txt_mode,
        append_eod=args.append_eod,
        add_bos=args.add_bos,
        chunksize=args.chunksize,
        progress=not args.quiet,
        eod_token=args.eod_token,
        skip_bad=args.skip_bad,
        hf_split=args.hf_split,
        fast_bpe=not args.no_fast_bpe,
    )
    if args.shard_dir:
        return preprocess_shards(inputs, tokenizer, args.shard_dir, args.task_index, args.num_tasks, **kwargs)
    for key, prefix in zip(args.keys, args.prefixes):
        result = preprocess(inputs, tokenizer, prefix, **dict(kwargs, json_key=key))
        if args.quiet or len(args.keys) > 1:
            print(result.summary(), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
