"""Worker side of preprocessing: a chunk of raw documents -> checked texts -> token ids, in one batch call.

    init_worker(tokenizer, json_key, append_eod, add_bos)     once per worker process (or in-process)
    encode_chunk(chunk) -> Encoded                           ids of every kept document, concatenated

Texts are tokenized with the `tokenizers` library's batch encoding (one Rust call per chunk, not one Python call
per document); slow (Python) tokenizers fall back to one call per document. The result is the same ids as
Tokenizer.encode(text) per document. Bad documents (a line that is not UTF-8 or not JSON, no field json_key, a
value that is not a string) are returned as "file:line: reason" messages, in order; the caller stops at the
first or counts them (--skip-bad).
"""

from __future__ import annotations

import json
from itertools import chain
from typing import List, NamedTuple, Optional, Tuple

import numpy

_STATE: dict = {}


class Encoded(NamedTuple):
    ids: numpy.ndarray       # [sum(lengths)] in the dataset's dtype, documents back to back (bos, text ids, eod)
    lengths: numpy.ndarray   # int64 [n_docs]
    num_empty: int           # documents with empty text (skipped)
    bad: List[str]           # "file:line: reason" of each bad document, in input order


def init_worker(tokenizer, json_key: str = "text", append_eod: bool = True, add_bos: bool = False,
                dtype=numpy.int64) -> None:
    """dtype: of the ids returned (the .bin file's, so that a chunk crosses the process boundary at its size)."""
    hf = tokenizer.hf
    backend = hf.backend_tokenizer if getattr(hf, "is_fast", False) else None
    if add_bos and tokenizer.bos is None:
        raise ValueError(f"tokenizer {tokenizer.name!r} has no bos token")
    _STATE.update(tok=tokenizer, backend=backend, key=json_key, eod=tokenizer.eod if append_eod else None,
                  bos=tokenizer.bos if add_bos else None, dtype=numpy.dtype(dtype))


def decode_chunk(chunk, json_key: str) -> Tuple[List[str], List[str]]:
    """(texts in order, bad-document messages) of a chunk (readers.Chunk)."""
    texts, bad = [], []
    if chunk.kind == "jsonl":
        for i, line in enumerate(chunk.items):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except UnicodeDecodeError:
                bad.append(f"{chunk.location(i)}: not valid UTF-8")
                continue
            except ValueError as e:
                bad.append(f"{chunk.location(i)}: not valid JSON ({getattr(e, 'msg', e)})")
                continue
            if not isinstance(obj, dict) or json_key not in obj:
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                bad.append(f"{chunk.location(i)}: no field {json_key!r} (found {keys}); pass --json-key FIELD")
                continue
            text = obj[json_key]
            if not isinstance(text, str):
                bad.append(f"{chunk.location(i)}: field {json_key!r} is {type(text).__name__}, not a string")
                continue
            texts.append(text)
        return texts, bad
    for i, value in enumerate(chunk.items):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as e:
                bad.append(f"{chunk.location(i)}: not valid UTF-8 (byte {e.start})")
                continue
        if value is None:
            bad.append(f"{chunk.location(i)}: no text (null)")
            continue
        texts.append(value)
    return texts, bad


def encode_texts(texts: List[str]) -> List[List[int]]:
    """Token ids of each text (no special tokens), one batch call where the tokenizer is fast."""
    backend = _STATE["backend"]
    if backend is None:
        return [_STATE["tok"].encode(t) for t in texts]
    batch = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: no offsets (tokenizers >= 0.20)
    return [e.ids for e in batch(texts, add_special_tokens=False)]


def encode_chunk(chunk) -> Encoded:
    texts, bad = decode_chunk(chunk, _STATE["key"])
    kept = [t for t in texts if t]
    num_empty = len(texts) - len(kept)
    bos, eod = _STATE["bos"], _STATE["eod"]
    head, tail = ([bos] if bos is not None else []), ([eod] if eod is not None else [])
    docs = [head + ids + tail for ids in encode_texts(kept)] if (head or tail) else encode_texts(kept)
    if not all(docs):  # a text of no tokens and no eod: skipped like an empty one
        docs = [d for d in docs if d]
        num_empty = len(texts) - len(docs)
    lengths = numpy.fromiter((len(d) for d in docs), dtype=numpy.int64, count=len(docs))
    ids = numpy.fromiter(chain.from_iterable(docs), dtype=_STATE["dtype"], count=int(lengths.sum()))
    return Encoded(ids, lengths, num_empty, bad)


def worker_state() -> Optional[dict]:
    return _STATE or None
