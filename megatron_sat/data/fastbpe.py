"""An exact fast path for byte-level BPE tokenizers: the same ids from tiktoken's BPE, or None with a note.

    fast, note = fast_encoder(tokenizer)            # tokenizer: megatron_sat.data.tokenizer.Tokenizer
    fast, note = fast_encoder(tokenizer, sample)    # ... also checked on sample texts (the corpus' first documents)
    fast.encode(text) -> numpy.uint32 ids           # == tokenizer.encode(text) (no special tokens added)

tiktoken runs a byte-level BPE about twice as fast as the `tokenizers` library, but it merges by the rank of the
merged token, while `tokenizers` merges by the rank of the merge. The two give the same ids when the tokenizer is
what BPE training writes: a byte-level BPE, no normalizer, the GPT-2 pre-tokenizer pattern (or a Split regex
before a regex-less ByteLevel, as Llama-3 has), every multi-byte token made by exactly one merge, token ids
increasing with the merge order, added tokens that are plain strings. `fast_encoder` accepts a tokenizer only when
all of that holds AND the two give identical ids on every vocabulary token, on adversarial text (emoji, mixed
scripts, whitespace runs, every Unicode code point in letter/number/space/punctuation contexts, which catches any
difference between the two regex engines' character classes) and on the sample. Otherwise it returns None and a
one-line note saying why; callers then tokenize with the `tokenizers` library as before. Nothing is approximated.

The vocabulary and code point checks take about a second; their success is cached per tokenizer (a hash of its
JSON, with the tiktoken and tokenizers versions) under $XDG_CACHE_HOME/megatron_sat/fastbpe/. The sample is
checked every run.

Written by hand: tiktoken builds an encoder from ranks but has no converter from a `tokenizers` BPE, and
`tokenizers` has no exactness check against another BPE.
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from typing import Dict, List, Optional, Sequence, Tuple

import numpy

# tokenizers' ByteLevel pre-tokenizer regex (use_regex=True), as in its source (pre_tokenizers/byte_level.rs).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

ADVERSARIAL = [
    "Hello, world! It's a test: they'll've 'd 'S 'LL \"quoted\" ok.",
    "emoji 😀😃🇺🇳👨‍👩‍👧‍👦 and ZWJ 🏳️‍🌈 keycap 1️⃣ skin 👍🏽",
    "mixed: English, Русский, 中文字符, 日本語のテキスト, 한국어, العربية, עברית, हिन्दी, ไทย, Ελληνικά",
    " " * 1000 + "x" + "\t" * 300 + "y" + "\n" * 500 + " \n \r\n\u3000\u00a0\u2003\u200b\ufeff end   ",
    "numbers 1234567890 ١٢٣ ⅫⅯ ½ ²³ 𝟘𝟙 0x1F 3.14e-10",
    "punct !!!??? ... --- ___ ''' \"\"\" ``` ~~~ <<<>>> ///\\\\\\ {{{}}} $$$ %%% ^^^ &&& ***",
    "code: def f(x):\n    return x**2  # comment\n\tif a != b: pass\r\n",
    "combining e\u0301 a\u0308 \u0915\u094d\u0937 Z\u0351\u0352\u0357 control \x00\x01\x1b\x7f\x85 end",
    "a" * 5000 + " " + "ab" * 2000,
    "'s'll've're'd'm't ' s' 's 'S 'T\u2019s",
]


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer applies before BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _pattern(spec: dict) -> Tuple[Optional[str], str]:
    """(regex of the pre-tokenizer, why not)."""
    pre = spec.get("pre_tokenizer") or {}
    if spec.get("normalizer"):
        return None, f"it has a normalizer ({spec['normalizer'].get('type')})"
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space"):
            return None, "its ByteLevel pre-tokenizer adds a prefix space"
        if not pre.get("use_regex", True):
            return None, "its ByteLevel pre-tokenizer splits nothing (use_regex false)"
        return GPT2_PATTERN, ""
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 2:
        split, byte_level = pre["pretokenizers"]
        if (split.get("type") == "Split" and "Regex" in (split.get("pattern") or {})
                and split.get("behavior") == "Isolated" and not split.get("invert")
                and byte_level.get("type") == "ByteLevel" and not byte_level.get("add_prefix_space")
                and not byte_level.get("use_regex", True)):
            return split["pattern"]["Regex"], ""
    return None, f"its pre-tokenizer ({pre.get('type')}) is not a byte-level BPE's"


def _ranks(spec: dict) -> Tuple[Optional[dict], Optional[dict], str]:
    """(mergeable ranks {bytes: id}, special tokens {str: id}, why not) from a tokenizers JSON spec."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None, None, f"its model is {model.get('type')}, not BPE"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return None, None, f"its BPE sets {key}"
    if model.get("byte_fallback"):
        return None, None, "its BPE uses byte fallback (not a byte-level BPE)"
    added = spec.get("added_tokens") or []
    for a in added:
        if a.get("lstrip") or a.get("rstrip") or a.get("single_word"):
            return None, None, f"added token {a['content']!r} strips spaces or matches single words"
    contents = [a["content"] for a in added]
    if any(a != b and b.startswith(a) for a in contents for b in contents):
        return None, None, "one added token is a prefix of another"
    specials = {a["content"]: int(a["id"]) for a in added}
    alphabet = _bytes_to_unicode()
    table = str.maketrans({c: chr(b) for b, c in alphabet.items()})
    chars = set(alphabet.values())

    def to_bytes(text: str) -> Optional[bytes]:
        return text.translate(table).encode("latin-1") if chars.issuperset(text) else None

    ranks: Dict[bytes, int] = {}
    for text, i in model["vocab"].items():
        if text in specials:
            continue
        tok = to_bytes(text)
        if tok is None:
            return None, None, f"token {text!r} is not in the byte-level alphabet"
        ranks[tok] = int(i)
    if len(set(ranks.values())) != len(ranks) or set(ranks.values()) & set(specials.values()):
        return None, None, "two tokens share an id"
    if any(bytes([b]) not in ranks for b in range(256)):
        return None, None, "not all 256 bytes are tokens"
    made, last = set(), -1
    for m in model.get("merges", []):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        tok = to_bytes(a + b)
        rank = ranks.get(tok)
        if rank is None or tok in made:
            return None, None, f"merge {a!r} {b!r} makes no token or one made before"
        if rank <= last:
            return None, None, "token ids do not increase with the merge order"
        made.add(tok)
        last = rank
    if len(made) != sum(len(t) > 1 for t in ranks):
        return None, None, "some multi-byte tokens are not made by a merge"
    if any(s.encode() in ranks and len(s.encode()) > 1 for s in specials):
        return None, None, "an added token is also a merged token"
    return ranks, specials, ""


