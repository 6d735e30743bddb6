"""Tokenize jsonl / text files into a Megatron indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``).

Every document becomes one sequence: its token ids (optionally after a bos token) followed by
the end-of-document token. Documents are written in input order whatever the number of
workers, so the output is byte-identical for 1 or N workers. The command-line front end is
``tools/preprocess_data.py``; the trainer calls :func:`preprocess` directly.

All user-facing failures (missing inputs, empty input, unloadable tokenizer, unwritable output
folder, malformed jsonl) raise ``SystemExit`` with a one-line message starting with
``preprocess_data: error:``, so the command exits non-zero with that message.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Iterator, List, Optional, Sequence, Union

import numpy

from megatron_sat.data.corpus import expand_inputs, iter_documents
from megatron_sat.data.tokenizer import Tokenizer, load_tokenizer

_ERR = "preprocess_data: error:"


@dataclass
class PreprocessResult:
    """Summary of one :func:`preprocess` run."""

    output_prefix: str
    num_docs: int          # documents written
    num_tokens: int        # tokens written, eod (and bos) included
    num_skipped: int       # empty documents skipped
    seconds: float
    tokenizer: str
    vocab_size: int
    dtype: str             # token dtype in the .bin file (uint16 below 65,500 ids, else int32)

    def summary(self) -> str:
        rate = self.num_tokens / max(self.seconds, 1e-9)
        return (
            f"preprocess_data: {self.num_docs:,} documents, {self.num_tokens:,} tokens "
            f"({self.num_skipped} empty skipped) in {self.seconds:.2f} s ({rate:,.0f} tokens/s) "
            f"-> {self.output_prefix}.bin/.idx [{self.dtype}, vocab {self.vocab_size}]"
        )


# Per-worker state, set by _init_worker (or directly when workers == 1).
_TOK: Optional[Tokenizer] = None
_OPTS: dict = {}


def _init_worker(tokenizer: Tokenizer, append_eod: bool, add_bos: bool) -> None:
    global _TOK, _OPTS
    _TOK = tokenizer
    _OPTS = {"append_eod": append_eod, "add_bos": add_bos}


def _encode(text: str) -> numpy.ndarray:
    """One document -> int64 token ids [n] (empty array for an empty document)."""
    if not text:
        return numpy.zeros(0, dtype=numpy.int64)
    ids = _TOK.encode(text, add_bos=_OPTS["add_bos"])
    if _OPTS["append_eod"]:
        ids.append(_TOK.eod)
    return numpy.asarray(ids, dtype=numpy.int64)


def _check_output(output_prefix: str) -> str:
    """Make sure the folder of ``output_prefix`` exists and is writable; return the abs prefix."""
    prefix = os.path.abspath(os.path.expanduser(os.fspath(output_prefix)))
    if os.fspath(output_prefix).endswith(("/", os.sep)) or os.path.isdir(prefix):
        raise SystemExit(
            f"{_ERR} output prefix {output_prefix} is a folder; give a file prefix such as "
            f"{os.path.join(output_prefix, 'corpus_text_document')}"
        )
    folder = os.path.dirname(prefix)
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write_test_"):
            pass
    except OSError as e:
        raise SystemExit(f"{_ERR} output folder {folder} is not writable ({e.strerror or e})") from None
    return prefix


def preprocess(
    inputs: Union[str, Sequence[str]],
    tokenizer: Union[str, Tokenizer],
    output_prefix: str,
    workers: int = 1,
    json_key: str = "text",
    txt_mode: str = "file",
    append_eod: bool = True,
    add_bos: bool = False,
    chunksize: int = 32,
    progress: bool = True,
    eod_token: Optional[str] = None,
) -> PreprocessResult:
    """Tokenize ``inputs`` into ``<output_prefix>.bin`` / ``<output_prefix>.idx``.

    Args:
        inputs: .jsonl/.json files (document = field ``json_key``), .txt files (see
            ``txt_mode`` in :func:`megatron_sat.data.corpus.iter_documents`), or folders.
        tokenizer: a :class:`Tokenizer`, or a path / hub name for :func:`load_tokenizer`.
        output_prefix: path prefix of the dataset (``data/corpus`` -> ``data/corpus.bin``); it
            is what the trainer's data path / blend names. A ``<prefix>.meta.json`` sidecar
            records tokenizer and counts.
        workers: tokenizer processes (multiprocessing Pool, ``imap`` with ``chunksize``).
        append_eod / add_bos: add the eod token after / the bos token before every document.
        progress: show a tqdm bar and print the summary line.
        eod_token: end-of-document token text when ``tokenizer`` is a path whose eos token is
            missing or wrong.

    Returns:
        PreprocessResult (documents, tokens, seconds, output prefix, ...).
    """
    t0 = time.time()
    try:
        files = expand_inputs(inputs)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{_ERR} {e}") from None
    try:
        tok = load_tokenizer(tokenizer, eod_token=eod_token)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{_ERR} cannot load tokenizer: {e}") from None
    prefix = _check_output(output_prefix)
    clash = [f for f in files if os.path.realpath(f) in {os.path.realpath(prefix + e) for e in (".bin", ".idx")}]
    if clash:
        raise SystemExit(f"{_ERR} output prefix {output_prefix} would overwrite the input {clash[0]}: "
                         "choose another --output-prefix")

    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(tok.vocab_size)
    tmp_bin, tmp_idx = f"{prefix}.tmp{os.getpid()}.bin", f"{prefix}.tmp{os.getpid()}.idx"

    def documents() -> Iterator[str]:
        for path in files:
            yield from iter_documents(path, json_key=json_key, txt_mode=txt_mode)

    builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
    num_docs = num_tokens = num_skipped = 0
    max_token_id = -1
    pool = None
    try:
        if workers > 1:
            saved = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # forked workers: no rayon pools
            try:
                pool = multiprocessing.Pool(
                    workers, initializer=_init_worker, initargs=(tok, append_eod, add_bos)
                )
            finally:
                if saved is None:
                    os.environ.pop("TOKENIZERS_PARALLELISM", None)
                else:
                    os.environ["TOKENIZERS_PARALLELISM"] = saved
            encoded = pool.imap(_encode, documents(), chunksize=chunksize)
        else:
            _init_worker(tok, append_eod, add_bos)
            encoded = map(_encode, documents())

        bar = _progress_bar(encoded, progress)
        for ids in bar:  # ids: int64 [n_tokens]
            if ids.size == 0:
                num_skipped += 1
                continue
            builder.add_document(ids, [ids.size])
            num_docs += 1
            num_tokens += int(ids.size)
            max_token_id = max(max_token_id, int(ids.max()))
            if num_docs % 256 == 0:
                bar.set_postfix(tokens=f"{num_tokens:,}", refresh=False)
        bar.close()
        builder.finalize(tmp_idx)
    except ValueError as e:  # malformed jsonl, missing field
        _remove(tmp_bin, tmp_idx, builder)
        raise SystemExit(f"{_ERR} {e}") from None
    except BaseException:
        _remove(tmp_bin, tmp_idx, builder)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()

    if num_docs == 0:
        _remove(tmp_bin, tmp_idx, builder)
        raise SystemExit(
            f"{_ERR} empty input: no documents with text in {', '.join(files)}"
            + (f" ({num_skipped} empty documents)" if num_skipped else "")
        )
    os.replace(tmp_bin, prefix + ".bin")
    os.replace(tmp_idx, prefix + ".idx")
    result = PreprocessResult(
        output_prefix=prefix,
        num_docs=num_docs,
        num_tokens=num_tokens,
        num_skipped=num_skipped,
        seconds=time.time() - t0,
        tokenizer=tok.name,
        vocab_size=tok.vocab_size,
        dtype=numpy.dtype(dtype).name,
    )
    meta = dict(asdict(result), eod=tok.eod, inputs=files, json_key=json_key,
                append_eod=append_eod, add_bos=add_bos, max_token_id=max_token_id,
                tokenizer_fingerprint=tok.fingerprint)  # the trainer checks both (data/checks.py)
    with open(prefix + ".meta.json", "w") as f:
        json.dump(meta, f, indent=2)
    if progress:
        print(result.summary(), flush=True)
    return result


def _progress_bar(iterable, enabled: bool):
    """tqdm over documents (a plain pass-through when disabled or tqdm is not installed)."""
    try:
        from tqdm import tqdm
    except ImportError:
        enabled = False
    if not enabled:

        class _Plain:
            def __iter__(self):
                return iter(iterable)

            def set_postfix(self, **kwargs):
                pass

            def close(self):
                pass

        return _Plain()
    return tqdm(iterable, unit="doc", mininterval=0.5, desc="tokenize")


def _remove(tmp_bin: str, tmp_idx: str, builder) -> None:
    """Drop half-written temporary files."""
    try:
        builder.data_file.close()
    except Exception:
        pass
    for p in (tmp_bin, tmp_idx):
        if os.path.exists(p):
            os.remove(p)


def read_documents(prefix: str) -> List[numpy.ndarray]:
    """Read a written dataset back: one int64 array of token ids [n_tokens] per document."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [numpy.asarray(ds[i], dtype=numpy.int64) for i in range(len(ds))]
