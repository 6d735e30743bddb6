"""Checks of an indexed dataset against the run that is about to read it, before step 1.

    check_dataset(prefix, tokenizer)  .bin size against the .idx; the largest token id against the
                                      tokenizer's vocabulary; the tokenizer recorded in .meta.json
                                      (tools/preprocess_data.py writes it) against the one given
    epochs_needed(...)                how often a run would cycle through its training split

Megatron's IndexedDataset reads whatever it is given: a truncated .bin fails in the first step with
"offset must be non-negative", a token id past the embedding with an IndexError, and data made with
another tokenizer trains without a word. Each is one line here (DataError) that says what to do.
"""

import json
import os
from typing import Optional

import numpy
from megatron.core.datasets.indexed_dataset import IndexedDataset

_SCAN_CHUNK = 64 << 20  # tokens per read when the largest id is not recorded in .meta.json


class DataError(ValueError):
    """The data cannot be used with these arguments (the trainer prints it and exits 2)."""


def read_meta(prefix: str) -> Optional[dict]:
    path = prefix + ".meta.json"
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}); re-run tools/preprocess_data.py or remove it") from None


def _largest_token(bin_path: str, dtype, num_tokens: int) -> int:
    data = numpy.memmap(bin_path, dtype=dtype, mode="r", shape=(num_tokens,))
    largest = -1
    for start in range(0, num_tokens, _SCAN_CHUNK):
        largest = max(largest, int(data[start:start + _SCAN_CHUNK].max()))
    return largest


def check_dataset(prefix: str, tokenizer, allow_tokenizer_mismatch: bool = False) -> dict:
    """Check one dataset prefix; returns {"documents", "tokens", "largest_token"}; DataError on a problem."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    if os.path.isfile(bin_path) and os.path.getsize(bin_path) == 0:  # Megatron cannot even open it (mmap)
        raise DataError(f"{bin_path} is empty: the dataset {prefix} holds no documents. Remove it from the data "
                        "path, or re-run tools/preprocess_data.py on inputs that hold text")
    try:
        ds = IndexedDataset(prefix, mmap=True)
    except Exception as e:  # noqa: BLE001 (a truncated or foreign .idx fails in many ways)
        raise DataError(f"{idx_path} is unreadable ({type(e).__name__}: {e}); re-run tools/preprocess_data.py "
                        "to rebuild the dataset") from None
    index = ds.index
    lengths, pointers = index.sequence_lengths, index.sequence_pointers
    itemsize = numpy.dtype(index.dtype).itemsize
    expected = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
    actual = os.path.getsize(bin_path)
    if not len(lengths) or not expected:
        raise DataError(f"{idx_path} lists no documents: the dataset {prefix} is empty. Remove it from the data "
                        "path, or re-run tools/preprocess_data.py on inputs that hold text")
    if actual != expected:
        raise DataError(f"{bin_path} has {actual:,} bytes but {idx_path} describes {expected:,} (truncated or from "
                        "another run): re-run tools/preprocess_data.py, or copy the .bin and .idx together")
    num_tokens = expected // itemsize
    meta = read_meta(prefix) or {}
    largest = meta.get("max_token_id")
    if largest is None:
        largest = _largest_token(bin_path, index.dtype, num_tokens) if num_tokens else -1
    if largest >= tokenizer.vocab_size:
        raise DataError(f"{prefix} holds token id {largest}, but the tokenizer {tokenizer.name} has only "
                        f"{tokenizer.vocab_size} tokens: pass the tokenizer the data was made with "
                        f"(.meta.json says {meta.get('tokenizer', 'nothing')!r})")
    if meta and not allow_tokenizer_mismatch:
        differs = _tokenizer_differences(meta, tokenizer)
        if differs:
            raise DataError(f"{prefix} was tokenized with {meta.get('tokenizer')!r}, not with --tokenizer-model "
                            f"{tokenizer.name} ({'; '.join(differs)}): pass the tokenizer it was made with, or "
                            "--allow-tokenizer-mismatch if they are the same")
    return dict(documents=len(lengths), tokens=num_tokens, largest_token=largest)


def _tokenizer_differences(meta: dict, tokenizer) -> list:
    out = []
    fingerprint = getattr(tokenizer, "fingerprint", None)
    if meta.get("tokenizer_fingerprint") and fingerprint and meta["tokenizer_fingerprint"] != fingerprint:
        out.append("its vocabulary differs")
    if meta.get("vocab_size") is not None and meta["vocab_size"] != tokenizer.vocab_size:
        out.append(f"vocabulary {meta['vocab_size']} there, {tokenizer.vocab_size} here")
    if meta.get("eod") is not None and meta["eod"] != tokenizer.eod:
        out.append(f"end-of-document id {meta['eod']} there, {tokenizer.eod} here")
    return out


def split_errors(prefix: str, documents: int, shares, needed) -> list:
    """Megatron's --split divides a dataset by whole documents: a split the run reads (needed[i] > 0) that gets
    none of them is refused here (Megatron would fail deep in the dataset build, or loop)."""
    total = sum(shares)
    out, start = [], 0.0
    for name, share, need in zip(("train", "valid", "test"), shares, needed):
        end = start + share / total
        if share > 0 and need and int(round(end * documents)) <= int(round(start * documents)):
            out.append(f"the {name} split of {prefix} gets no document: --split divides its {documents} "
                       f"document{'s' if documents != 1 else ''} whole. Use more documents, a larger {name} share, or "
                       f"separate data for it (--train-data-path TRAIN"
                       f"{'' if name == 'train' else f' --{name}-data-path {name.upper()}'})"
                       + (" or --split 100,0,0 without evaluation" if name != "train" else ""))
        start = end
    return out


def epochs_needed(tokens_available: int, shares, train_samples: int, seq_length: int) -> float:
    """How many passes over the training split (shares: [train, valid, test]) a run needs (GPTDataset packs
    seq_length + 1 tokens a sample)."""
    train_tokens = tokens_available * shares[0] / sum(shares)
    return train_samples * (seq_length + 1) / max(train_tokens, 1.0)
