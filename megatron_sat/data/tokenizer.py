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


def _file_eod(raw, eod_token: Optional[str]) -> Optional[str]:
    """The end-of-document token of a bare tokenizers JSON file: the one asked for, else the first usual one."""
    vocab = raw.get_vocab(with_added_tokens=True)
    return eod_token or next((t for t in _EOD_CANDIDATES if t in vocab), None)


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


# tokenizer_config.json keys that change neither encode(text, add_special_tokens=False) nor the special token ids
# (chat_template and model_input_names only matter to chat formatting and model inputs).
_PLAIN_CONFIG_KEYS = {"backend", "tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token",
                      "clean_up_tokenization_spaces", "model_max_length", "added_tokens_decoder",
                      "chat_template", "model_input_names"}
_PLAIN_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}


class TokenizersOnly:
    """What preprocessing reads of a ``transformers`` fast tokenizer, straight from the ``tokenizers`` library.

    Loading a tokenizer folder through ``transformers`` imports torch (about 2.5 of the 3 CPU s a preprocessing
    run spends before its first document); this stand-in costs 0.3 s. :func:`plain_tokenizer` builds it only
    for a tokenizer whose ``transformers`` load could not give other ids (tests/test_preprocess_fast.py compares
    the two, backend JSON included). Written here because ``tokenizers`` has no notion of eos/bos ids.
    """

    is_fast = True

    def __init__(self, backend, eos: str, bos: Optional[str], pad: Optional[str]) -> None:
        self.backend_tokenizer = backend
        self.model_max_length = sys.maxsize
        self.eos_token_id = backend.token_to_id(eos)
        self.bos_token_id = None if bos is None else backend.token_to_id(bos)
        self.pad_token_id = None if pad is None else backend.token_to_id(pad)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _token_text(value) -> Optional[str]:
    return value.get("content") if isinstance(value, dict) else value


def plain_tokenizer(name: str, eod_token: Optional[str] = None) -> Optional[TokenizersOnly]:
    """A :class:`TokenizersOnly` for a ``tokenizer.json`` file, or a folder of ``tokenizer.json`` and a
    ``tokenizer_config.json`` of a plain fast class and only :data:`_PLAIN_CONFIG_KEYS` whose special tokens are
    all in the vocabulary; None for anything else (then ``transformers`` loads it)."""
    from tokenizers import Tokenizer as RawTokenizer  # the hf extra: a base install imports this module too

    if os.path.isfile(name):
        if not name.endswith(".json"):
            return None
        try:
            raw = RawTokenizer.from_file(name)
        except Exception:  # noqa: BLE001 (load_tokenizer's transformers path reports it)
            return None
        eos = _file_eod(raw, eod_token)
        return TokenizersOnly(raw, eos, None, None) if eos is not None and raw.token_to_id(eos) is not None else None
    folder_files = set(os.listdir(name)) if os.path.isdir(name) else set()
    if not {"tokenizer.json", "tokenizer_config.json"} <= folder_files or folder_files & {
            "special_tokens_map.json", "added_tokens.json", "tokenizer.model"}:
        return None
    try:
        with open(os.path.join(name, "tokenizer_config.json")) as f:
            config = json.load(f)
        raw = RawTokenizer.from_file(os.path.join(name, "tokenizer.json"))
    except Exception:  # noqa: BLE001 (load_tokenizer's transformers path reports it)
        return None
    if set(config) - _PLAIN_CONFIG_KEYS or config.get("tokenizer_class") not in _PLAIN_CLASSES:
        return None
    specials = {k: _token_text(config.get(k)) for k in ("eos_token", "bos_token", "pad_token", "unk_token")}
    specials["eos_token"] = eod_token or specials["eos_token"]
    added = config.get("added_tokens_decoder") or {}
    if any(raw.id_to_token(int(i)) != _token_text(t) for i, t in added.items()):
        return None
    if specials["eos_token"] is None or any(t is not None and raw.token_to_id(t) is None for t in specials.values()):
        return None
    return TokenizersOnly(raw, specials["eos_token"], specials["bos_token"], specials["pad_token"])


def _looks_like_local_path(name: str) -> bool:
    """Hub names are ``name`` or ``org/name``; anything else with a separator is a path."""
    return (
        name.startswith((os.sep, ".", "~"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
        or name.endswith(".json")
    )


def load_tokenizer(name_or_path: str, eod_token: Optional[str] = None, plain: bool = False) -> Tokenizer:
    """Load a tokenizer from a local folder, a ``tokenizers`` JSON file, or a hub name.

    Args:
        name_or_path: folder with ``tokenizer.json``/``tokenizer_config.json`` (or a
            sentencepiece ``tokenizer.model``), a ``.json`` tokenizers file, or a hub name.
        eod_token: end-of-document token text, overriding the tokenizer's eos token.
        plain: without ``transformers`` (and torch) where :func:`plain_tokenizer` applies (preprocessing).

    Raises:
        FileNotFoundError: the local path does not exist.
        ValueError: the path exists but is not a tokenizer, or it has no eos/eod token.
    """
    if isinstance(name_or_path, Tokenizer):
        return name_or_path
    name = os.path.expanduser(os.fspath(name_or_path))
    light = plain_tokenizer(name, eod_token) if plain else None
    if light is not None:
        return Tokenizer(light, name)
    import transformers  # here: it imports torch (2.5 CPU s), which plain loads avoid

    extra = {} if eod_token is None else {"eos_token": eod_token}

    if os.path.isfile(name):
        from tokenizers import Tokenizer as RawTokenizer  # the hf extra (as transformers above)

        try:
            raw = RawTokenizer.from_file(name)
        except Exception as e:
            raise ValueError(
                f"{name} is not a tokenizer: expected a Hugging Face `tokenizers` JSON file "
                f"(tokenizer.json) or a tokenizer folder ({type(e).__name__}: {e})"
            ) from None
        if eod_token is None:
            eod_token = _file_eod(raw, None)
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
    # the hf extra, and transformers imports torch: neither at this module's import
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
