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

from megatron_sat.data.builder import (
    DistributedBatchSampler,
    GPTDatasets,
    build_data_loader,
    build_datasets,
    collate_batch,
    parse_blend,
)
from megatron_sat.data.corpus import CorpusInfo, default_corpus_documents, write_default_corpus
from megatron_sat.data.preprocess import PreprocessError, PreprocessResult, preprocess, read_documents
from megatron_sat.data.readers import InputError, expand_inputs, iter_documents
from megatron_sat.data.shards import merge_datasets, preprocess_shards, shard_prefixes, write_blend
from megatron_sat.data.tokenizer import NullTokenizer, Tokenizer, load_tokenizer, train_bpe_tokenizer

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
