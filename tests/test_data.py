"""Tests of megatron_sat.data and tools/preprocess_data.py (CPU, single process, ~30 s)."""

import gzip
import json
import os
import runpy
import subprocess
import sys

import numpy
import pytest
import torch
import train_cli

pytest.importorskip("transformers", reason="needs the hf extra (transformers, tokenizers)")
pytest.importorskip("tokenizers", reason="needs the hf extra (transformers, tokenizers)")

from transformers import AutoTokenizer  # noqa: E402

from megatron_sat.data import (  # noqa: E402
    DistributedBatchSampler,
    NullTokenizer,
    build_data_loader,
    build_datasets,
    default_corpus_documents,
    load_tokenizer,
    parse_blend,
    preprocess,
    read_documents,
    train_bpe_tokenizer,
    write_default_corpus,
)
from megatron_sat.training.arguments import parse_args  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TEXTS = [
    "Hello world. This is the first document.",
    "Unicode: caf\u00e9, na\u00efve, \u4e2d\u6587, emoji \U0001f600 and  double  spaces ,punct .",
    "",  # empty documents are skipped
    "Tabs\tand\nnew lines\n\n  indented line\n",
    "def f(x):\n    return x ** 2  # code is text too\n",
]


def write_jsonl(path, texts, key="text"):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def tokenizer(workdir):
    """A 1,024-token byte-level BPE trained on part of the default corpus."""
    docs = default_corpus_documents(("topics",))[:30]
    src = write_jsonl(workdir / "bpe_train.jsonl", [t for _, t in docs])
    return train_bpe_tokenizer([src], 1024, str(workdir / "tokenizer"))


@pytest.fixture(scope="module")
def corpus_prefix(workdir, tokenizer):
    """The default corpus (topics only, to stay fast) as an indexed dataset."""
    info = write_default_corpus(str(workdir / "raw"), sources=("topics",))
    prefix = str(workdir / "topics_text_document")
    preprocess([info.path], tokenizer, prefix, workers=1, progress=False)
    return prefix


# -- tokenizer and corpus ------------------------------------------------------------------


def test_tokenizer_folder_loads_with_transformers(workdir, tokenizer):
    hf = AutoTokenizer.from_pretrained(str(workdir / "tokenizer"))
    assert len(hf) == tokenizer.vocab_size == 1024
    assert tokenizer.eod == hf.eos_token_id
    assert tokenizer.pad == -1
    text = "Round trip: \u00e9\u00e8 \u4e2d  x"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    # a bare tokenizers JSON file loads too, with the eod token found by name
    tok2 = load_tokenizer(str(workdir / "tokenizer" / "tokenizer.json"))
    assert tok2.eod == tokenizer.eod and tok2.encode(text) == tokenizer.encode(text)


def test_default_corpus_is_deterministic(tmp_path):
    a = write_default_corpus(str(tmp_path / "a"))
    assert a.num_docs > 300 and a.num_chars > 1_000_000
    b = write_default_corpus(str(tmp_path / "b"), sources=("topics",))
    c = write_default_corpus(str(tmp_path / "c"), sources=("topics",))
    assert b.sha256 == c.sha256 and b.num_docs == c.num_docs > 50
    with open(a.path) as f:
        first = json.loads(f.readline())
    assert set(first) == {"text"} and len(first["text"]) > 100


# -- preprocessing -------------------------------------------------------------------------


def test_preprocess_roundtrip(workdir, tokenizer):
    src = write_jsonl(workdir / "tiny.jsonl", TEXTS)
    prefix = str(workdir / "tiny")
    res = preprocess([src], tokenizer, prefix, workers=1, progress=False)
    kept = [t for t in TEXTS if t]
    assert (res.num_docs, res.num_skipped) == (len(kept), 1)
    docs = read_documents(prefix)
    assert len(docs) == len(kept)
    assert res.num_tokens == sum(len(d) for d in docs)
    for ids, text in zip(docs, kept):
        assert ids[-1] == tokenizer.eod  # eod appended per document
        assert tokenizer.decode(ids[:-1]) == text
    meta = json.load(open(prefix + ".meta.json"))
    assert meta["vocab_size"] == 1024 and meta["dtype"] == "uint16"

    # two worker processes write the same bytes
    res2 = preprocess([src], tokenizer, prefix + "_w2", workers=2, chunksize=1, progress=False)
    assert res2.num_tokens == res.num_tokens
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(prefix + "_w2" + ext, "rb").read()