class FastBPE:
    """tiktoken's BPE over a byte-level BPE's ranks (built and checked by :func:`fast_encoder`)."""

    def __init__(self, pattern: str, ranks: dict, specials: dict, name: str) -> None:
        import tiktoken  # the hf extra; fast_encoder says so in its note when it is missing

        self.spec = (pattern, ranks, specials, name)
        self.encoding = tiktoken.Encoding(f"megatron_sat:{name}", pat_str=pattern, mergeable_ranks=ranks,
                                          special_tokens=specials)
        self._core = self.encoding._core_bpe  # the Rust encoder: no Python checks per call, no thread pool
        self._allowed = set(specials)         # added tokens in the text are matched, as tokenizers does

    def __reduce__(self):
        return FastBPE, self.spec

    def encode(self, text: str) -> numpy.ndarray:
        """uint32 ids of text (which must be valid Unicode: no lone surrogates)."""
        return numpy.frombuffer(self._core.encode_to_tiktoken_buffer(text, self._allowed), dtype=numpy.uint32)

    def encode_batch(self, texts: Sequence[str]) -> List[numpy.ndarray]:
        enc, allowed = self._core.encode_to_tiktoken_buffer, self._allowed
        return [numpy.frombuffer(enc(t, allowed), dtype=numpy.uint32) for t in texts]


