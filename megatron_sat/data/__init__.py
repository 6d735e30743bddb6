"""Data side of megatron-sat: tokenizer, default corpus, preprocessing, datasets and loaders.

Typical use::

    from megatron_sat.data import (write_default_corpus, train_bpe_tokenizer, preprocess,
                                   build_datasets, build_data_loader)

    info = write_default_corpus("data/raw")                     # no download
    tok = train_bpe_tokenizer([info.path], 8192, "data/tokenizer")
    preprocess([info.path], tok, "data/default_text_document", workers=2)
    ds = build_datasets("data/default_text_document", tok, seq_length=512,
                        num_samples=(10_000, 100, 0), cache_dir="runs/x/data_cache")
    loader = build_data_loader(ds.train, micro_batch_size=4, dp_rank=0, dp_size=1,
                               consumed_samples=0)
    batch = next(iter(loader))   # tokens/labels/loss_mask/position_ids [b, s]
"""

import importlib

# The function `preprocess` is bound here at import: were it looked up on first use like the names below, any
# earlier import of the submodule megatron_sat.data.preprocess would have bound the module under that name first.
from megatron_sat.data.preprocess import preprocess  # light: no torch, no megatron-core

# Imported on first use (PEP 562), so that preprocessing (megatron_sat.data.preprocess) does not import the
# dataset builder, hence torch and megatron-core: seconds of start-up per preprocessing run.
_WHERE = {
    "DistributedBatchSampler": "builder", "GPTDatasets": "builder", "build_data_loader": "builder",
    "build_datasets": "builder", "collate_batch": "builder", "parse_blend": "builder",
    "CorpusInfo": "corpus", "default_corpus_documents": "corpus", "write_default_corpus": "corpus",
    "PreprocessError": "preprocess", "PreprocessResult": "preprocess",
    "read_documents": "preprocess",
    "InputError": "readers", "expand_inputs": "readers", "iter_documents": "encode",
    "merge_datasets": "shards", "preprocess_shards": "shards", "shard_prefixes": "shards", "write_blend": "shards",
    "NullTokenizer": "tokenizer", "Tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
    "train_bpe_tokenizer": "tokenizer",
}


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"megatron_sat.data.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "CorpusInfo",
    "DistributedBatchSampler",
    "GPTDatasets",
    "InputError",
    "NullTokenizer",
    "PreprocessError",
    "PreprocessResult",
    "Tokenizer",
    "build_data_loader",
    "build_datasets",
    "collate_batch",
    "default_corpus_documents",
    "expand_inputs",
    "iter_documents",
    "load_tokenizer",
    "merge_datasets",
    "parse_blend",
    "preprocess",
    "preprocess_shards",
    "read_documents",
    "shard_prefixes",
    "train_bpe_tokenizer",
    "write_blend",
    "write_default_corpus",
]
