"""The fast preprocessing path gives exactly the bytes of the plain one (CPU, ~30-60 s).

* megatron_sat.data.fastbpe: tiktoken's ids equal the Hugging Face tokenizer's on the whole embedded corpus and on
  adversarial text; a tokenizer it cannot reproduce is refused (structurally, or by the self-check) and
  preprocessing falls back to the tokenizers library with a one-line note.
* megatron_sat.data.indexed: .bin/.idx equal megatron-core's IndexedDatasetBuilder byte for byte.
* preprocess: fast path == --no-fast-bpe == megatron-core's writer, for 1 and 2 workers, plain jsonl read in
  byte blocks by the workers (documents crossing block edges), parquet, and bad lines named by file and line.
"""

import json
import os
import subprocess
import sys

import numpy
import pytest

pytest.importorskip("tiktoken", reason="needs the hf extra (tiktoken)")
pytest.importorskip("tokenizers", reason="needs the hf extra (transformers, tokenizers)")

from megatron_sat.data import default_corpus_documents, load_tokenizer, preprocess, train_bpe_tokenizer  # noqa: E402
from megatron_sat.data.fastbpe import ADVERSARIAL, _cache_path, fast_encoder  # noqa: E402
from megatron_sat.data.indexed import IndexWriter  # noqa: E402
from megatron_sat.data.readers import Block, read_block  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MORE_ADVERSARIAL = [
    "an added token <|endoftext|> inside, twice<|endoftext|><|endoftext|>and glued",
    " " * 20000 + "\n" * 3000 + "\t \t" * 2000 + "end",
    "🤖" * 3000 + "\u200d".join("👩🔬") + "漢字かなカナ한글ğüşçöıİ",
    "\u2028line\u2029para\u0085nel\x0bvt\x0cff\x1cfs\x1dgs\x1ers\x1fus\u180e\u2060\u00ad",
    "RTL: \u202eevil\u202c עִבְרִית العَرَبِيَّة ۱۲۳ ٤٥٦ and Devanagari १२३",
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fast")


@pytest.fixture(scope="module", autouse=True)
def private_cache(workdir):
    """The self-check's cache goes to a test folder, not the user's ~/.cache."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(workdir / "cache")
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="module")
def corpus():
    return [t for _, t in default_corpus_documents()]


@pytest.fixture(scope="module")
def tokenizer(workdir, corpus):
    """A 4,096-token byte-level BPE trained on the embedded corpus (the kind of tokenizer the fast path is for)."""
    src = workdir / "train.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus[:120]))
    return train_bpe_tokenizer([str(src)], 4096, str(workdir / "bpe"))


def write_jsonl(path, texts, extra_lines=()):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def same_files(a, b):
    return all(open(a + e, "rb").read() == open(b + e, "rb").read() for e in (".bin", ".idx"))


def megatron_core_dataset(prefix, docs, dtype):
    """The reference: megatron-core's own writer, one add_document per document."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        builder.add_document(numpy.array(d, dtype=numpy.int64), [len(d)])
    builder.finalize(prefix + ".idx")
    return prefix


def test_fast_ids_equal_the_tokenizer_and_the_check_is_cached(tokenizer, corpus, workdir):
    fast, note = fast_encoder(tokenizer, corpus[:3])
    assert fast is not None, note
    assert os.listdir(workdir / "cache" / "megatron_sat" / "fastbpe"), "the passed self-check is cached"
    texts = corpus + ADVERSARIAL + MORE_ADVERSARIAL
    want = tokenizer.hf.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    diff = [i for i, (t, w) in enumerate(zip(texts, want)) if fast.encode(t).tolist() != w.ids]
    assert not diff, f"{len(diff)} texts differ, first: {texts[diff[0]][:80]!r}"
    assert fast.encode("x<|endoftext|>").tolist()[-1] == tokenizer.eod  # added tokens matched, as tokenizers does
    assert sum(len(w.ids) for w in want) > 300_000  # the comparison covered real volume


def _edit(tok_json, out_dir, edit):
    spec = json.loads(tok_json)
    edit(spec)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return load_tokenizer(path)


def _abc_trap(spec):
    """Merges bc < ab < ab+c: tokenizers gives 'abc' -> [a, bc] (no merge a+bc), tiktoken's lookup gives [abc]."""
    vocab, n = spec["model"]["vocab"], len(spec["model"]["vocab"])
    for word in ("qz", "jq", "jqz"):
        assert word not in vocab
    vocab.update({"qz": n, "jq": n + 1, "jqz": n + 2})
    spec["model"]["merges"] += [["q", "z"], ["j", "q"], ["jq", "z"]]


def test_tokenizers_the_fast_path_cannot_reproduce_fall_back_with_a_note(tokenizer, workdir, tmp_path, capfd):
    tok_json = tokenizer.hf.backend_tokenizer.to_str()

    def permute(spec):  # two merged tokens swap ids: ids no longer follow the merge order
        vocab = spec["model"]["vocab"]
        a, b = spec["model"]["merges"][10], spec["model"]["merges"][20]
        ta, tb = "".join(a) if isinstance(a, list) else a.replace(" ", ""), \
            "".join(b) if isinstance(b, list) else b.replace(" ", "")
        vocab[ta], vocab[tb] = vocab[tb], vocab[ta]

    def prefix_space(spec):
        spec["pre_tokenizer"]["add_prefix_space"] = True

    def normalizer(spec):
        spec["normalizer"] = {"type": "NFKC"}

    cases = {"permuted": (permute, "merge order"), "prefix": (prefix_space, "prefix space"),
             "nfkc": (normalizer, "normalizer"), "trap": (_abc_trap, "differ")}
    for name, (edit, why) in cases.items():
        tok = _edit(tok_json, str(tmp_path / name), edit)
        fast, note = fast_encoder(tok, use_cache=False)
        assert fast is None and why in note and "tokenizers library" in note, (name, note)
    trap = _edit(tok_json, str(tmp_path / "trap"), _abc_trap)
    assert trap.encode("jqz") != [trap.hf.get_vocab()["jqz"]]  # the trap is real: tokenizers never makes jqz
    # preprocessing with such a tokenizer: one line saying so, and the plain path's bytes
    src = write_jsonl(tmp_path / "t.jsonl", ["jqz jqzz hello", "plain text"])
    res = preprocess([src], trap, str(tmp_path / "trap_out"), workers=1, progress=False)
    err = capfd.readouterr().err
    assert res.encoder == "tokenizers"
    assert [line for line in err.splitlines() if "fast path does not apply" in line] == [
        err.strip().splitlines()[-1]]
    preprocess([src], trap, str(tmp_path / "trap_slow"), workers=1, progress=False, fast_bpe=False)
    assert same_files(str(tmp_path / "trap_out"), str(tmp_path / "trap_slow"))


def test_a_passed_self_check_is_cached_per_tokenizer(tokenizer, tmp_path):
    """The cached pass belongs to one tokenizer: after the trained tokenizer passed (and its pass is cached), a second
    tokenizer that differs from it only by the abc trap (structurally acceptable, wrong ids) gets the full check
    with the cache on, is refused, and leaves no cached pass of its own."""
    fast, note = fast_encoder(tokenizer)
    assert fast is not None, note
    cache = os.path.join(os.environ["XDG_CACHE_HOME"], "megatron_sat", "fastbpe")
    passed = sorted(os.listdir(cache))
    assert passed
    trap = _edit(tokenizer.hf.backend_tokenizer.to_str(), str(tmp_path / "trap"), _abc_trap)
    fast, note = fast_encoder(trap)  # use_cache=True, as preprocessing calls it
    assert fast is None and "the ids of vocabulary token 'jqz' differ" in note, note
    assert sorted(os.listdir(cache)) == passed
    # the sample is checked on every run, cached pass or not: with a pass cached for the trap (as a stale cache
    # could hold), a sample holding 'jqz' is still refused
    key = _cache_path(trap.hf.backend_tokenizer.to_str())
    with open(key, "w") as f:
        f.write("ok\n")
    assert fast_encoder(trap, ["plain text"])[0] is not None  # the cached pass is taken: no vocabulary check
    fast, note = fast_encoder(trap, ["plain text", "jqz and more"])
    assert fast is None and "the ids of corpus document 2 of the sample differ" in note, note
    os.remove(key)


def test_writer_equals_megatron_core_byte_for_byte(tmp_path):
    rng = numpy.random.default_rng(0)
    for dtype, top in ((numpy.uint16, 65499), (numpy.int32, 200_000)):
        for n_docs in (0, 1, 57):
            docs = [rng.integers(0, top, size=int(rng.integers(1, 300))).tolist() for _ in range(n_docs)]
            ref = megatron_core_dataset(str(tmp_path / f"ref_{n_docs}"), docs, dtype)
            ours = str(tmp_path / f"ours_{n_docs}")
            w = IndexWriter(ours + ".bin", dtype)
            for lo in range(0, n_docs, 10):  # chunks of documents, as preprocess writes them
                part = docs[lo:lo + 10]
                w.add(numpy.array([i for d in part for i in d], dtype=numpy.int64), [len(d) for d in part])
            w.finalize(ours + ".idx")
            assert same_files(ours, ref), (dtype, n_docs)


def test_read_block_splits_lines_exactly(tmp_path):
    lines = [b"x" * n for n in (0, 1, 5, 17, 0, 3, 40, 2)]
    for tail in (b"\n", b""):
        path = tmp_path / "f.jsonl"
        path.write_bytes(b"\n".join(lines) + tail)
        size = path.stat().st_size
        for block in (1, 2, 3, 7, 16, 1000):
            got = [line for s in range(0, size, block) for line in read_block(Block(str(path), s, min(s + block, size))).items]
            assert [g.rstrip(b"\n") for g in got] == lines, (tail, block)


def test_preprocess_fast_equals_plain_and_megatron_core(tokenizer, corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = corpus[:150] + ADVERSARIAL + MORE_ADVERSARIAL + ["", "short"]
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    ref_docs = [tokenizer.encode(t) + [tokenizer.eod] for t in texts if t]
    ref = megatron_core_dataset(str(tmp_path / "ref"), ref_docs, numpy.uint16)
    pq.write_table(pa.table({"text": texts}), str(tmp_path / "in.parquet"), row_group_size=40)
    runs = [(src, 1, 256, True), (src, 2, 1, True), (src, 2, 3, False), (str(tmp_path / "in.parquet"), 2, 16, True)]
    for k, (inp, workers, chunksize, fast) in enumerate(runs):
        out = str(tmp_path / f"out{k}")
        res = preprocess([inp], tokenizer, out, workers=workers, chunksize=chunksize, progress=False, fast_bpe=fast)
        assert res.encoder == ("tiktoken" if fast else "tokenizers")
        assert res.num_docs == len(ref_docs) and same_files(out, ref), (inp, workers, chunksize, fast)
    # bad lines in a file read in 4 KiB blocks by 2 workers: named by their true line number
    bad = write_jsonl(tmp_path / "bad.jsonl", corpus[:40], extra_lines=['{"text": "a\\ud800b"}', "not json"])
    cli = subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", bad,
                          "--tokenizer", str(tokenizer.name), "--output-prefix", str(tmp_path / "bad"),
                          "--workers", "2", "--chunksize", "1", "--quiet"], capture_output=True, text=True)
    assert cli.returncode == 2, cli.stderr
    assert cli.stderr.strip().splitlines()[-1].startswith(f"preprocess_data: error: {bad}:41: field 'text' holds a "
                                                          "lone surrogate"), cli.stderr
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("bad")) == ["bad.jsonl"]  # nothing left behind
    res = preprocess([bad], tokenizer, str(tmp_path / "bad"), workers=2, chunksize=1, skip_bad=True, progress=False)
    assert res.num_docs == 40 and res.num_bad == 2


