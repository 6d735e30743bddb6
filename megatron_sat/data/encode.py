"""Worker side of preprocessing: a chunk of raw documents -> checked texts -> token ids, as numpy arrays.

    init_worker(tokenizer, json_key, append_eod, add_bos, dtype, fast)   once per worker process (or in-process)
    encode_chunk(task) -> Encoded                                        ids of every kept document, concatenated

A task is a readers.Chunk (documents read by the main process) or a readers.Block (a byte range of a plain jsonl
file, read here, so that no text crosses between processes). Texts are tokenized by `fast`
(megatron_sat.data.fastbpe.FastBPE: tiktoken's BPE, checked to give the tokenizer's own ids) when given, else by
the `tokenizers` library's batch encoding (one Rust call per chunk), else (a slow tokenizer) one call per
document. Either way the ids are those of Tokenizer.encode(text) per document, and they come back as one array in
the dataset's dtype (no Python lists cross the process boundary). Bad documents (a line that is not UTF-8 or not
JSON, no field json_key, a value that is not a string, a lone surrogate escape such as "\\ud800") are returned as
(item index, reason), in order; the caller names them by file and line and stops at the first or counts them
(--skip-bad).
"""

from __future__ import annotations

import json
from itertools import chain
from typing import Iterator, List, NamedTuple, Optional, Tuple

import numpy

from megatron_sat.data.readers import Block, InputError, iter_chunks, read_block

_STATE: dict = {}


class Encoded(NamedTuple):
    ids: numpy.ndarray       # [sum(lengths)] in the dataset's dtype, documents back to back (bos, text ids, eod)
    lengths: numpy.ndarray   # int64 [n_docs]
    num_empty: int           # documents with empty text (skipped)
    bad: List[Tuple[int, str]]  # (item index in the chunk, reason) of each bad document, in input order
    num_items: int           # items (lines, rows) in the chunk, blank lines included


def init_worker(tokenizer, json_key: str = "text", append_eod: bool = True, add_bos: bool = False,
                dtype=numpy.int64, fast=None) -> None:
    """dtype: of the ids returned (the .bin file's, so that a chunk crosses the process boundary at its size);
    fast: a checked fastbpe.FastBPE, or None for the tokenizers library."""
    hf = tokenizer.hf
    backend = hf.backend_tokenizer if getattr(hf, "is_fast", False) else None
    if add_bos and tokenizer.bos is None:
        raise ValueError(f"tokenizer {tokenizer.name!r} has no bos token")
    _STATE.update(tok=tokenizer, backend=backend, key=json_key, eod=tokenizer.eod if append_eod else None,
                  bos=tokenizer.bos if add_bos else None, dtype=numpy.dtype(dtype), fast=fast)


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _decode(chunk, json_key: str) -> Tuple[List[str], List[Tuple[int, str]]]:
    """(texts in order, (item index, reason) of each bad document) of a chunk (readers.Chunk)."""
    texts, bad = [], []
    if chunk.kind == "jsonl":
        loads = json.loads
        for i, line in enumerate(chunk.items):
            if not line.strip():
                continue
            try:
                obj = loads(line)
            except UnicodeDecodeError:
                bad.append((i, "not valid UTF-8"))
                continue
            except ValueError as e:
                bad.append((i, f"not valid JSON ({getattr(e, 'msg', e)})"))
                continue
            if not isinstance(obj, dict) or json_key not in obj:
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                bad.append((i, f"no field {json_key!r} (found {keys}); pass --json-key FIELD"))
                continue
            text = obj[json_key]
            if not isinstance(text, str):
                bad.append((i, f"field {json_key!r} is {type(text).__name__}, not a string"))
                continue
            if (b"\\ud" in line or b"\\uD" in line) and _has_lone_surrogate(text):  # only a JSON escape makes one
                bad.append((i, f"field {json_key!r} holds a lone surrogate escape (\\ud800-\\udfff), not valid "
                               "Unicode text"))
                continue
            texts.append(text)
        return texts, bad
    for i, value in enumerate(chunk.items):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as e:
                bad.append((i, f"not valid UTF-8 (byte {e.start})"))
                continue
        if value is None:
            bad.append((i, "no text (null)"))
            continue
        texts.append(value)
    return texts, bad


def decode_chunk(chunk, json_key: str) -> Tuple[List[str], List[str]]:
    """(texts in order, "file:line: reason" of each bad document) of a chunk (readers.Chunk)."""
    texts, bad = _decode(chunk, json_key)
    return texts, [f"{chunk.location(i)}: {reason}" for i, reason in bad]


def iter_documents(path: str, json_key: str = "text", txt_mode: str = "file", hf_split: str = "train") -> Iterator[str]:
    """The document texts of one source (streamed by readers.iter_chunks), in order (empty ones included);
    InputError at the first bad one."""
    for chunk in iter_chunks(path, json_key=json_key, txt_mode=txt_mode, hf_split=hf_split):
        texts, bad = decode_chunk(chunk, json_key)
        if bad:
            raise InputError(bad[0])
        yield from texts


def encode_texts(texts: List[str]) -> List[List[int]]:
    """Token ids of each text (no special tokens) with the tokenizers library, one batch call where it is fast."""
    backend = _STATE["backend"]
    if backend is None:
        return [_STATE["tok"].encode(t) for t in texts]
    batch = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: no offsets (tokenizers >= 0.20)
    return [e.ids for e in batch(texts, add_special_tokens=False)]


def _join_arrays(arrays: List[numpy.ndarray], bos: Optional[int], eod: Optional[int], dtype) -> Tuple:
    """(ids, lengths) of documents given as id arrays, with bos / eod around each, in one copy."""
    extra = (bos is not None) + (eod is not None)
    lengths = numpy.fromiter((a.size + extra for a in arrays), dtype=numpy.int64, count=len(arrays))
    ids = numpy.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for a, n in zip(arrays, lengths.tolist()):
        if bos is not None:
            ids[pos] = bos
        ids[pos + (bos is not None): pos + (bos is not None) + a.size] = a
        if eod is not None:
            ids[pos + n - 1] = eod
        pos += n
    return ids, lengths


def encode_chunk(task) -> Encoded:
    chunk = read_block(task) if isinstance(task, Block) else task
    texts, bad = _decode(chunk, _STATE["key"])
    kept = [t for t in texts if t]
    bos, eod, dtype, fast = _STATE["bos"], _STATE["eod"], _STATE["dtype"], _STATE["fast"]
    if fast is not None:
        arrays = [a for a in fast.encode_batch(kept) if a.size or bos is not None or eod is not None]
        ids, lengths = _join_arrays(arrays, bos, eod, dtype)
        return Encoded(ids, lengths, len(texts) - len(arrays), bad, len(chunk.items))
    head, tail = ([bos] if bos is not None else []), ([eod] if eod is not None else [])
    docs = [head + ids + tail for ids in encode_texts(kept)] if (head or tail) else encode_texts(kept)
    docs = [d for d in docs if d]  # a text of no tokens and no eod: skipped like an empty one
    lengths = numpy.fromiter((len(d) for d in docs), dtype=numpy.int64, count=len(docs))
    ids = numpy.fromiter(chain.from_iterable(docs), dtype=dtype, count=int(lengths.sum()))
    return Encoded(ids, lengths, len(texts) - len(docs), bad, len(chunk.items))