def test_preprocess_txt_paragraphs(workdir, tokenizer):
    path = workdir / "doc.txt"
    path.write_text("First paragraph\nstill first.\n\n\nSecond one.\n")
    res = preprocess([str(path)], str(workdir / "tokenizer"), str(workdir / "txt"),
                     txt_mode="paragraph", progress=False)
    docs = read_documents(str(workdir / "txt"))
    assert res.num_docs == 2
    assert [tokenizer.decode(d[:-1]) for d in docs] == ["First paragraph\nstill first.",
                                                          "Second one."]


def _no_output(prefix):
    folder = os.path.dirname(prefix)
    return not any(f.startswith(os.path.basename(prefix)) for f in os.listdir(folder))


def test_preprocess_errors(workdir, tokenizer, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", ["some text"])
    out = str(tmp_path / "out")

    with pytest.raises(SystemExit, match="input file.*not found.*missing.jsonl"):
        preprocess([str(tmp_path / "missing.jsonl")], tokenizer, out, progress=False)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(SystemExit, match="empty input: no documents"):
        preprocess([str(empty)], tokenizer, out, progress=False)
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    with pytest.raises(SystemExit, match=r"empty input.*\(2 empty documents\)"):
        preprocess([blank], tokenizer, out, progress=False)

    with pytest.raises(SystemExit, match="tokenizer path does not exist"):
        preprocess([good], str(tmp_path / "no_such_tokenizer"), out, progress=False)
    not_tok = tmp_path / "not_a_tokenizer"
    not_tok.mkdir()
    (not_tok / "readme.txt").write_text("hi")
    with pytest.raises(SystemExit, match="is not a tokenizer folder"):
        preprocess([good], str(not_tok), out, progress=False)
    with pytest.raises(SystemExit, match="is not a tokenizer"):
        preprocess([good], good, out, progress=False)  # a file that is not tokenizer JSON

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(SystemExit, match="output folder .* is not writable"):
        preprocess([good], tokenizer, str(a_file / "sub" / "out"), progress=False)

    wrong_key = write_jsonl(tmp_path / "key.jsonl", ["x"], key="content")
    with pytest.raises(SystemExit, match=r"key.jsonl:1: no field 'text'.*content"):
        preprocess([wrong_key], tokenizer, out, progress=False)
    assert preprocess([wrong_key], tokenizer, out, json_key="content", progress=False).num_docs == 1
    os.remove(out + ".bin"), os.remove(out + ".idx"), os.remove(out + ".meta.json")
    assert _no_output(out)  # failed runs left no half-written files


def test_cli(workdir, tmp_path):
    tool = os.path.join(REPO, "tools", "preprocess_data.py")
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    ok = subprocess.run(
        [sys.executable, tool, "--input", src, "--tokenizer", str(workdir / "tokenizer"),
         "--output-prefix", str(tmp_path / "cli"), "--workers", "1", "--quiet"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert ok.returncode == 0, ok.stderr
    assert "4 documents" in ok.stdout and str(tmp_path / "cli") in ok.stdout
    bad = subprocess.run(
        [sys.executable, tool, "--input", str(tmp_path / "nope.jsonl"), "--tokenizer",
         str(workdir / "tokenizer"), "--output-prefix", str(tmp_path / "x")],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert bad.returncode != 0 and "input file(s) not found" in bad.stderr


# -- datasets and sampling -----------------------------------------------------------------


def test_build_datasets(workdir, tokenizer, corpus_prefix):
    cache = str(workdir / "run" / "data_cache")
    ds = build_datasets(corpus_prefix, tokenizer, seq_length=64, num_samples=(500, 20, 0),
                        split="90,10,0", seed=7, cache_dir=cache)
    assert len(ds.train) >= 500 and len(ds.valid) >= 20 and ds.test is None
    assert any(f.endswith("shuffle_index.npy") for f in os.listdir(cache))
    s = ds.train[3]
    assert s["tokens"].shape == (64,) and torch.equal(s["tokens"][1:], s["labels"][:-1])
    assert "attention_mask" not in s or s["attention_mask"] is None
    # rebuilt from the cache: identical samples
    ds2 = build_datasets(corpus_prefix, tokenizer, seq_length=64, num_samples=(500, 20, 0),
                         split="90,10,0", seed=7, cache_dir=cache)
    assert torch.equal(ds2.train[3]["tokens"], s["tokens"])

    with pytest.raises(FileNotFoundError, match="no indexed dataset"):
        build_datasets(corpus_prefix + "_nope", tokenizer, 64, (10, 0, 0), cache_dir=cache)
    tiny = str(workdir / "tiny")  # 4 documents: a 2% valid split is empty
    with pytest.raises(ValueError, match="valid split .* has no documents"):
        build_datasets(tiny, tokenizer, 16, (10, 10, 0), split="98,2,0", cache_dir=cache)
    per_split = build_datasets({"train": corpus_prefix, "valid": tiny}, tokenizer, 16,
                               (50, 5, 0), cache_dir=cache)
    assert len(per_split.train) >= 50 and len(per_split.valid) >= 5 and per_split.test is None
    assert parse_blend("0.3 a 0.7 b") == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["a", "b"]) == (["a", "b"], None)


def test_loader_batches(workdir, tokenizer, corpus_prefix):
    ds = build_datasets(corpus_prefix, tokenizer, seq_length=32, num_samples=(64, 8, 0),
                        split="90,10,0", cache_dir=str(workdir / "run" / "data_cache"),
                        create_attention_mask=True)
    batch = next(iter(build_data_loader(ds.train, micro_batch_size=4)))
    assert batch["tokens"].shape == batch["labels"].shape == (4, 32)
    assert batch["tokens"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
    assert batch["position_ids"].shape == (4, 32)
    assert batch["attention_mask"].shape == (4, 1, 32, 32)  # True above the diagonal = masked
    assert batch["attention_mask"][0, 0, 0, 1] and not batch["attention_mask"][0, 0, 1, 0]


def test_sampler_sharding_and_resume():
    total, mbs = 103, 3
    full = [b for b in DistributedBatchSampler(total, mbs, 0, 1)]
    r0 = list(DistributedBatchSampler(total, mbs, dp_rank=0, dp_size=2))
    r1 = list(DistributedBatchSampler(total, mbs, dp_rank=1, dp_size=2))
    flat0, flat1 = sum(r0, []), sum(r1, [])
    assert not set(flat0) & set(flat1)  # disjoint
    # rank 0 then rank 1 in each step reproduce the single-rank order (17 full steps of 6)
    assert sum((a + b for a, b in zip(r0, r1)), []) == list(range(102))
    assert sum(full, []) == list(range(102))
    # resume after 5 steps (30 samples): continues exactly
    for rank, run in ((0, r0), (1, r1)):
        resumed = list(DistributedBatchSampler(total, mbs, rank, 2, consumed_samples=30))
        assert resumed == run[5:]
    with pytest.raises(ValueError, match="multiple of"):
        DistributedBatchSampler(total, mbs, 0, 2, consumed_samples=4)
    cyc = iter(DistributedBatchSampler(10, 4, 1, 2, consumed_samples=8, cyclic=True))
    assert next(cyc) == [2, 3, 4, 5] and next(cyc) == [0, 1, 2, 3]


def test_sampler_end_of_data_at_the_boundary():
    """The samples left are exactly one step (or a whole number of steps): that last step is yielded, and len()
    agrees with the iteration for every rank, start and dataset size around the boundary."""
    mbs, dp = 3, 2
    step = mbs * dp
    for total in (step, 2 * step, 5 * step, 5 * step + 1, 6 * step - 1):
        for consumed in range(0, total + 1, step):
            for rank in range(dp):
                sampler = DistributedBatchSampler(total, mbs, rank, dp, consumed_samples=consumed)
                got = list(sampler)
                assert len(got) == len(sampler) == (total - consumed) // step, (total, consumed, rank, got)
                if got:  # the last full step is this rank's share of [.., last_full_step_end)
                    end = total - total % step
                    assert got[-1] == list(range(end - step + rank * mbs, end - step + (rank + 1) * mbs))
    # one step left exactly: yielded once, then the sampler is done
    sampler = DistributedBatchSampler(12, 3, 1, 2, consumed_samples=6)
    assert len(sampler) == 1 and list(sampler) == [[9, 10, 11]]
    assert list(DistributedBatchSampler(12, 3, 0, 2, consumed_samples=12)) == []


def test_loader_resume_matches_uninterrupted(workdir, tokenizer, corpus_prefix):
    ds = build_datasets(corpus_prefix, tokenizer, seq_length=32, num_samples=(96, 0, 0),
                        split="90,10,0", cache_dir=str(workdir / "run" / "data_cache"))
    per_rank = {}
    for rank in (0, 1):
        it = iter(build_data_loader(ds.train, 4, dp_rank=rank, dp_size=2))
        per_rank[rank] = [next(it)["tokens"] for _ in range(6)]
        resumed = iter(build_data_loader(ds.train, 4, rank, 2, consumed_samples=3 * 8))
        for k in range(3, 6):
            assert torch.equal(next(resumed)["tokens"], per_rank[rank][k])
    # a DP=2 step holds the same 8 samples as a DP=1 step of micro-batch 8
    single = next(iter(build_data_loader(ds.train, 8)))["tokens"]
    assert torch.equal(torch.cat([per_rank[0][0], per_rank[1][0]]), single)


def test_mock_mode():
    ds = build_datasets(None, NullTokenizer(512), seq_length=128, num_samples=(40, 8, 8),
                        mock=True)
    assert len(ds.train) >= 40 and len(ds.valid) >= 8
    batch = next(iter(build_data_loader(ds.train, 2, dp_rank=1, dp_size=2)))
    assert batch["tokens"].shape == (2, 128) and int(batch["tokens"].max()) < 512
    assert batch["attention_mask"] is None
    assert numpy.array_equal(batch["tokens"][:, 1:].numpy(), batch["labels"][:, :-1].numpy())


# -- input formats, workers, bad input (issue 15) ------------------------------------------


def _docs():
    """Documents with unicode, code, blank ones; enough for several chunks and parquet row groups."""
    base = [t for _, t in default_corpus_documents(("topics",))[:25]]
    return [t for pair in zip(base, TEXTS * 5) for t in pair]


def _same(prefix_a, prefix_b):
    for ext in (".bin", ".idx"):
        with open(prefix_a + ext, "rb") as fa, open(prefix_b + ext, "rb") as fb:
            if fa.read() != fb.read():
                return False
    return True


def _write_parquet(path, texts, column="text", row_group_size=7):
    # pyarrow and zstandard: optional (hf extra); the tests that need them importorskip them
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: texts, "id": list(range(len(texts)))}), str(path),
                   row_group_size=row_group_size)
    return str(path)


def _write_compressed(path, texts, key="text"):
    data = "".join(json.dumps({key: t}) + "\n" for t in texts).encode()
    if str(path).endswith(".gz"):
        data = gzip.compress(data)
    else:
        import zstandard  # optional, see _write_parquet

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return str(path)


@pytest.fixture(scope="module")
def reference(workdir, tokenizer):
    """The documents as plain jsonl, preprocessed by one process: what every format must reproduce."""
    docs = _docs()
    prefix = str(workdir / "ref_fmt")
    preprocess([write_jsonl(workdir / "ref_fmt.jsonl", docs)], tokenizer, prefix, workers=1, progress=False)
    return docs, prefix


def test_every_format_gives_the_jsonl_bytes(tmp_path, tokenizer, reference):
    pytest.importorskip("pyarrow")
    pytest.importorskip("zstandard")
    datasets = pytest.importorskip("datasets")
    docs, ref = reference
    half = len(docs) // 2
    out = str(tmp_path / "out")
    gz = _write_compressed(tmp_path / "docs.jsonl.gz", docs)
    zst = _write_compressed(tmp_path / "docs.jsonl.zst", docs)
    (tmp_path / "pq").mkdir()
    _write_parquet(tmp_path / "pq" / "part-0.parquet", docs[:half], column="content")
    _write_parquet(tmp_path / "pq" / "part-1.parquet", docs[half:], column="content")
    saved = str(tmp_path / "saved")
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(saved)
    saved_dict = str(tmp_path / "saved_dict")  # a DatasetDict: --hf-split picks the split
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:3]}),
                          "validation": datasets.Dataset.from_dict({"text": docs})}).save_to_disk(saved_dict)
    mixed = tmp_path / "mixed" / "sub"  # a folder mixing formats, searched recursively, sorted
    mixed.mkdir(parents=True)
    _write_compressed(mixed / "a.jsonl.zst", docs[:half])
    _write_parquet(mixed / "b.parquet", docs[half:])
    cases = [
        ([gz], {}, 1), ([zst], {"chunksize": 3}, 2),
        ([str(tmp_path / "pq" / "*.parquet")], {"json_key": "content", "chunksize": 5}, 3),
        ([saved], {"chunksize": 4}, 2), ([str(tmp_path / "mixed")], {}, 2),
        ([saved_dict], {"hf_split": "validation"}, 1),
    ]
    for inputs, kw, workers in cases:
        res = preprocess(inputs, tokenizer, out, workers=workers, progress=False, **kw)
        assert _same(out, ref), (inputs, kw, workers)
        assert res.num_docs == len([d for d in docs if d]) and res.num_skipped == len(docs) - res.num_docs
    assert json.load(open(out + ".meta.json"))["inputs"] == [saved_dict]
    with pytest.raises(SystemExit, match=r"saved_dict: no split 'test' \(splits: train, validation\): pass --hf-split"):
        preprocess([saved_dict], tokenizer, out + "_x", hf_split="test", progress=False)
    preprocess([str(tmp_path / "mixed")], tokenizer, out, progress=False)
    assert json.load(open(out + ".meta.json"))["inputs"] == [str(mixed / "a.jsonl.zst"), str(mixed / "b.parquet")]