def test_preprocessing_imports_neither_torch_nor_megatron_core(tokenizer, tmp_path):
    """Not by importing, and not by a whole run on a tokenizer folder (plain load: no transformers, no torch).
    The package's `preprocess` is the function even after its submodule was imported (by shards, here)."""
    src = write_jsonl(tmp_path / "in.jsonl", ["one document", "and another"])
    code = ("import sys, megatron_sat.data.shards; from megatron_sat.data import preprocess; "
            f"r = preprocess([{src!r}], {str(tokenizer.name)!r}, {str(tmp_path / 'out')!r}, progress=False); "
            "print(r.num_docs, sorted(m for m in ('torch', 'megatron.core', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "2 []"


def _tokenizer_copy(tokenizer, out_dir, config_edit=None, extra_file=None):
    os.makedirs(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(tokenizer.name, name)) as f:
            text = f.read()
        if name == "tokenizer_config.json" and config_edit:
            text = json.dumps(config_edit(json.loads(text)))
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)
    if extra_file:
        with open(os.path.join(out_dir, extra_file), "w") as f:
            f.write("{}")
    return str(out_dir)


def test_plain_load_equals_transformers_and_falls_back_when_it_could_differ(tokenizer, corpus, tmp_path):
    """preprocess loads tokenizers without transformers (plain_tokenizer) only where transformers' load gives the
    same backend, vocabulary, special ids and ids; any other folder is loaded by transformers."""
    texts = corpus[:30] + ADVERSARIAL + MORE_ADVERSARIAL
    for name in (str(tokenizer.name), os.path.join(tokenizer.name, "tokenizer.json")):
        plain, full = load_tokenizer(name, plain=True), load_tokenizer(name)
        assert type(plain.hf).__name__ == "TokenizersOnly" and type(full.hf).__name__ != "TokenizersOnly", name
        assert json.loads(plain.hf.backend_tokenizer.to_str()) == json.loads(full.hf.backend_tokenizer.to_str())
        assert (plain.vocab_size, plain.eod, plain.bos, plain.pad, plain.fingerprint) == \
               (full.vocab_size, full.eod, full.bos, full.pad, full.fingerprint), name
        assert [plain.encode(t) for t in texts] == [full.encode(t) for t in texts], name
        assert plain.decode(plain.encode(texts[0])) == full.decode(full.encode(texts[0]))
    unusual = {
        "config key that may change ids": dict(config_edit=lambda c: dict(c, add_prefix_space=True)),
        "eos token not in the vocabulary": dict(config_edit=lambda c: dict(c, eos_token="<new_eos>")),
        "another class": dict(config_edit=lambda c: dict(c, tokenizer_class="GPT2TokenizerFast")),
        "a special_tokens_map.json": dict(extra_file="special_tokens_map.json"),
    }
    for k, (why, edit) in enumerate(unusual.items()):
        folder = _tokenizer_copy(tokenizer, tmp_path / f"t{k}", **edit)
        assert type(load_tokenizer(folder, plain=True).hf).__name__ != "TokenizersOnly", why


def test_shard_dir_with_several_json_keys_is_refused(tmp_path):
    """--shard-dir writes one dataset per shard: several --json-keys (Megatron-LM's one dataset per key) are
    refused with one line and exit 2, before anything is read or written."""
    src = write_jsonl(tmp_path / "in.jsonl", ["one document"])
    cli = subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", src,
                          "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "no/such/tokenizer",
                          "--json-keys", "text", "title", "--shard-dir", str(tmp_path / "shards")],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2, cli.stderr
    last = cli.stderr.strip().splitlines()[-1]
    assert "--shard-dir takes one text key: run once per --json-keys key" in last, cli.stderr
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
