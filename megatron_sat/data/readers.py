"""Input discovery and streaming readers for preprocessing: every corpus format becomes a stream of chunks.

    expand_inputs(["data/", "shards/*.parquet", "HuggingFaceFW/fineweb-edu"])  -> sorted sources
    iter_chunks(source, json_key, txt_mode)                                     -> Chunk, Chunk, ...
    iter_tasks(source, ..., block_bytes)           Block (byte ranges of a plain jsonl, read by the worker that
                                                   tokenizes it: read_block) or Chunk (read here), in order

Formats (by suffix; folders are searched recursively, globs expanded, both sorted):

    .jsonl .json  (+ .gz, .zst)  one JSON object per line, document = obj[json_key]
    .parquet                     column json_key, read by row batches (pyarrow; never a whole shard at once)
    .txt .text                   --txt-mode: the whole file, each paragraph, or each line is a document
    a save_to_disk folder        a Hugging Face dataset (datasets.load_from_disk, memory-mapped), column json_key
    ORG/NAME or hf:ORG/NAME      a Hugging Face hub dataset: its snapshot in the local hub cache (offline), else
                                 streamed from the hub when it can be reached (datasets.load_dataset(streaming=True))

Readers do no decoding: a chunk carries raw lines (jsonl, bytes) or column values (str, bytes or None), and the
worker processes (megatron_sat.data.encode) parse, check and tokenize them, so the reading process stays cheap.
Chunks carry the line or row number of each item, so a bad document is named by file and line/row. A file that
cannot be read (corrupt parquet, truncated gzip/zstd, missing column, no documents at all) raises InputError
naming it.
"""

from __future__ import annotations

import glob
import gzip
import io
import os
import socket
import zlib
from dataclasses import dataclass
from itertools import islice
from typing import Iterator, List, Optional, Sequence
from urllib.parse import urlparse

JSONL_SUFFIXES = (".jsonl", ".json")
COMPRESSED = (".gz", ".zst", ".zstd")
TEXT_SUFFIXES = (".txt", ".text")
PARQUET_SUFFIXES = (".parquet",)
TXT_MODES = ("file", "paragraph", "line")
# JSON files in corpus folders that are metadata, not documents (ours, datasets', the hub's)
_META_JSON = (".meta.json", ".info.json", "dataset_info.json", "dataset_infos.json", "state.json",
              "dataset_dict.json")
HUB_PREFIX = "hf:"
STREAM_PREFIX = "hf-stream:"
CHUNK_DOCS = 256           # lines / rows per chunk


class InputError(ValueError):
    """An input that cannot be read as documents; the message names the file (and line or row)."""


@dataclass
class Chunk:
    """A batch of raw documents from one source, in input order.

    kind "jsonl": items are raw lines (bytes), item i is line first + i (1-based; blank lines included).
    kind "text":  items are str, bytes (UTF-8 to check) or None (a null value), item i is row/line where[i].
    """

    source: str
    kind: str
    items: list
    first: int = 1
    where: Optional[List[int]] = None
    unit: str = "line"
    done_bytes: int = 0                 # on-disk bytes of `source` read so far (progress)

    def location(self, i: int) -> str:
        n = self.where[i] if self.where is not None else self.first + i
        return f"{self.source}:{n}" if self.unit == "line" else f"{self.source}: row {n}"


@dataclass
class Block:
    """Bytes start..end of a plain jsonl file, read by a worker (read_block): the lines that begin in the range.
    Line numbers are known only once the blocks before it are counted, so bad documents are reported by index."""

    source: str
    start: int
    end: int
    kind: str = "jsonl"
    unit: str = "line"

    @property
    def done_bytes(self) -> int:
        return self.end


def read_block(block: Block) -> Chunk:
    """The lines (bytes, blank ones included) that begin in block.start..block.end; item i is line i of the block."""
    with open(block.source, "rb") as f:
        start = 0
        if block.start > 0:
            f.seek(block.start - 1)
            f.readline()  # the line holding byte start - 1 belongs to the block before
            start = f.tell()
        data = f.read(block.end - start) if start < block.end else b""
        if data and not data.endswith(b"\n"):
            data += f.readline()  # the last line begins in the block: read it whole
    lines = data.split(b"\n")
    if lines[-1]:
        lines[-1] += b"\n"  # (a last line without a newline; the \n only keeps items alike)
    else:
        lines.pop()
    return Chunk(block.source, "jsonl", lines, first=0, done_bytes=block.end)


