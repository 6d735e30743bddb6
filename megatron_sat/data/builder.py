"""GPT datasets (Megatron-Core) and deterministic data-parallel micro-batch loading.

:func:`build_datasets` builds train/valid/test datasets with Megatron's ``GPTDatasetConfig`` +
``BlendedMegatronDatasetBuilder`` (``MockGPTDataset`` for ``mock=True`` throughput runs). It
works with or without ``torch.distributed`` initialised: when it is, the builder lets global
rank 0 build the index files first (barrier), then the other ranks read them, so every rank
must call it.

Index cache: GPTDataset saves its document/sample/shuffle indices as ``.npy`` files named by
an MD5 of (dataset path, split, seed, sequence length, num samples, tokenizer identity). They
go to ``cache_dir`` (pass ``<run>/data_cache``), by default ``<folder of the first
prefix>/index_cache``. Mock datasets are built in memory and not cached.

:class:`DistributedBatchSampler` / :func:`build_data_loader` give each data-parallel rank its
micro-batches: global sample positions ``consumed, consumed+1, ...`` are cut into steps of
``micro_batch_size * dp_size`` and rank ``r`` takes the ``r``-th slice of each step. The global
order therefore does not depend on the DP layout, and resuming from a consumed-samples count
continues exactly where the run stopped. (The GPT dataset is already shuffled by its
shuffle index, so the sampler is sequential.)

Batch dict (``b`` = micro-batch size, ``s`` = sequence length)::

    tokens         int64   [b, s]
    labels         int64   [b, s]       tokens shifted left by one
    loss_mask      float32 [b, s]
    position_ids   int64   [b, s]
    attention_mask bool    [b, 1, s, s] (True = masked out) or None (create_attention_mask=False)
"""

from __future__ import annotations

import math
import os
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset

Blend = Tuple[List[str], Optional[List[float]]]
DataSpec = Union[str, Sequence[str], Dict[str, Union[str, Sequence[str]]], None]


class GPTDatasets(NamedTuple):
    """Datasets per split; a split with weight 0 (or not given) is None."""

    train: Optional[torch.utils.data.Dataset]
    valid: Optional[torch.utils.data.Dataset]
    test: Optional[torch.utils.data.Dataset]


def parse_blend(data: Union[str, Sequence]) -> Blend:
    """Parse a data path / blend into Megatron's ``(prefixes, weights or None)``.

    Accepts ``"prefix"``, ``"prefix1 prefix2"``, ``"0.3 prefix1 0.7 prefix2"``, the same as a
    list of strings, or ``[(0.3, "prefix1"), (0.7, "prefix2")]``.
    """
    if isinstance(data, str):
        items: list = data.split()
    else:
        items = list(data)
    if items and all(isinstance(x, (tuple, list)) and len(x) == 2 for x in items):
        return [os.fspath(p) for _, p in items], [float(w) for w, _ in items]
    items = [os.fspath(x) if not isinstance(x, (int, float)) else x for x in items]
    if not items:
        raise ValueError("empty data path / blend")

    def is_number(x) -> bool:
        try:
            float(x)
            return True
        except (TypeError, ValueError):
            return False

    if len(items) % 2 == 0 and all(is_number(x) for x in items[0::2]):
        weights = [float(x) for x in items[0::2]]
        if not all(0 < w < math.inf for w in weights):  # NaN compares False: refused too
            raise ValueError(f"blend weights must be finite numbers > 0, got {' '.join(items[0::2])}: "
                             "write the data path as 'w1 prefix1 w2 prefix2 ...'")
        return [str(p) for p in items[1::2]], weights
    if any(is_number(x) for x in items):
        raise ValueError(f"cannot parse blend {items}: use 'w1 p1 w2 p2 ...' or 'p1 p2 ...'")
    return [str(p) for p in items], None


def _check_prefixes(prefixes: Sequence[str]) -> None:
    missing = [p for p in prefixes if not (os.path.isfile(p + ".bin") and os.path.isfile(p + ".idx"))]
    if missing:
        raise FileNotFoundError(
            "no indexed dataset (.bin + .idx) at prefix(es): " + ", ".join(missing)
            + " (make one with tools/preprocess_data.py)"
        )