def _hf_ids(tokenizer, texts: Sequence[str]) -> List[List[int]]:
    backend = tokenizer.hf.backend_tokenizer
    batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [e.ids for e in batch(list(texts), add_special_tokens=False)]


def _first_difference(tokenizer, fast: FastBPE, texts: Sequence[str]) -> Optional[int]:
    for i, (want, text) in enumerate(zip(_hf_ids(tokenizer, texts), texts)):
        if fast.encode(text).tolist() != want:
            return i
    return None


def _codepoint_texts() -> List[str]:
    """Every assigned code point (private use and surrogates aside) next to letters, digits, spaces and newlines,
    in texts of ~64 KB: a character class the two regex engines see differently changes the pieces."""
    texts, parts = [], []
    for c in range(0x110000):
        ch = chr(c)
        if unicodedata.category(ch) in ("Cn", "Co", "Cs"):
            continue
        parts.append(f"{ch}a{ch}1{ch} {ch}\n")
        if len(parts) == 8192:
            texts.append("".join(parts))
            parts = []
    texts.append("".join(parts))
    return texts


def _vocab_texts(ranks: dict, specials: dict) -> List[str]:
    texts = []
    for tok in ranks:
        try:
            texts.append(tok.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    texts += [f"x{s}y {s}{s}" for s in specials]
    return texts


def _cache_path(spec_json: str) -> str:
    import tiktoken  # the hf extra (fast_encoder checked it is there)
    import tokenizers

    key = hashlib.sha256(f"{spec_json}\n{tiktoken.__version__}\n{tokenizers.__version__}\n{GPT2_PATTERN}\n"
                         f"{ADVERSARIAL}\n1".encode()).hexdigest()[:32]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron_sat", "fastbpe", key)


def fast_encoder(tokenizer, sample: Sequence[str] = (), use_cache: bool = True) -> Tuple[Optional[FastBPE], str]:
    """(FastBPE, "") when it gives the tokenizer's own ids, else (None, one-line note why not)."""
    note = "tokenizing with the tokenizers library (the exact tiktoken fast path does not apply: {})"
    hf = getattr(tokenizer, "hf", None)
    if not getattr(hf, "is_fast", False):
        return None, note.format("not a fast tokenizer")
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return None, note.format("tiktoken is not installed")
    spec_json = hf.backend_tokenizer.to_str()
    spec = json.loads(spec_json)
    pattern, why = _pattern(spec)
    if pattern is None:
        return None, note.format(why)
    ranks, specials, why = _ranks(spec)
    if ranks is None:
        return None, note.format(why)
    try:
        fast = FastBPE(pattern, ranks, specials, os.path.basename(os.path.normpath(str(tokenizer.name))))
    except Exception as e:  # noqa: BLE001 (a pattern tiktoken's regex engine refuses, ...)
        return None, note.format(f"tiktoken refuses it: {type(e).__name__}: {e}")
    cache = _cache_path(spec_json)
    if not (use_cache and os.path.isfile(cache)):
        checks = (("vocabulary token", _vocab_texts(ranks, specials)), ("adversarial text", ADVERSARIAL),
                  ("code point text", _codepoint_texts()))
        for what, texts in checks:
            i = _first_difference(tokenizer, fast, texts)
            if i is not None:
                return None, note.format(f"the ids of {what} {texts[i][:40]!r} differ")
        if use_cache:
            try:
                os.makedirs(os.path.dirname(cache), exist_ok=True)
                with open(cache, "w") as f:
                    f.write("ok\n")
            except OSError:
                pass
    i = _first_difference(tokenizer, fast, list(sample))
    if i is not None:
        return None, note.format(f"the ids of corpus document {i + 1} of the sample differ")
    return fast, ""
