"""Sharded preprocessing (one dataset per input file, spread over the tasks of a Slurm job array) and merging.

    preprocess_shards(inputs, tokenizer, shard_dir, task, num_tasks)  this task's group of input files, each
                                                                      -> shard_dir/<k>_<name>.bin/.idx/.meta.json;
                                                                      finished shards are skipped (resumable)
    shard_prefixes(shard_dir)                                         every shard, in input order (all finished)
    merge_datasets(prefixes, output_prefix)                           one dataset: the shards back to back
                                                                      (megatron-core IndexedDatasetBuilder.add_index)
    write_blend(prefixes, path)                                       or a blend file, weights = token counts

Input k of the sorted input list (megatron_sat.data.readers.expand_inputs) belongs to task k * num_tasks // n
(contiguous groups). Every task writes the same shard_dir/shards.json (inputs and shard names, in order), which
the merge reads. A shard is finished when its .meta.json exists (written last, after .bin and .idx are in place),
so a rerun of the array (a requeue, a failed task) redoes only the missing shards. The merged dataset is
byte-identical to preprocessing all inputs in one process: the same documents in the same order.
"""

from __future__ import annotations

import json
import os
import re
from typing import List, Optional, Sequence

from megatron_sat.data.preprocess import _ERR, PreprocessError, preprocess
from megatron_sat.data.readers import expand_inputs
from megatron_sat.data.tokenizer import load_tokenizer

MANIFEST = "shards.json"


def _shard_name(k: int, path: str) -> str:
    stem = os.path.basename(os.path.normpath(path))
    stem = re.sub(r"\.(jsonl|json|parquet|txt|text)(\.(gz|zst|zstd))?$", "", stem)
    return f"{k:05d}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', stem)[:80]}"


def task_files(n: int, task: int, num_tasks: int) -> range:
    """Indices of the inputs task `task` of `num_tasks` handles (contiguous; every input in exactly one task)."""
    return range(task * n // num_tasks, (task + 1) * n // num_tasks)


def _finished(prefix: str, source: str) -> bool:
    try:
        with open(prefix + ".meta.json") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return meta.get("inputs") == [source] and os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def preprocess_shards(inputs: Sequence[str], tokenizer, shard_dir: str, task: int = 0, num_tasks: int = 1,
                      log=print, **kwargs) -> List[str]:
    """Preprocess this task's inputs, one dataset each, skipping finished ones; returns this task's prefixes.
    kwargs go to :func:`megatron_sat.data.preprocess.preprocess` (workers, json_key, skip_bad, ...)."""
    if not 0 <= task < num_tasks:
        raise PreprocessError(f"{_ERR} task {task} is not in 0..{num_tasks - 1} (--task-index, --num-tasks)")
    try:
        files = expand_inputs(inputs)
    except (OSError, ValueError) as e:
        raise PreprocessError(f"{_ERR} {e}") from None
    os.makedirs(shard_dir, exist_ok=True)
    names = [_shard_name(k, f) for k, f in enumerate(files)]
    manifest = dict(inputs=files, shards=names)
    path = os.path.join(shard_dir, MANIFEST)
    if os.path.isfile(path):
        with open(path) as f:
            before = json.load(f)
        if before != manifest:
            raise PreprocessError(f"{_ERR} {shard_dir} holds shards of other inputs ({path} lists "
                                  f"{len(before.get('inputs', []))} other files): use a new shard folder")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, path)
    try:  # once for all shards
        tokenizer = load_tokenizer(tokenizer, eod_token=kwargs.pop("eod_token", None), plain=True)
    except (OSError, ValueError) as e:
        raise PreprocessError(f"{_ERR} cannot load tokenizer: {e}") from None
    mine = task_files(len(files), task, num_tasks)
    log(f"preprocess_data: task {task} of {num_tasks}: inputs {mine.start}..{mine.stop - 1} of {len(files)}",
        flush=True)
    done = []
    for k in mine:
        prefix = os.path.join(shard_dir, names[k])
        if _finished(prefix, files[k]):
            log(f"preprocess_data: {names[k]} already done, skipped", flush=True)
        else:
            result = preprocess([files[k]], tokenizer, prefix, allow_empty=kwargs.get("skip_bad", False), **kwargs)
            if not kwargs.get("progress", True):
                log(result.summary(), flush=True)
        done.append(prefix)
    return done


def shard_prefixes(shard_dir: str) -> List[str]:
    """Every shard of shard_dir in input order; PreprocessError naming the unfinished ones."""
    path = os.path.join(shard_dir, MANIFEST)
    if not os.path.isfile(path):
        raise PreprocessError(f"{_ERR} {shard_dir} has no {MANIFEST}: run slurm/preprocess.sbatch (or "
                              "tools/preprocess_data.py --shard-dir) into it first")
    with open(path) as f:
        manifest = json.load(f)
    prefixes = [os.path.join(shard_dir, n) for n in manifest["shards"]]
    missing = [os.path.basename(p) for p, src in zip(prefixes, manifest["inputs"]) if not _finished(p, src)]
    if missing:
        raise PreprocessError(f"{_ERR} {len(missing)} of {len(prefixes)} shards in {shard_dir} are not finished "
                              f"({', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}): rerun the array job "
                              "(finished shards are skipped)")
    return prefixes