def _check_split_nonempty(prefixes, split_matrix, num_samples) -> None:
    """Megatron loops forever on a split that holds no document; fail clearly instead."""
    for prefix in prefixes:
        n_docs = len(IndexedDataset(prefix))
        for name, bounds, n in zip(("train", "valid", "test"), split_matrix, num_samples):
            if bounds is None or not n:
                continue
            beg, end = int(round(bounds[0] * n_docs)), int(round(bounds[1] * n_docs))
            if end <= beg:
                raise ValueError(
                    f"the {name} split of {prefix} has no documents ({n_docs} documents in all); "
                    f"use more documents or a larger {name} share in the split"
                )


def build_datasets(
    data: DataSpec,
    tokenizer,
    seq_length: int,
    num_samples: Tuple[Optional[int], Optional[int], Optional[int]],
    split: Optional[str] = "98,2,0",
    seed: int = 1234,
    valid_seed: Optional[int] = None,
    mock: bool = False,
    cache_dir: Optional[str] = None,
    create_attention_mask: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    mmap_bin_files: bool = True,
    is_built_on_rank: Callable[[], bool] = lambda: True,
) -> GPTDatasets:
    """Build Megatron GPT datasets for train / valid / test.

    Args:
        data: a dataset prefix, a blend (see :func:`parse_blend`), or a dict with keys
            ``train``/``valid``/``test`` giving a prefix or blend per split (``split`` is then
            ignored). Ignored when ``mock``.
        tokenizer: :class:`~megatron_sat.data.tokenizer.Tokenizer` (or anything with
            ``vocab_size``, ``eod``, ``unique_identifiers``); ``NullTokenizer(V)`` for mock.
        seq_length: tokens per sample (each sample reads ``seq_length + 1`` tokens).
        num_samples: samples wanted per split (train, valid, test); the datasets hold at least
            that many (repeating epochs if needed). None = one epoch.
        split: document shares, e.g. ``"98,2,0"`` (contiguous ranges of documents).
        seed: seed of the document and sample shuffles.
        valid_seed: when given (and not ``seed``), the validation split is shuffled with this seed
            instead, so that runs of a sweep with different ``seed`` score the same validation
            samples while their training orders differ. Train and test keep ``seed``; each
            part is built (and cached) on its own.
        mock: synthetic data from ``MockGPTDataset`` (no files needed).
        cache_dir: where index files are cached (default ``<first prefix folder>/index_cache``).
        create_attention_mask: put a [1, s, s] causal mask in every sample (not needed by
            causal attention kernels; costs s*s bytes per sample).
        reset_position_ids / reset_attention_mask / eod_mask_loss: Megatron's options.
        mmap_bin_files: memory-map the .bin files (Megatron's default) or read them with plain reads.
        is_built_on_rank: whether this rank builds datasets (others get None); must be True
            on global rank 0.
    """
    if len(num_samples) != 3:
        raise ValueError(f"num_samples must be (train, valid, test), got {num_samples}")
    sizes = [None if n is None else int(n) for n in num_samples]
    blend = blend_per_split = None
    if mock:
        split, cls = None, MockGPTDataset
    else:
        cls = GPTDataset
        if data is None:
            raise ValueError("no data path given (pass a dataset prefix or blend, or mock=True)")
        if isinstance(data, dict):
            unknown = set(data) - {"train", "valid", "test"}
            if unknown:
                raise ValueError(f"unknown split name(s) {sorted(unknown)} in data")
            blend_per_split = [
                parse_blend(data[k]) if data.get(k) else None for k in ("train", "valid", "test")
            ]
            prefixes = [p for b in blend_per_split if b for p in b[0]]
            split = None
        else:
            blend = parse_blend(data)
            prefixes = blend[0]
        _check_prefixes(prefixes)
        if cache_dir is None:
            cache_dir = os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "index_cache")

    def make_config(random_seed: int, keep=(0, 1, 2)):
        """The dataset config; splits not in `keep` are left out (not built)."""
        per_split = None if blend_per_split is None else [
            b if i in keep else None for i, b in enumerate(blend_per_split)]
        config = GPTDatasetConfig(
            random_seed=random_seed,
            sequence_length=seq_length,
            blend=blend,
            blend_per_split=per_split,
            split=split,
            path_to_cache=None if mock else cache_dir,
            tokenizer=tokenizer,
            reset_position_ids=reset_position_ids,
            reset_attention_mask=reset_attention_mask,
            eod_mask_loss=eod_mask_loss,
            create_attention_mask=create_attention_mask,
            mmap_bin_files=mmap_bin_files,
        )
        if config.split_matrix is not None:
            config.split_matrix = [m if i in keep else None for i, m in enumerate(config.split_matrix)]
        return config

    def build(config):
        return BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build()

    config = make_config(seed)
    if blend is not None:
        _check_split_nonempty(blend[0], config.split_matrix, sizes)
    if valid_seed is None or valid_seed == seed or not sizes[1]:
        train, valid, test = build(config)
    else:  # the validation samples must not depend on `seed`: that split is shuffled with its own seed
        train, _, test = build(make_config(seed, keep=(0, 2)))
        _, valid, _ = build(make_config(valid_seed, keep=(1,)))
    return GPTDatasets(train, valid, test)


