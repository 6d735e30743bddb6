"""The trainer's data: the embedded default corpus (built once and cached), indexed datasets, or
mock tokens, and each rank's train / validation micro-batch iterators.

Embedded data (--embedded-data DIR), built by global rank 0 while the others wait:
    DIR/raw/default_corpus.jsonl        Python's own documentation (megatron_sat.data.corpus)
    DIR/tokenizer/                      byte-level BPE trained on it (--vocab-size)
    DIR/default_text_document.{bin,idx} the tokenized corpus
A rerun finds DIR/READY (written last) and skips all three.

Validation: every run scores the same validation samples whatever its --seed (the validation split is
shuffled with VALIDATION_SEED; the training order still follows --seed), so that the seeds and archs of a
sweep are compared on identical text. build_iterators records what identifies them (a hash of the scored
token ids) as args.validation_set, which config.json carries.
"""

import fcntl
import hashlib
import json
import os
import time

import torch
from megatron.core import parallel_state

from megatron_sat.data import (
    NullTokenizer,
    build_data_loader,
    build_datasets,
    load_tokenizer,
    parse_blend,
    preprocess,
    train_bpe_tokenizer,
    write_default_corpus,
)
from megatron_sat.data.checks import DataError, check_dataset, epochs_needed, split_errors
from megatron_sat.training.argument_checks import data_spec, parse_split

READY = "READY"
# seed of the validation split's shuffle, the same for every run (1234, the recipes' default --seed, so that
# a run with the default seed scores the validation samples it scored before this seed was split off)
VALIDATION_SEED = 1234


def prepare_embedded(directory: str, vocab_size: int, log=print) -> tuple:
    """(dataset prefix, tokenizer folder) of the embedded corpus in `directory`, building it if needed."""
    prefix = os.path.join(directory, "default_text_document")
    tok_dir = os.path.join(directory, "tokenizer")
    ready = os.path.join(directory, READY)
    if torch.distributed.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        lock = open(os.path.join(directory, ".lock"), "w")
        fcntl.flock(lock, fcntl.LOCK_EX)  # runs started together (a job array) build it once; the others wait
        stamp = None
        if os.path.isfile(ready):
            with open(ready) as f:
                stamp = json.load(f)
        if stamp is None or stamp.get("vocab_size") != vocab_size:
            t0 = time.time()
            log(f"preparing the embedded corpus in {directory} (once; later runs reuse it) ...")
            info = write_default_corpus(os.path.join(directory, "raw"))
            tok = train_bpe_tokenizer([info.path], vocab_size, tok_dir)
            result = preprocess([info.path], tok, prefix, workers=1, progress=False)
            with open(ready + ".tmp", "w") as f:
                json.dump(dict(vocab_size=vocab_size, docs=info.num_docs, tokens=result.num_tokens), f)
            os.replace(ready + ".tmp", ready)
            log(f"  {info.num_docs} documents, {result.num_tokens:,} tokens, BPE vocabulary {vocab_size} "
                f"({time.time() - t0:.0f} s)")
        else:
            log(f"reusing the embedded corpus in {directory} ({stamp['tokens']:,} tokens)")
        lock.close()
    torch.distributed.barrier()
    return prefix, tok_dir


def tokenizer_and_data(args, log=print):
    """(tokenizer, data spec) for the chosen data source, checked (DataError: the trainer exits 2)."""
    if args.mock_data:  # synthetic tokens over --vocab-size ids, else over the given tokenizer's vocabulary
        if args.vocab_size:
            return NullTokenizer(args.vocab_size), None
        try:
            return NullTokenizer(load_tokenizer(args.tokenizer_model).vocab_size), None
        except (OSError, ValueError) as e:
            raise DataError(f"--tokenizer-model: {e}") from None
    if args.embedded_data:
        prefix, tok_dir = prepare_embedded(args.embedded_data, args.vocab_size or 4096, log)
        tokenizer, data = load_tokenizer(tok_dir), prefix
    else:
        try:
            tokenizer = load_tokenizer(args.tokenizer_model)
        except (OSError, ValueError) as e:
            raise DataError(f"--tokenizer-model: {e}") from None
        data = data_spec(args)  # a blend string, or {"train", "valid", "test"} blends (--train-data-path ...)
    _check_on_rank0(args, tokenizer, data, log)
    return tokenizer, data


