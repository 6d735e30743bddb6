"""Tokenize a corpus into a Megatron indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``).

Every document becomes one sequence: its token ids (optionally after a bos token) followed by the
end-of-document token. Inputs are any mix of jsonl (plain, .gz, .zst), parquet, txt, datasets save_to_disk
folders and hub datasets (megatron_sat.data.readers), streamed in chunks: memory stays bounded whatever the
input size. Worker processes read (plain jsonl: byte ranges of the file), parse and tokenize whole chunks
(megatron_sat.data.encode) and send back numpy arrays; the main process hands out chunks (reads compressed jsonl,
parquet, txt and datasets itself) and writes, keeping at most a few chunks per worker in flight. Tokenizing uses
tiktoken's BPE where megatron_sat.data.fastbpe proves it gives the tokenizer's own ids (a byte-level BPE, checked
on the vocabulary, adversarial text and the corpus' first documents), else the `tokenizers` library, with a
one-line note saying why. The .bin/.idx are written by megatron_sat.data.indexed (megatron-core's bytes, without
importing megatron-core and torch). Documents are written in input order whatever the number of workers, so the output is
byte-identical for 1 or N workers (and for the same documents in any input format). The command-line front end is
``tools/preprocess_data.py``; the trainer calls :func:`preprocess` directly.

All user-facing failures (missing inputs, bad input files or documents, unloadable tokenizer, unwritable output
folder) raise :class:`PreprocessError` (a ``SystemExit``) with a one-line message starting with
``preprocess_data: error:``; the command exits 2 with that message. The outputs are written under temporary
names and moved into place at the end, so a failed run leaves nothing behind and never half-overwrites an
earlier dataset.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Iterator, List, Optional, Sequence, Union

import numpy

from megatron_sat.data.encode import decode_chunk, encode_chunk, init_worker
from megatron_sat.data.fastbpe import fast_encoder
from megatron_sat.data.indexed import IndexWriter, optimal_dtype
from megatron_sat.data.readers import Block, InputError, expand_inputs, iter_chunks, iter_tasks, source_size
from megatron_sat.data.tokenizer import Tokenizer, load_tokenizer

_ERR = "preprocess_data: error:"
DEFAULT_CHUNKSIZE = 256   # documents (lines, rows) per chunk sent to a worker
BLOCK_BYTES_PER_DOC = 4096  # a plain jsonl is cut into blocks of chunksize * this many bytes (1 MiB by default)
SAMPLE_CHARS = 1 << 19    # characters of the first documents on which the fast path is checked at start


class PreprocessError(SystemExit):
    """A bad input or setting: str() is the one-line message; tools/preprocess_data.py exits 2 with it."""


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
    num_bad: int = 0       # bad documents skipped (--skip-bad)
    bad_shards: List[str] = field(default_factory=list)  # empty input files skipped (--skip-bad)
    input_bytes: int = 0   # on-disk bytes of the inputs read
    encoder: str = "tokenizers"  # what tokenized: "tiktoken" (exact fast path) or "tokenizers"
    main_cpu_seconds: float = 0.0  # CPU seconds of the main process (reading, handing out, writing)

    def summary(self) -> str:
        secs = max(self.seconds, 1e-9)
        bad = ""
        if self.num_bad or self.bad_shards:
            bad = f", {self.num_bad} bad documents and {len(self.bad_shards)} empty shards skipped"
        return (
            f"preprocess_data: {self.num_docs:,} documents, {self.num_tokens:,} tokens "
            f"({self.num_skipped} empty skipped{bad}) in {self.seconds:.2f} s ({self.num_docs / secs:,.0f} docs/s, "
            f"{self.num_tokens / secs:,.0f} tokens/s, {self.input_bytes / secs / 1e6:,.1f} MB/s) "
            f"-> {self.output_prefix}.bin/.idx [{self.dtype}, vocab {self.vocab_size}, {self.encoder}]"
        )


def _check_output(output_prefix: str) -> str:
    """Make sure the folder of ``output_prefix`` exists and is writable; return the abs prefix."""
    prefix = os.path.abspath(os.path.expanduser(os.fspath(output_prefix)))
    if os.fspath(output_prefix).endswith(("/", os.sep)) or os.path.isdir(prefix):
        raise PreprocessError(
            f"{_ERR} output prefix {output_prefix} is a folder; give a file prefix such as "
            f"{os.path.join(output_prefix, 'corpus_text_document')}"
        )
    folder = os.path.dirname(prefix)
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write_test_"):
            pass
    except OSError as e:
        raise PreprocessError(f"{_ERR} output folder {folder} is not writable ({e.strerror or e})") from None
    return prefix


def _in_order(fn, chunks, pool, window: int):
    """(chunk, fn(chunk)) in input order; with a pool at most `window` chunks are in flight (bounded memory,
    unlike Pool.imap, which reads its whole input ahead)."""
    if pool is None:
        for c in chunks:
            yield c, fn(c)
        return
    pending = deque()
    for c in chunks:
        pending.append((c, pool.apply_async(fn, (c,))))
        if len(pending) >= window:
            c0, r = pending.popleft()
            yield c0, r.get()
    while pending:
        c0, r = pending.popleft()
        yield c0, r.get()


def _sample(files: Sequence[str], json_key: str, txt_mode: str, hf_split: str) -> List[str]:
    """The first documents of the first input, up to SAMPLE_CHARS characters (none where it cannot be read: the
    run itself then reports the input)."""
    texts, size = [], 0
    try:
        for chunk in iter_chunks(files[0], json_key=json_key, txt_mode=txt_mode, hf_split=hf_split, chunk_docs=64):
            for t in decode_chunk(chunk, json_key)[0]:
                texts.append(t)
                size += len(t)
                if size >= SAMPLE_CHARS:
                    return texts
    except (InputError, OSError, ValueError):
        pass
    return texts


def _choose_encoder(tok, fast_bpe: bool, files, json_key, txt_mode, hf_split):
    """A checked FastBPE, or None (then a one-line note says why, on stderr)."""
    if not fast_bpe:
        return None
    fast, note = fast_encoder(tok, _sample(files, json_key, txt_mode, hf_split))
    if fast is None:
        print(f"preprocess_data: {note}", file=sys.stderr, flush=True)
    return fast


def preprocess(
    inputs: Union[str, Sequence[str]],
    tokenizer: Union[str, Tokenizer],
    output_prefix: str,
    workers: int = 1,
    json_key: str = "text",
    txt_mode: str = "file",
    append_eod: bool = True,
    add_bos: bool = False,
    chunksize: int = DEFAULT_CHUNKSIZE,
    progress: bool = True,
    eod_token: Optional[str] = None,
    skip_bad: bool = False,
    hf_split: str = "train",
    allow_empty: bool = False,
    fast_bpe: bool = True,
) -> PreprocessResult:
    """Tokenize ``inputs`` into ``<output_prefix>.bin`` / ``<output_prefix>.idx``.

    Args:
        inputs: files, folders, globs, save_to_disk folders or hub dataset names (see
            :mod:`megatron_sat.data.readers`); document = field / column ``json_key``.
        tokenizer: a :class:`Tokenizer`, or a path / hub name for :func:`load_tokenizer`.
        output_prefix: path prefix of the dataset (``data/corpus`` -> ``data/corpus.bin``); it
            is what the trainer's data path / blend names. A ``<prefix>.meta.json`` sidecar
            records tokenizer and counts.
        workers: tokenizer processes (1: tokenize in this process).
        append_eod / add_bos: add the eod token after / the bos token before every document.
        chunksize: documents (lines, rows) per chunk sent to a worker; does not change the output.
        progress: show a progress bar (MB/s, docs/s, ETA) and print the summary line.
        eod_token: end-of-document token text when ``tokenizer`` is a path whose eos token is
            missing or wrong.
        skip_bad: skip (and count) bad documents and empty shards instead of stopping at the first.
        hf_split: split of a datasets folder / hub dataset.
        allow_empty: write a dataset of no documents instead of failing (a skipped shard of a sharded run).
        fast_bpe: tokenize with tiktoken's BPE where it is proven to give the tokenizer's own ids
            (megatron_sat.data.fastbpe); False: always the tokenizers library.

    Returns:
        PreprocessResult (documents, tokens, seconds, output prefix, ...).
    """
    t0, cpu0 = time.time(), time.process_time()
    try:
        files = expand_inputs(inputs)
    except (OSError, ValueError) as e:
        raise PreprocessError(f"{_ERR} {e}") from None
    try:
        tok = load_tokenizer(tokenizer, eod_token=eod_token, plain=True)
        init_worker(tok, json_key, append_eod, add_bos)
    except (OSError, ValueError) as e:
        raise PreprocessError(f"{_ERR} cannot load tokenizer: {e}") from None
    if chunksize < 1:
        raise PreprocessError(f"{_ERR} chunksize must be >= 1, got {chunksize}")
    prefix = _check_output(output_prefix)
    clash = [f for f in files if os.path.realpath(f) in {os.path.realpath(prefix + e) for e in (".bin", ".idx")}]
    if clash:
        raise PreprocessError(f"{_ERR} output prefix {output_prefix} would overwrite the input {clash[0]}: "
                              "choose another --output-prefix")

    dtype = optimal_dtype(tok.vocab_size)
    fast = _choose_encoder(tok, fast_bpe, files, json_key, txt_mode, hf_split)
    init_worker(tok, json_key, append_eod, add_bos, dtype, fast)
    tmp = f"{prefix}.tmp{os.getpid()}"
    sizes = [source_size(f) for f in files]
    total = None if None in sizes else sum(sizes)
    bad_shards: List[str] = []

    def chunks() -> Iterator:
        for path in files:
            try:
                yield from iter_tasks(path, json_key=json_key, txt_mode=txt_mode, hf_split=hf_split,
                                      chunk_docs=chunksize, block_bytes=chunksize * BLOCK_BYTES_PER_DOC)
            except InputError as e:
                if not (skip_bad and str(e).startswith("empty input")):
                    raise
                bad_shards.append(path)

    builder = IndexWriter(tmp + ".bin", dtype)
    num_docs = num_tokens = num_skipped = num_bad = 0
    max_token_id = -1
    first_bad = None
    pool = None
    bar = _Progress(total, progress)
    try:
        if workers > 1:
            saved = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one Rust thread per worker process: --workers = cores
            try:
                pool = multiprocessing.Pool(workers, initializer=init_worker,
                                            initargs=(tok, json_key, append_eod, add_bos, dtype, fast))
            finally:
                if saved is None:
                    os.environ.pop("TOKENIZERS_PARALLELISM", None)
                else:
                    os.environ["TOKENIZERS_PARALLELISM"] = saved
        done_before, last_source, line = 0, None, 1
        for chunk, enc in _in_order(encode_chunk, chunks(), pool, window=3 * workers):
            if chunk.source != last_source:
                line = 1
            if enc.bad:
                i, reason = enc.bad[0]
                where = f"{chunk.source}:{line + i}" if isinstance(chunk, Block) else chunk.location(i)
                if not skip_bad:
                    raise InputError(f"{where}: {reason} (or pass --skip-bad to skip bad documents)")
                num_bad += len(enc.bad)
                first_bad = first_bad or f"{where}: {reason}"
            line += enc.num_items
            num_skipped += enc.num_empty
            if len(enc.lengths):
                builder.add(enc.ids, enc.lengths)
                num_docs += len(enc.lengths)
                num_tokens += int(enc.lengths.sum())
                max_token_id = max(max_token_id, int(enc.ids.max()))
            if chunk.source != last_source:
                if last_source is not None:
                    done_before += source_size(last_source) or 0
                last_source = chunk.source
            bar.update(done_before + chunk.done_bytes, num_docs, num_tokens)
        bar.close()
        builder.finalize(tmp + ".idx")
    except (InputError, ValueError) as e:  # unreadable file, bad document, missing column
        _remove(tmp, builder)
        raise PreprocessError(f"{_ERR} {e}") from None
    except BaseException:
        _remove(tmp, builder)
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()

    if num_docs == 0 and not allow_empty:
        _remove(tmp, builder)
        raise PreprocessError(
            f"{_ERR} empty input: no documents with text in {', '.join(files)}"
            + (f" ({num_skipped} empty documents)" if num_skipped else "")
            + (f" ({num_bad} bad documents skipped)" if num_bad else "")
        )
    result = PreprocessResult(
        output_prefix=prefix,
        num_docs=num_docs,
        num_tokens=num_tokens,
        num_skipped=num_skipped,
        seconds=time.time() - t0,
        tokenizer=tok.name,
        vocab_size=tok.vocab_size,
        dtype=numpy.dtype(dtype).name,
        num_bad=num_bad,
        bad_shards=bad_shards,
        input_bytes=total or 0,
        encoder="tokenizers" if fast is None else "tiktoken",
        main_cpu_seconds=time.process_time() - cpu0,
    )
    meta = dict(asdict(result), eod=tok.eod, inputs=files, json_key=json_key, first_bad=first_bad,
                append_eod=append_eod, add_bos=add_bos, max_token_id=max_token_id,
                tokenizer_fingerprint=tok.fingerprint)  # the trainer checks both (data/checks.py)
    with open(tmp + ".meta.json", "w") as f:
        json.dump(meta, f, indent=2)
    for ext in (".bin", ".idx", ".meta.json"):  # .meta.json last: it marks a finished dataset (shards resume)
        os.replace(tmp + ext, prefix + ext)
    if progress:
        print(result.summary(), flush=True)
        if num_bad or bad_shards:
            print(f"preprocess_data: skipped {num_bad} bad documents (first: {first_bad}) and empty shards "
                  f"{bad_shards or 'none'}", flush=True)
    return result


class _Progress:
    """Progress bar over input bytes (MB/s, ETA) with documents/s and tokens/s; tqdm when installed, a line
    every 30 s when the output is not a terminal (Slurm logs)."""

    def __init__(self, total: Optional[int], enabled: bool) -> None:
        self.enabled, self.total, self.t0, self.last = enabled, total, time.time(), 0.0
        self.bar = None
        self.tty = sys.stderr.isatty()
        if enabled and self.tty:
            try:
                from tqdm import tqdm  # the train extra: no bar without it

                self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", mininterval=0.5)
            except ImportError:
                pass

    def update(self, done: int, docs: int, tokens: int) -> None:
        if not self.enabled:
            return
        now = time.time()
        elapsed = max(now - self.t0, 1e-9)
        rates = f"{docs:,} docs, {docs / elapsed:,.0f} docs/s, {tokens / elapsed:,.0f} tokens/s"
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix_str(rates, refresh=False)
        elif now - self.last >= 30:
            self.last = now
            mb = done / elapsed / 1e6
            eta = "" if not self.total or not done else f", ETA {(self.total - done) * elapsed / done:,.0f} s"
            pct = f" ({100 * done / self.total:.1f}%)" if self.total else ""
            print(f"tokenize: {done / 1e6:,.1f} MB{pct}, {mb:,.1f} MB/s, {rates}{eta}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _remove(tmp: str, builder) -> None:
    """Drop half-written temporary files."""
    builder.abort()
    for ext in (".bin", ".idx", ".meta.json"):
        if os.path.exists(tmp + ext):
            os.remove(tmp + ext)


def read_documents(prefix: str) -> List[numpy.ndarray]:
    """Read a written dataset back: one int64 array of token ids [n_tokens] per document."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset  # preprocessing itself stays Megatron-free

    ds = IndexedDataset(prefix)
    return [numpy.asarray(ds[i], dtype=numpy.int64) for i in range(len(ds))]
