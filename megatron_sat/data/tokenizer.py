"""Tokenizer wrapper for Megatron's GPT datasets, and a local byte-level BPE trainer.

:class:`Tokenizer` wraps a Hugging Face tokenizer and exposes what
``megatron.core.datasets.GPTDataset`` reads from ``GPTDatasetConfig.tokenizer``:
``vocab_size``, ``eod``, ``pad`` and ``unique_identifiers`` (hashed into the index-cache
names), plus ``encode``/``decode`` (aliases ``tokenize``/``detokenize``).

Load one with :func:`load_tokenizer`, from

* a local ``transformers`` tokenizer folder (e.g. the Llama-2 tokenizer, 32,000 tokens, as
  used in the paper; or a folder written by :func:`train_bpe_tokenizer`),
* a ``tokenizers`` JSON file (``tokenizer.json``),
* a hub name such as ``meta-llama/Llama-2-7b-hf`` (only where the hub is reachable or the
  name is in the local Hugging Face cache).

:func:`train_bpe_tokenizer` trains a byte-level BPE on local text (no download) and saves a
folder that ``transformers.AutoTokenizer.from_pretrained`` loads. Byte-level BPE decodes
back to exactly the input text.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import OrderedDict
from typing import Iterable, List, Optional, Sequence

from megatron_sat.data.encode import iter_documents
from megatron_sat.data.readers import expand_inputs, hub_reachable

EOD_TOKEN = "<|endoftext|>"
# Tried in order when a bare tokenizers JSON file gives no end-of-document token.
_EOD_CANDIDATES = (EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


class Tokenizer:
    """A Hugging Face tokenizer with the interface Megatron's GPT datasets need.

    Args:
        hf_tokenizer: a ``transformers`` tokenizer (fast or slow).
        name: how it was named when loaded (path or hub name), for logs and cache identity.
    """

    def __init__(self, hf_tokenizer, name: str) -> None:
        self.hf = hf_tokenizer
        self.name = name
        # Documents are longer than any model context; silence the length warning.
        self.hf.model_max_length = sys.maxsize
        eod = hf_tokenizer.eos_token_id
        if eod is None:
            raise ValueError(
                f"tokenizer {name!r} defines no end-of-sequence token (eos_token); "
                f"it is needed as the end-of-document token"
            )
        self._eod = int(eod)

    # -- what GPTDataset / MockGPTDataset read ----------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added/special tokens included (``len(hf_tokenizer)``)."""
        return len(self.hf)

    @property
    def eod(self) -> int:
        """End-of-document token id (the tokenizer's eos token), appended to every document."""
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def bos(self) -> Optional[int]:
        return self.hf.bos_token_id

    @property
    def pad(self) -> int:
        """Pad id for GPTDataset's padding mask: the tokenizer's own pad token when it has one
        distinct from eod, else -1 (never a real token)."""
        pad = self.hf.pad_token_id
        return -1 if pad is None or pad == self._eod else int(pad)

    @property
    def fingerprint(self) -> str:
        """A short hash of the vocabulary (token -> id) and eod: equal for copies of one tokenizer wherever
        they lie, different for another vocabulary (recorded by preprocessing, checked by the trainer)."""
        vocab = sorted(self.hf.get_vocab().items(), key=lambda kv: kv[1])
        return hashlib.blake2b(json.dumps([vocab, self.eod]).encode(), digest_size=8).hexdigest()

    @property
    def unique_identifiers(self) -> OrderedDict[str, object]:
        """Identity hashed into Megatron's dataset index-cache names."""
        return OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("name", os.path.basename(os.path.normpath(self.name))),
                ("vocab_size", self.vocab_size),
                ("eod", self.eod),
            ]
        )

    # -- text <-> ids ------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = False) -> List[int]:
        """Token ids of ``text``; no special tokens unless ``add_bos`` (then bos first)."""
        ids = self.hf.encode(text, add_special_tokens=False)
        if add_bos:
            if self.bos is None:
                raise ValueError(f"tokenizer {self.name!r} has no bos token")
            ids = [self.bos] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids (no whitespace clean-up, so byte-level BPE round-trips exactly)."""
        return self.hf.decode(
            [int(i) for i in ids],
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    tokenize = encode
    detokenize = decode

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eod={self.eod})"


class NullTokenizer:
    """Stand-in for mock-data runs without a real tokenizer: ``vocab_size`` ids, eod = last id."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1
        self.pad = -1
        self.unique_identifiers = OrderedDict(
            [("class", "NullTokenizer"), ("vocab_size", self.vocab_size)]
        )

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self.vocab_size})"