def iter_tasks(source: str, json_key: str = "text", txt_mode: str = "file", hf_split: str = "train",
               chunk_docs: int = CHUNK_DOCS, block_bytes: int = 0) -> Iterator:
    """Like iter_chunks, but a plain (uncompressed) jsonl file comes as Blocks of block_bytes for the workers to
    read (no lines cross from the reading process to the workers) when block_bytes > 0."""
    if block_bytes > 0 and source.endswith(JSONL_SUFFIXES) and os.path.isfile(source):
        size = os.path.getsize(source)
        if size == 0:
            raise InputError(f"empty input: no documents in {source} (an empty shard): remove it from the inputs, "
                             "or pass --skip-bad to skip it")
        for start in range(0, size, block_bytes):
            yield Block(source, start, min(start + block_bytes, size))
        return
    yield from iter_chunks(source, json_key=json_key, txt_mode=txt_mode, hf_split=hf_split, chunk_docs=chunk_docs)


# ----------------------------------------------------------------------------------------------
# Finding inputs
# ----------------------------------------------------------------------------------------------


def is_saved_dataset(path: str) -> bool:
    """A folder written by datasets' save_to_disk (a Dataset or a DatasetDict)."""
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, "dataset_dict.json"))
        or (os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(os.path.join(path, "dataset_info.json"))))


def _supported(path: str) -> bool:
    """A file suffix this module reads."""
    name = os.path.basename(path)
    base = name[: -len(next(c for c in COMPRESSED if name.endswith(c)))] if name.endswith(COMPRESSED) else name
    return base.endswith(JSONL_SUFFIXES) or (base == name and base.endswith(TEXT_SUFFIXES + PARQUET_SUFFIXES))


def _readable_file(path: str) -> bool:
    """A file of a folder taken as input: supported, not hidden, not metadata."""
    name = os.path.basename(path)
    return _supported(path) and not name.endswith(_META_JSON) and not name.startswith(".")


def _folder_files(folder: str) -> List[str]:
    if is_saved_dataset(folder):
        return [folder]
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        saved = [d for d in dirs if is_saved_dataset(os.path.join(root, d))]
        found += [os.path.join(root, d) for d in saved]
        dirs[:] = [d for d in dirs if d not in saved]
        found += [os.path.join(root, f) for f in files if _readable_file(os.path.join(root, f))]
    return sorted(found)


def _looks_like_hub_name(p: str) -> bool:
    if p.startswith(HUB_PREFIX):
        return True
    parts = p.split("/")
    return (len(parts) == 2 and all(parts) and not p.startswith((".", "~", os.sep)) and not glob.has_magic(p)
            and not _supported(p))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Quick check before a hub download (which otherwise retries for about a minute offline)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # cannot probe through a proxy cheaply; let the download try
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve_hub_dataset(name: str) -> str:
    """A hub dataset name -> its snapshot folder in the local hub cache, or STREAM_PREFIX + name when it is not
    cached but the hub can be reached. `hf:ORG/NAME/sub/folder` picks a folder of the snapshot."""
    name = name[len(HUB_PREFIX):] if name.startswith(HUB_PREFIX) else name
    parts = name.split("/")
    repo, sub = "/".join(parts[:2]), "/".join(parts[2:])
    try:
        from huggingface_hub import snapshot_download  # optional (hf extra), only for hub names

        folder = snapshot_download(repo, repo_type="dataset", local_files_only=True)
    except Exception:  # noqa: BLE001 (not cached: LocalEntryNotFoundError and friends)
        folder = None
    if folder is None:
        if not hub_reachable():
            raise FileNotFoundError(
                f"input {name} is neither a local path nor a dataset in the local Hugging Face hub cache, and the hub "
                "cannot be reached (offline): download it first (hf download --repo-type dataset "
                f"{repo}) or pass local files")
        return STREAM_PREFIX + name
    path = os.path.join(folder, sub) if sub else folder
    if not os.path.exists(path):
        raise FileNotFoundError(f"input {name}: the cached snapshot {folder} has no {sub}")
    return path