class DistributedBatchSampler:
    """Yields this data-parallel rank's micro-batches of dataset indices, deterministically.

    Global positions ``consumed_samples, consumed_samples + 1, ...`` are read in steps of
    ``micro_batch_size * dp_size``; within a step rank ``r`` takes positions
    ``[start + r * mbs, start + (r + 1) * mbs)``. Position ``p`` is dataset index ``p``
    (``p % total_samples`` when ``cyclic``). Without ``cyclic`` iteration stops at the last full
    step.

    Args:
        total_samples: dataset length.
        micro_batch_size: samples per micro-batch per rank.
        dp_rank, dp_size: this rank's data-parallel rank and the data-parallel world size.
        consumed_samples: global samples already used (all ranks together), e.g. from a
            checkpoint; must be a multiple of ``micro_batch_size * dp_size``.
        cyclic: wrap around the dataset forever (e.g. for validation).
    """

    def __init__(
        self,
        total_samples: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
        cyclic: bool = False,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"dataset is empty (total_samples={total_samples})")
        if micro_batch_size <= 0 or dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"bad micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}"
            )
        step = micro_batch_size * dp_size
        if consumed_samples < 0 or consumed_samples % step:
            raise ValueError(
                f"consumed_samples={consumed_samples} must be a non-negative multiple of "
                f"micro_batch_size * dp_size = {step}"
            )
        if not cyclic and total_samples < step:
            raise ValueError(
                f"dataset has {total_samples} samples, fewer than one step of "
                f"micro_batch_size * dp_size = {step}"
            )
        self.total_samples = total_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = consumed_samples
        self.cyclic = cyclic

    def __len__(self) -> int:
        """Micro-batches this rank will yield (a very large number when cyclic)."""
        if self.cyclic:
            return 2**62
        step = self.micro_batch_size * self.dp_size
        return max(0, (self.total_samples - self.consumed_samples) // step)

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro_batch_size * self.dp_size
        start = self.consumed_samples
        while self.cyclic or start + step <= self.total_samples:
            first = start + self.dp_rank * self.micro_batch_size
            positions = range(first, first + self.micro_batch_size)
            yield [p % self.total_samples for p in positions] if self.cyclic else list(positions)
            start += step


def collate_batch(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, Optional[torch.Tensor]]:
    """Stack GPT samples into the batch dict described in the module docstring."""
    batch: Dict[str, Optional[torch.Tensor]] = {
        key: torch.stack([s[key] for s in samples])
        for key in ("tokens", "labels", "loss_mask", "position_ids")
    }
    if samples[0].get("attention_mask") is not None:
        batch["attention_mask"] = torch.stack([s["attention_mask"] for s in samples])
    else:
        batch["attention_mask"] = None
    return batch


def build_data_loader(
    dataset,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    consumed_samples: int = 0,
    cyclic: bool = False,
    num_workers: int = 0,
) -> torch.utils.data.DataLoader:
    """A DataLoader over this rank's micro-batches (see :class:`DistributedBatchSampler`).

    ``iter(loader)`` yields batch dicts; resume by building a new loader with the checkpoint's
    consumed-samples count.
    """
    sampler = DistributedBatchSampler(
        len(dataset), micro_batch_size, dp_rank, dp_size, consumed_samples, cyclic
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_batch,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )
