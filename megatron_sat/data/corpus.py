"""Text sources: the embedded default corpus and readers for jsonl / plain-text inputs.

The default corpus needs no download. It is real English prose that ships with every CPython
installation:

* ``topics``: the text of :mod:`pydoc_data.topics`, i.e. the Python Language Reference as
  plain text (79 documents, ~465 KB on CPython 3.11);
* ``docstrings``: long docstrings (>= 200 characters) of the pure-Python standard library,
  read with :mod:`ast` (never imported), one document per module (~310 documents, ~1.1 MB
  on CPython 3.11).

The documents are put in a fixed pseudo-random order (so the last few percent, which Megatron
uses as the validation split, are a mix of both sources). The content is deterministic for a
given Python version; it differs between Python minor versions, which is why
:func:`write_default_corpus` records the Python version and a SHA-256 of the file it writes.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pydoc_data.topics import topics
from typing import List, Sequence, Tuple

DEFAULT_CORPUS_FILENAME = "default_corpus.jsonl"
DEFAULT_SOURCES = ("topics", "docstrings")

# Parts of the stdlib that are tests, tools or generated tables rather than documented API.
_SKIP_DIRS = {
    "test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo",
    "ensurepip", "__pycache__", "encodings", "pydoc_data", "__phello__",
}
_MIN_DOCSTRING_CHARS = 200
_SHUFFLE_SEED = 20240601

# ----------------------------------------------------------------------------------------------
# Default corpus
# ----------------------------------------------------------------------------------------------


def _topic_documents() -> List[Tuple[str, str]]:
    """(name, text) for every topic of the Python Language Reference, sorted by name."""
    return [(f"topics/{k}", topics[k].strip() + "\n") for k in sorted(topics)]


def _docstring_documents() -> List[Tuple[str, str]]:
    """(name, text) per stdlib module: its long docstrings (module, classes, functions)."""
    lib = sysconfig.get_paths()["stdlib"]
    docs, seen = [], set()
    for root, dirs, files in os.walk(lib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        for fname in sorted(files):
            if not fname.endswith(".py"):
                continue
            path = os.path.join(root, fname)
            try:
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
                continue
            parts = []
            nodes = [tree] + [
                n for n in ast.walk(tree)
                if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            ]
            for node in nodes:
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) >= _MIN_DOCSTRING_CHARS and doc not in seen:
                    seen.add(doc)
                    parts.append(doc.strip())
            if parts:
                name = "docstrings/" + os.path.relpath(path, lib).replace(os.sep, "/")
                docs.append((name, "\n\n".join(parts) + "\n"))
    return docs


def default_corpus_documents(sources: Sequence[str] = DEFAULT_SOURCES) -> List[Tuple[str, str]]:
    """Return the default corpus as a list of (name, text), in a fixed shuffled order."""
    unknown = set(sources) - set(DEFAULT_SOURCES)
    if unknown:
        raise ValueError(f"unknown corpus source(s) {sorted(unknown)}; choose from {DEFAULT_SOURCES}")
    docs: List[Tuple[str, str]] = []
    if "topics" in sources:
        docs += _topic_documents()
    if "docstrings" in sources:
        docs += _docstring_documents()
    random.Random(_SHUFFLE_SEED).shuffle(docs)
    return docs


@dataclass
class CorpusInfo:
    """What :func:`write_default_corpus` wrote."""

    path: str
    num_docs: int
    num_chars: int
    sha256: str
    python_version: str
    sources: Tuple[str, ...]


def write_default_corpus(
    out_dir: str,
    filename: str = DEFAULT_CORPUS_FILENAME,
    sources: Sequence[str] = DEFAULT_SOURCES,
) -> CorpusInfo:
    """Write the default corpus as ``out_dir/filename`` (jsonl, one ``{"text": ...}`` per line).

    Deterministic for a given Python version (same bytes on every run). A manifest with the
    document count, SHA-256 and Python version is written next to it as ``<filename>.info.json``.
    """
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, filename)
    docs = default_corpus_documents(sources)
    data = "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for _, text in docs)
    raw = data.encode("utf-8")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(raw)
    os.replace(tmp, path)
    info = CorpusInfo(
        path=path,
        num_docs=len(docs),
        num_chars=sum(len(t) for _, t in docs),
        sha256=hashlib.sha256(raw).hexdigest(),
        python_version=".".join(map(str, sys.version_info[:3])),
        sources=tuple(sources),
    )
    with open(path + ".info.json", "w") as f:
        json.dump(asdict(info), f, indent=2)
    return info


__all__ = ["CorpusInfo", "DEFAULT_CORPUS_FILENAME", "default_corpus_documents", "write_default_corpus"]