def expand_inputs(inputs: Sequence[str] | str) -> List[str]:
    """Resolve inputs to readable sources, in order: files stay, folders and globs expand (recursive, sorted),
    save_to_disk folders stay whole, hub names resolve (resolve_hub_dataset).

    Raises FileNotFoundError naming every missing path, ValueError for an unsupported file or a folder or glob
    with nothing readable.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    inputs = [os.fspath(p) for p in inputs]
    if not inputs:
        raise ValueError("no input files given")
    resolved, missing = [], []
    for p in inputs:
        if os.path.exists(p):
            resolved.append(p)
        elif glob.has_magic(p):
            hits = sorted(glob.glob(p, recursive=True))
            if not hits:
                raise FileNotFoundError(f"input pattern {p} matches no files")
            resolved += hits
        elif _looks_like_hub_name(p):
            resolved.append(resolve_hub_dataset(p))
        else:
            missing.append(p)
    if missing:
        raise FileNotFoundError(f"input file(s) not found: {', '.join(missing)}")
    files: List[str] = []
    for p in resolved:
        if p.startswith(STREAM_PREFIX):
            files.append(p)
        elif os.path.isdir(p):
            found = _folder_files(p)
            if not found:
                raise ValueError(f"input folder {p} holds no .jsonl/.json(.gz/.zst), .parquet or .txt files")
            files += found
        elif _supported(p):
            files.append(p)
        else:
            raise ValueError(
                f"unsupported input {p}: expected .jsonl/.json (optionally .gz or .zst), .parquet or .txt files, "
                "a folder or glob of them, a datasets save_to_disk folder, or a hub dataset name")
    return files


def source_size(source: str) -> Optional[int]:
    """On-disk bytes of a source (None for a streamed hub dataset)."""
    if source.startswith(STREAM_PREFIX):
        return None
    if os.path.isdir(source):
        return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(source) for f in fs)
    return os.path.getsize(source)


# ----------------------------------------------------------------------------------------------
# Readers
# ----------------------------------------------------------------------------------------------


def iter_chunks(source: str, json_key: str = "text", txt_mode: str = "file", hf_split: str = "train",
                chunk_docs: int = CHUNK_DOCS) -> Iterator[Chunk]:
    """Stream one source as chunks (see module docstring); InputError when it is unreadable or has no documents."""
    if source.startswith(STREAM_PREFIX):
        it = _hub_stream_chunks(source[len(STREAM_PREFIX):], json_key, hf_split, chunk_docs)
    elif os.path.isdir(source):
        it = _saved_dataset_chunks(source, json_key, hf_split, chunk_docs)
    elif source.endswith(PARQUET_SUFFIXES):
        it = _parquet_chunks(source, json_key, chunk_docs)
    elif source.endswith(TEXT_SUFFIXES):
        it = _txt_chunks(source, txt_mode, chunk_docs)
    else:
        it = _jsonl_chunks(source, chunk_docs)
    empty = True
    for chunk in it:
        if chunk.items:
            empty = False
            yield chunk
    if empty:
        raise InputError(f"empty input: no documents in {source} (an empty shard): remove it from the inputs, or "
                         "pass --skip-bad to skip it")


def _open_lines(path: str):
    """(binary line reader, raw file): gz and zst are decompressed as a stream."""
    raw = open(path, "rb")
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if path.endswith((".zst", ".zstd")):
        try:
            import zstandard  # optional (hf extra), only for .zst files
        except ImportError:
            raw.close()
            raise InputError(f"{path}: reading .zst needs the zstandard package (pip install zstandard)") from None
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return io.BufferedReader(reader, buffer_size=1 << 20), raw
    return raw, raw


def _decompress_errors():
    errs = [OSError, EOFError, zlib.error]
    try:
        import zstandard  # optional (hf extra)

        errs.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errs)


def _jsonl_chunks(path: str, chunk_docs: int) -> Iterator[Chunk]:
    f, raw = _open_lines(path)
    line = 1
    errors = _decompress_errors()
    with f, raw:
        while True:
            try:
                lines = list(islice(f, chunk_docs))
            except errors as e:
                what = "gzip" if path.endswith(".gz") else "zstd" if path.endswith((".zst", ".zstd")) else "file"
                raise InputError(f"{path}: corrupt or truncated {what} data after line {line - 1} "
                                 f"({type(e).__name__}: {e}): re-download or remove this file") from None
            if not lines:
                return
            yield Chunk(path, "jsonl", lines, first=line, done_bytes=raw.tell())
            line += len(lines)


def _txt_chunks(path: str, txt_mode: str, chunk_docs: int) -> Iterator[Chunk]:
    if txt_mode not in TXT_MODES:
        raise ValueError(f"txt_mode must be one of {TXT_MODES}, got {txt_mode!r}")
    with open(path, "rb") as f:
        if txt_mode == "file":
            data = f.read()
            yield Chunk(path, "text", [data] if data else [], where=[1], done_bytes=len(data))
            return
        items, where, block, start, lineno = [], [], [], 0, 0
        for lineno, raw_line in enumerate(f, 1):
            if raw_line.strip():
                if txt_mode == "line":
                    items.append(raw_line.rstrip(b"\n"))
                    where.append(lineno)
                else:
                    start = start or lineno
                    block.append(raw_line)
            elif block:
                items.append(b"".join(block).rstrip(b"\n"))
                where.append(start)
                block, start = [], 0
            if len(items) >= chunk_docs:
                yield Chunk(path, "text", items, where=where, done_bytes=f.tell())
                items, where = [], []
        if block:
            items.append(b"".join(block).rstrip(b"\n"))
            where.append(start)
        yield Chunk(path, "text", items, where=where, done_bytes=os.path.getsize(path))


def _column_values(column, source: str, key: str):
    """A pyarrow column -> python values: str, bytes (to be checked as UTF-8) or None."""
    import pyarrow as pa  # optional (hf extra), only for parquet; keeps preprocessing's start-up light

    t = column.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        try:
            return column.to_pylist()
        except UnicodeDecodeError:  # invalid UTF-8 in a string column: the worker names the row
            return column.cast(pa.large_binary() if pa.types.is_large_string(t) else pa.binary(), safe=False).to_pylist()
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return column.to_pylist()
    if pa.types.is_null(t):
        return [None] * len(column)
    raise InputError(f"{source}: column {key!r} holds {t}, not text: pass --json-key with the text column")


def _parquet_chunks(path: str, key: str, chunk_rows: int) -> Iterator[Chunk]:
    # optional (hf extra), only for parquet; keeps preprocessing's start-up light
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path}: not a readable parquet file ({e}): re-download or remove this file") from None
    names = pf.schema_arrow.names
    if key not in names:
        raise InputError(f"{path}: no column {key!r} (columns: {', '.join(names)}): pass --json-key COLUMN")
    total_rows, size = max(pf.metadata.num_rows, 1), os.path.getsize(path)
    row = 0
    batches = pf.iter_batches(batch_size=chunk_rows, columns=[key])
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{path}: corrupt parquet data after row {row} ({e}): re-download or remove "
                             "this file") from None
        values = _column_values(batch.column(0), path, key)
        yield Chunk(path, "text", values, first=row, unit="row", done_bytes=size * (row + len(values)) // total_rows)
        row += len(values)


def _table_chunks(tables, source: str, key: str, size: int, total_rows: int) -> Iterator[Chunk]:
    row = 0
    for table in tables:
        values = _column_values(table.column(key), source, key)
        yield Chunk(source, "text", values, first=row, unit="row",
                    done_bytes=size * (row + len(values)) // max(total_rows, 1))
        row += len(values)


def _pick_split(ds, source: str, split: str):
    import datasets  # optional (hf extra), only for Hugging Face datasets; slow to import

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in ds:
            raise InputError(f"{source}: no split {split!r} (splits: {', '.join(ds)}): pass --hf-split NAME")
        ds = ds[split]
    return ds


def _saved_dataset_chunks(path: str, key: str, split: str, chunk_rows: int) -> Iterator[Chunk]:
    import datasets  # optional (hf extra), only for Hugging Face datasets; slow to import

    try:
        ds = _pick_split(datasets.load_from_disk(path), path, split)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 (a damaged save_to_disk folder fails in many ways)
        raise InputError(f"{path}: not a readable datasets save_to_disk folder ({type(e).__name__}: {e})") from None
    if key not in ds.column_names:
        raise InputError(f"{path}: no column {key!r} (columns: {', '.join(ds.column_names)}): pass --json-key COLUMN")
    ds = ds.select_columns([key]).with_format("arrow")
    yield from _table_chunks(ds.iter(batch_size=chunk_rows), path, key, source_size(path), len(ds))


def _hub_stream_chunks(name: str, key: str, split: str, chunk_rows: int) -> Iterator[Chunk]:
    import datasets  # optional (hf extra), only for Hugging Face datasets; slow to import

    try:
        ds = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001 (not on the hub, gated, no such split, ...)
        raise InputError(f"{name}: cannot stream it from the Hugging Face hub ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if ds.column_names is not None and key not in ds.column_names:
        raise InputError(f"{name}: no column {key!r} (columns: {', '.join(ds.column_names)}): pass --json-key COLUMN")
    row = 0
    for batch in ds.select_columns([key]).iter(batch_size=chunk_rows):
        values = batch[key]
        yield Chunk(name, "text", values, first=row, unit="row")
        row += len(values)