def _looks_like_local_path(name: str) -> bool:
    """Hub names are ``name`` or ``org/name``; anything else with a separator is a path."""
    return (
        name.startswith((os.sep, ".", "~"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
        or name.endswith(".json")
    )


def load_tokenizer(name_or_path: str, eod_token: Optional[str] = None) -> Tokenizer:
    """Load a tokenizer from a local folder, a ``tokenizers`` JSON file, or a hub name.

    Args:
        name_or_path: folder with ``tokenizer.json``/``tokenizer_config.json`` (or a
            sentencepiece ``tokenizer.model``), a ``.json`` tokenizers file, or a hub name.
        eod_token: end-of-document token text, overriding the tokenizer's eos token.

    Raises:
        FileNotFoundError: the local path does not exist.
        ValueError: the path exists but is not a tokenizer, or it has no eos/eod token.
    """
    if isinstance(name_or_path, Tokenizer):
        return name_or_path
    name = os.path.expanduser(os.fspath(name_or_path))
    import transformers

    extra = {} if eod_token is None else {"eos_token": eod_token}

    if os.path.isfile(name):
        from tokenizers import Tokenizer as RawTokenizer

        try:
            raw = RawTokenizer.from_file(name)
        except Exception as e:
            raise ValueError(
                f"{name} is not a tokenizer: expected a Hugging Face `tokenizers` JSON file "
                f"(tokenizer.json) or a tokenizer folder ({type(e).__name__}: {e})"
            ) from None
        if eod_token is None:
            vocab = raw.get_vocab()
            eod_token = next((t for t in _EOD_CANDIDATES if t in vocab), None)
            if eod_token is None:
                raise ValueError(
                    f"tokenizer file {name} has none of the usual end-of-document tokens "
                    f"{_EOD_CANDIDATES}; pass eod_token= (--eod-token)"
                )
        hf = transformers.PreTrainedTokenizerFast(
            tokenizer_object=raw, eos_token=eod_token, clean_up_tokenization_spaces=False
        )
        return Tokenizer(hf, name)

    if os.path.isdir(name):
        try:
            hf = transformers.AutoTokenizer.from_pretrained(name, local_files_only=True, **extra)
        except Exception as e:
            files = sorted(os.listdir(name))
            known = {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"}
            what = f"could not load tokenizer folder {name}" if known & set(files) else (
                f"{name} is not a tokenizer folder (expected tokenizer.json and/or "
                "tokenizer_config.json, or tokenizer.model)")
            raise ValueError(
                f"{what}; found: {', '.join(files[:10]) or 'nothing'}; "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from None
        return Tokenizer(hf, name)

    if _looks_like_local_path(name):
        raise FileNotFoundError(f"tokenizer path does not exist: {name}")
    # A hub name: the local Hugging Face cache first, then the hub if it can be reached.
    try:
        return Tokenizer(
            transformers.AutoTokenizer.from_pretrained(name, local_files_only=True, **extra), name
        )
    except Exception:
        pass
    hint = "Pass the path of a local tokenizer folder instead."
    if not hub_reachable():
        raise ValueError(
            f"could not load tokenizer {name!r}: it is not a local path, not in the local "
            f"Hugging Face cache, and the hub cannot be reached (offline). {hint}"
        )
    try:
        hf = transformers.AutoTokenizer.from_pretrained(name, **extra)
    except Exception as e:
        raise ValueError(
            f"could not load tokenizer {name!r}: not a local path, and loading it from the "
            f"Hugging Face hub failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            f"{hint}"
        ) from None
    return Tokenizer(hf, name)


def train_bpe_tokenizer(
    text_files: Sequence[str] | str,
    vocab_size: int,
    out_dir: str,
    json_key: str = "text",
    min_frequency: int = 2,
    eod_token: str = EOD_TOKEN,
) -> Tokenizer:
    """Train a byte-level BPE on local text and save a ``transformers``-loadable folder.

    Args:
        text_files: .jsonl/.json (field ``json_key``) or .txt files, or folders of them.
        vocab_size: target vocabulary size, special token included (e.g. 8192).
        out_dir: folder to write (``tokenizer.json`` + ``tokenizer_config.json``).
        min_frequency: minimum pair count for a merge.
        eod_token: the single special token; it is eos, bos and end-of-document.

    Returns:
        The trained tokenizer, loaded back from ``out_dir``.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast


    files = expand_inputs(text_files)
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be > 256 for byte-level BPE, got {vocab_size}")

    def docs():
        for path in files:
            yield from iter_documents(path, json_key=json_key)

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eod_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(docs(), trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=eod_token,
        bos_token=eod_token,
        clean_up_tokenization_spaces=False,
    )
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir)
    return load_tokenizer(out_dir)