def test_hub_cache_dataset_through_the_cli(tmp_path, workdir, reference):
    """A hub dataset name resolves to its snapshot in the local hub cache, offline; 2 workers, same bytes."""
    pytest.importorskip("pyarrow")
    docs, ref = reference
    hub, sha = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = hub / "datasets--someone--tiny-corpus"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    (repo / "snapshots" / sha / "data").mkdir(parents=True)
    _write_parquet(repo / "snapshots" / sha / "data" / "train-00000-of-00001.parquet", docs, row_group_size=11)
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", PYTHONPATH=REPO)
    tool = os.path.join(REPO, "tools", "preprocess_data.py")
    base = [sys.executable, tool, "--tokenizer", str(workdir / "tokenizer"), "--workers", "2"]
    ok = subprocess.run(base + ["--input", "someone/tiny-corpus", "--output-prefix", str(tmp_path / "hub_out")],
                        capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    assert _same(str(tmp_path / "hub_out"), ref)
    assert "docs/s" in ok.stdout and "MB/s" in ok.stdout  # the summary line


def test_uncached_hub_dataset_offline_is_refused(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit, match=r"someone/not-cached-anywhere is neither a local path nor .*offline"):
        preprocess(["someone/not-cached-anywhere"], tokenizer, str(tmp_path / "x"), progress=False)


def test_bad_inputs_name_the_file_and_exit_2(tmp_path, tokenizer):
    pytest.importorskip("pyarrow")
    pytest.importorskip("zstandard")
    out = str(tmp_path / "out")
    good = write_jsonl(tmp_path / "good.jsonl", ["one", "two"])
    corrupt_pq = tmp_path / "corrupt.parquet"
    corrupt_pq.write_bytes(b"PAR1 this is not parquet")
    gz = _write_compressed(tmp_path / "cut.jsonl.gz", ["x" * 5000] * 20)
    with open(gz, "r+b") as f:
        f.truncate(os.path.getsize(gz) // 2)
    zst = tmp_path / "bad.jsonl.zst"
    zst.write_bytes(b"\x28\xb5\x2f\xfd garbage garbage")
    utf8 = tmp_path / "utf8.jsonl"
    utf8.write_bytes(b'{"text": "fine"}\n\n{"text": "bad \xff byte"}\n{"text": "ok"}\n')
    pq_bin = tmp_path / "bin.parquet"
    import pyarrow as pa  # optional, see _write_parquet
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([b"ok", b"bad \xfe", b"ok too"], pa.binary())}), str(pq_bin))
    empty_pq = _write_parquet(tmp_path / "empty.parquet", [])
    empty_gz = _write_compressed(tmp_path / "empty.jsonl.gz", [])
    cases = [
        ([str(corrupt_pq)], r"corrupt.parquet: not a readable parquet file"),
        ([gz], r"cut.jsonl.gz: corrupt or truncated gzip data after line \d+"),
        ([str(zst)], r"bad.jsonl.zst: corrupt or truncated zstd data after line 0"),
        ([_write_parquet(tmp_path / "col.parquet", ["a"], column="body")],
         r"col.parquet: no column 'text' \(columns: body, id\)"),
        ([good, str(utf8)], r"utf8.jsonl:3: not valid UTF-8"),
        ([str(pq_bin)], r"bin.parquet: row 1: not valid UTF-8"),
        ([good, empty_pq], r"empty input: no documents in .*empty.parquet \(an empty shard\)"),
        ([empty_gz], r"empty input: no documents in .*empty.jsonl.gz"),
    ]
    for inputs, pattern in cases:
        with pytest.raises(SystemExit, match=pattern):
            preprocess(inputs, tokenizer, out, workers=1, chunksize=2, progress=False)
        assert _no_output(out), inputs  # nothing half-written, no temporary left
    # --skip-bad: bad documents and empty shards are counted and skipped; the rest is written
    res = preprocess([good, str(utf8), str(pq_bin), empty_pq], tokenizer, out, workers=2, chunksize=2, skip_bad=True,
                     progress=False)
    assert (res.num_docs, res.num_bad, res.bad_shards) == (6, 2, [empty_pq])
    assert "2 bad documents and 1 empty shards skipped" in res.summary()
    assert json.load(open(out + ".meta.json"))["first_bad"].endswith("utf8.jsonl:3: not valid UTF-8")
    # the command exits 2 with the message, and an earlier dataset under the prefix is left as it was
    before = open(out + ".bin", "rb").read()
    cli = subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", str(utf8),
                          "--tokenizer", tokenizer.name, "--output-prefix", out, "--workers", "1"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    assert cli.returncode == 2 and "utf8.jsonl:3: not valid UTF-8" in cli.stderr and "--skip-bad" in cli.stderr
    assert open(out + ".bin", "rb").read() == before