def _metas(prefixes: Sequence[str], allow_missing_meta: bool = False) -> List[dict]:
    """Each dataset's .meta.json ({} for none). Without one its tokenizer is unknown: refused (one line) unless
    allow_missing_meta (--allow-missing-meta), since a dataset of another tokenizer would merge unnoticed."""
    metas, missing = [], []
    for p in prefixes:
        if not (os.path.isfile(p + ".bin") and os.path.isfile(p + ".idx")):
            raise PreprocessError(f"{_ERR} no indexed dataset (.bin + .idx) at {p}")
        try:
            with open(p + ".meta.json") as f:
                metas.append(json.load(f))
        except (OSError, ValueError):
            metas.append({})
            missing.append(p)
    if missing and not allow_missing_meta:
        raise PreprocessError(f"{_ERR} {missing[0]}.meta.json is missing or unreadable"
                              f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: its tokenizer is "
                              "unknown; merge only datasets made with one tokenizer, or pass --allow-missing-meta "
                              "(the merged .meta.json then records no tokenizer)")
    keys = ("tokenizer_fingerprint", "vocab_size", "eod", "dtype")
    first = metas[0]
    for p, m in zip(prefixes, metas):
        differs = [k for k in keys if m.get(k) is not None and first.get(k) is not None and m[k] != first[k]]
        if differs:
            raise PreprocessError(f"{_ERR} {p} was made differently from {prefixes[0]} ({', '.join(differs)} "
                                  "differ): merge only datasets made with one tokenizer")
    return metas


def merge_datasets(prefixes: Sequence[str], output_prefix: str, allow_missing_meta: bool = False) -> dict:
    """Concatenate datasets into output_prefix (written aside, moved into place); returns its .meta.json.

    A dataset without its .meta.json is refused unless allow_missing_meta; then the merged .meta.json records no
    tokenizer (None) and lists the datasets without one under without_meta."""
    if not prefixes:
        raise PreprocessError(f"{_ERR} nothing to merge")
    metas = _metas(prefixes, allow_missing_meta)
    # imported here (after the checks: bad input answers at once): preprocess_shards, the preprocessing side of this
    # module, must not import torch/megatron-core
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, _IndexReader

    out = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out for p in prefixes):
        raise PreprocessError(f"{_ERR} --output-prefix {output_prefix} is one of the inputs: choose another")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    dtype = _IndexReader(prefixes[0] + ".idx", multimodal=False).dtype
    tmp = f"{out}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    try:
        for p in prefixes:
            if _IndexReader(p + ".idx", multimodal=False).dtype != dtype:
                raise PreprocessError(f"{_ERR} {p} stores another token dtype than {prefixes[0]}")
            builder.add_index(p)
        builder.finalize(tmp + ".idx")
    except BaseException:
        builder.data_file.close()
        for ext in (".bin", ".idx"):
            if os.path.exists(tmp + ext):
                os.remove(tmp + ext)
        raise
    m0 = metas[0] if all(metas) else {}  # a dataset of unknown tokenizer: claim none for the merge
    for p, m in zip(prefixes, metas):
        if not m:  # its counts from its index
            index = _IndexReader(p + ".idx", multimodal=False)
            m.update(num_docs=len(index.document_indices) - 1, num_tokens=int(index.sequence_lengths.sum()))
    ids = [m.get("max_token_id") for m in metas]
    meta = dict(output_prefix=out, merged_from=list(prefixes),
                num_docs=sum(m.get("num_docs", 0) for m in metas), num_tokens=sum(m.get("num_tokens", 0) for m in metas),
                num_skipped=sum(m.get("num_skipped", 0) for m in metas), num_bad=sum(m.get("num_bad", 0) for m in metas),
                inputs=[i for m in metas for i in m.get("inputs", [])],
                max_token_id=None if None in ids else max(ids),
                **{k: m0.get(k) for k in ("tokenizer", "vocab_size", "dtype", "eod", "json_key", "append_eod",
                                           "add_bos", "tokenizer_fingerprint")})
    if not m0:
        meta["without_meta"] = [p for p, m in zip(prefixes, metas) if "tokenizer" not in m]
    with open(tmp + ".meta.json", "w") as f:
        json.dump(meta, f, indent=2)
    for ext in (".bin", ".idx", ".meta.json"):
        os.replace(tmp + ext, out + ext)
    return meta


def write_blend(prefixes: Sequence[str], path: str, allow_missing_meta: bool = False) -> str:
    """A blend 'tokens1 prefix1 tokens2 prefix2 ...' (weights = token counts, so every document is drawn about
    equally often) in one line at `path`: `--data-path $(cat path)`."""
    metas = _metas(prefixes, allow_missing_meta)
    parts = []
    for p, m in zip(prefixes, metas):
        tokens: Optional[int] = m.get("num_tokens")
        if tokens is None:
            from megatron.core.datasets.indexed_dataset import _IndexReader  # as in merge_datasets

            tokens = int(_IndexReader(p + ".idx", multimodal=False).sequence_lengths.sum())
        if tokens:
            parts.append(f"{tokens} {os.path.abspath(p)}")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(" ".join(parts) + "\n")
    os.replace(tmp, path)
    return path