def _check_on_rank0(args, tokenizer, data, log) -> None:
    """data/checks.py on global rank 0 (it may scan the .bin files), the verdict broadcast to every rank."""
    verdict = [None]
    if torch.distributed.get_rank() == 0:
        try:
            # --data-path: every prefix, cut by --split; per-split paths: all checked, the train blend is trained on
            blends = data if isinstance(data, dict) else {"train": data}
            shares = parse_split(args.split) if not isinstance(data, dict) else [1.0, 0.0, 0.0]
            tokens = 0
            evals = getattr(args, "eval_samples_effective", None) or args.eval_iters * args.global_batch_size
            for name, blend in blends.items():
                for prefix in parse_blend(blend)[0] if blend else []:
                    found = check_dataset(prefix, tokenizer, args.allow_tokenizer_mismatch)
                    tokens += found["tokens"] if name == "train" else 0
                    if not isinstance(data, dict):  # --data-path: --split divides each dataset by documents
                        errors = split_errors(prefix, found["documents"], shares,
                                              (1, evals, evals if has_test_split(args) else 0))
                        if errors:
                            raise DataError(errors[0])
            epochs = epochs_needed(tokens, shares, args.train_iters * args.global_batch_size, args.seq_length)
            if epochs > 10:
                log(f"warning: {args.train_iters} steps of {args.global_batch_size} x {args.seq_length + 1} tokens "
                    f"need {epochs:.0f} passes over the training split of {data} ({tokens:,} tokens in all): "
                    "the model will see the same text many times")
        except (DataError, ValueError) as e:
            verdict[0] = str(e)
    torch.distributed.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise DataError(verdict[0])


def build_iterators(args, tokenizer, data, consumed_samples: int):
    """(train iterator from consumed_samples, function returning a fresh validation iterator or None, function
    returning a fresh test iterator or None). The test split (--split's third share, or --test-data-path) is
    scored at the end of training, as Megatron-LM does, with as many samples as an evaluation."""
    evals = getattr(args, "eval_samples_effective", None) or args.eval_iters * args.global_batch_size
    evals = evals if args.eval_interval or args.eval_iters else 0
    cache = args.data_cache_path or (os.path.join(args.save, "data_cache") if args.save else None)
    datasets = build_datasets(
        data, tokenizer, seq_length=args.seq_length,
        num_samples=(args.train_iters * args.global_batch_size, evals, evals if has_test_split(args) else 0),
        split=args.split, seed=args.seed, valid_seed=VALIDATION_SEED, mock=args.mock_data, cache_dir=cache,
        mmap_bin_files=getattr(args, "mmap_bin_files", True),
    )
    if torch.distributed.get_rank() == 0 and datasets.valid is not None and evals:
        args.validation_set = dict(id=validation_set_id(datasets.valid, evals), samples=evals, seed=VALIDATION_SEED)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    workers = getattr(args, "num_workers", 0)
    train = iter(build_data_loader(datasets.train, args.micro_batch_size, dp_rank, dp_size, consumed_samples,
                                   num_workers=workers))

    def loader(dataset):
        def fresh():
            if dataset is None or not evals:
                return None
            return iter(build_data_loader(dataset, args.micro_batch_size, dp_rank, dp_size, 0, cyclic=True,
                                          num_workers=workers))
        return fresh

    return train, loader(datasets.valid), loader(datasets.test if has_test_split(args) else None)


def has_test_split(args) -> bool:
    """Whether the run has test data: --test-data-path, or a positive third share of --split (not mock data)."""
    if args.train_data_path:
        return bool(args.test_data_path)
    return not args.mock_data and parse_split(args.split)[2] > 0


def validation_set_id(dataset, num_samples: int) -> str:
    """A hash of the token ids an evaluation scores: samples 0 .. num_samples - 1 (cyclic) of `dataset`,
    in that order (what every evaluation reads, for any data-parallel layout)."""
    h = hashlib.sha256()
    for i in range(num_samples):
        sample = dataset[i % len(dataset)]
        h.update(sample["tokens"].to(torch.int64).numpy().tobytes())
        h.update(sample["labels"][-1:].to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]