@pytest.mark.slow  # a trainer run
def test_split_paths_in_a_short_training_run(workdir, corpus_prefix, tmp_path, capsys):
    """--train-data-path / --valid-data-path (Megatron-LM's names) instead of --data-path + --split: the run trains
    on one dataset, validates on the other, and config.json records both."""
    tiny_model = ["--arch", "satformer", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
                  "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
                  "--eval-interval", "3", "--eval-iters", "1", "--log-interval", "1", "--no-progress-bar",
                  "--tokenizer-model", str(workdir / "tokenizer")]
    valid = str(workdir / "tiny")  # 4 documents, from test_preprocess_roundtrip
    if not os.path.isfile(valid + ".idx"):
        preprocess([write_jsonl(workdir / "tiny.jsonl", TEXTS)], str(workdir / "tokenizer"), valid, progress=False)
    save = tmp_path / "run"
    train_cli.train(*tiny_model, "--train-data-path", "0.7", corpus_prefix, "0.3", corpus_prefix,
                    "--valid-data-path", valid, "--save", save)
    config = json.load(open(save / "config.json"))
    assert config["train_data_path"] == ["0.7", corpus_prefix, "0.3", corpus_prefix]
    assert config["valid_data_path"] == [valid] and config["data_path"] is None
    assert config["data"] == {"train": f"0.7 {corpus_prefix} 0.3 {corpus_prefix}", "valid": valid, "test": None}
    rows = train_cli.rows(save)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3] and any("val_loss" in r for r in rows)
    # a validation path without a training path, or both kinds of data path: refused by the argument checks (the
    # trainer prints them and exits 2 before anything is written)
    for extra, message in ((["--valid-data-path", valid], "--valid-data-path / --test-data-path need --train-data-path"),
                           (["--data-path", valid, "--train-data-path", valid], "give exactly one data source"),
                           (["--train-data-path", valid + "_nope"], "--train-data-path: no indexed dataset")):
        with pytest.raises(SystemExit) as e:
            parse_args([*tiny_model, *extra, "--save", str(tmp_path / "bad")])
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow  # the preprocessing benchmark tool
def test_benchmark_tool_without_megatron_lm(workdir, tokenizer, tmp_path, capsys):
    """tools/benchmark_preprocess.py runs this project's side and says the comparison was skipped."""
    bench = runpy.run_path(os.path.join(REPO, "tools", "benchmark_preprocess.py"), run_name="benchmark_preprocess")
    assert bench["main"](["--size-mb", "0.2", "--workers", "2", "--repeats", "1", "--tokenizer",
                          str(workdir / "tokenizer"), "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Megatron-LM comparison skipped: pass --megatron-lm PATH" in out
    row = next(line for line in out.splitlines() if line.startswith("megatron-sat"))
    assert float(row.split()[3].replace(",", "")) > 0  # docs/s
    assert os.path.getsize(tmp_path / "ours.bin") > 0


def test_merge_refuses_a_dataset_without_its_meta(workdir, corpus_prefix, tmp_path):
    """A dataset without .meta.json (its tokenizer unknown): one line, exit 2; --allow-missing-meta merges it and
    the merged .meta.json claims no tokenizer (it claimed the first dataset's for all of it)."""
    bare = str(tmp_path / "bare")
    for ext in (".bin", ".idx"):
        with open(corpus_prefix + ext, "rb") as src, open(bare + ext, "wb") as dst:
            dst.write(src.read())
    tool = [sys.executable, os.path.join(REPO, "tools", "merge_datasets.py"), "--input", corpus_prefix, bare,
            "--output-prefix", str(tmp_path / "merged")]
    bad = subprocess.run(tool, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert f"{bare}.meta.json is missing" in bad.stderr and "--allow-missing-meta" in bad.stderr
    assert not os.path.exists(tmp_path / "merged.bin")
    ok = subprocess.run(tool + ["--allow-missing-meta"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    with open(tmp_path / "merged.meta.json") as f:
        meta = json.load(f)
    with open(corpus_prefix + ".meta.json") as f:
        first = json.load(f)
    assert first["tokenizer"] and meta["tokenizer"] is None and meta["tokenizer_fingerprint"] is None
    assert meta["without_meta"] == [bare] and meta["num_docs"] == 2 * first["num_docs"]
