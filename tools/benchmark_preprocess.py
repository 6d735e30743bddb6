#!/usr/bin/env python
"""Preprocessing throughput, side by side: this project's tools/preprocess_data.py against Megatron-LM's, same input,
same tokenizer, same worker count; checks that the two write identical .bin/.idx bytes.

Exact command (from the repository root)::

    python tools/benchmark_preprocess.py --megatron-lm /path/to/Megatron-LM --size-mb 40 --workers 2

* The input is generated: about --size-mb of jsonl made of the embedded default corpus (the Python Language
  Reference), pieces of 200-8,000 characters cut at random places with a fixed seed.
* The tokenizer is --tokenizer, or a byte-level BPE (vocabulary 32,000, like Llama-2's) trained once on the
  default corpus into the work folder.
* Megatron-LM's tool runs as `python MEGATRON_LM/tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer
  --append-eod --workers N`, with Megatron-LM's `megatron` package (or the installed megatron-core where the
  checkout has only tools/). On Python 3.11 a sitecustomize in the work folder gives `typing.override` (3.12) to
  the Megatron-LM code that imports it; nothing else is changed.
* Both are timed as whole commands (start-up included), on the same machine, alternately --repeats times: wall
  time (fastest and median) and the CPU seconds of all their processes (median; the least disturbed by other
  load on a shared machine: throughput per core).
Without --megatron-lm only this project's throughput is printed (with a message saying the comparison was skipped).
Exit status 1 when the outputs differ.
"""

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

try:
    import megatron_sat  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat.data.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SHIM = """import typing
if not hasattr(typing, "override"):  # Python 3.11: Megatron-LM's training code imports typing.override (3.12)
    import typing_extensions
    typing.override = typing_extensions.override
"""


def make_input(path: str, size_mb: float, seed: int = 0) -> int:
    """Write about size_mb MB of jsonl; returns the number of documents."""
    from megatron_sat.data.corpus import default_corpus_documents

    texts = [t for _, t in default_corpus_documents(("topics",))]  # the Language Reference, ~0.5 MB
    rng = random.Random(seed)
    target, written, n = int(size_mb * 1e6), 0, 0
    with open(path, "w") as f:
        while written < target:
            t = rng.choice(texts)
            start = rng.randrange(len(t))
            piece = t[start:start + rng.randint(200, 8000)]
            line = json.dumps({"text": piece}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode())
            n += 1
    return n


def make_tokenizer(folder: str, vocab_size: int) -> str:
    from megatron_sat.data.corpus import write_default_corpus
    from megatron_sat.data.tokenizer import train_bpe_tokenizer

    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        info = write_default_corpus(os.path.join(folder, "raw"))
        train_bpe_tokenizer([info.path], vocab_size, folder)
    return folder


def timed(cmd, env=None) -> tuple:
    """(wall seconds, CPU seconds of the command and all its processes: user + system, worker pools included)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark_preprocess: error: {' '.join(cmd[:2])} failed ({proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def same_bytes(a: str, b: str) -> bool:
    for ext in (".bin", ".idx"):
        with open(a + ext, "rb") as fa, open(b + ext, "rb") as fb:
            while True:
                x, y = fa.read(1 << 24), fb.read(1 << 24)
                if x != y:
                    return False
                if not x:
                    break
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--megatron-lm", default=None, help="a Megatron-LM checkout (needs tools/preprocess_data.py)")
    p.add_argument("--size-mb", type=float, default=40.0, help="generated jsonl size")
    p.add_argument("--workers", type=int, default=2, help="worker processes, for both tools")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: a BPE trained here)")
    p.add_argument("--vocab-size", type=int, default=32000, help="vocabulary of the BPE trained here")
    p.add_argument("--work-dir", default=None, help="where input and outputs go (default: a temporary folder)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each tool (alternated); the fastest counts")
    args = p.parse_args(argv)
    tool = None
    if args.megatron_lm:
        tool = os.path.join(args.megatron_lm, "tools", "preprocess_data.py")
        if not os.path.isfile(tool):
            p.error(f"--megatron-lm {args.megatron_lm} has no tools/preprocess_data.py")
    work = args.work_dir or tempfile.mkdtemp(prefix="bench_preprocess_")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "input.jsonl")
    num_docs = make_input(data, args.size_mb)
    tok = args.tokenizer or make_tokenizer(os.path.join(work, f"bpe{args.vocab_size}"), args.vocab_size)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    print(f"input {data}: {num_docs:,} documents, {os.path.getsize(data) / 1e6:.1f} MB; tokenizer {tok} "
          f"(vocabulary {load_tokenizer(tok).vocab_size}); "
          f"{args.workers} workers", flush=True)

    ours = os.path.join(work, "ours")
    ours_cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", data,
                "--tokenizer", tok, "--output-prefix", ours, "--workers", str(args.workers), "--quiet"]
    if tool:
        shim = os.path.join(work, "py311_shim")
        os.makedirs(shim, exist_ok=True)
        with open(os.path.join(shim, "sitecustomize.py"), "w") as f:
            f.write(_SHIM)
        mlm_env = dict(env, PYTHONPATH=f"{shim}:{os.path.abspath(args.megatron_lm)}")
        mlm_cmd = [sys.executable, tool, "--input", data, "--output-prefix", os.path.join(work, "mlm"),
                   "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok, "--workers",
                   str(args.workers), "--append-eod", "--json-keys", "text", "--log-interval", "1000000"]
    t_ours, t_mlm = [], []
    for _ in range(max(1, args.repeats)):
        t_ours.append(timed(ours_cmd, env))
        if tool:
            t_mlm.append(timed(mlm_cmd, mlm_env))
    with open(ours + ".meta.json") as f:
        meta = json.load(f)
    docs, tokens = meta["num_docs"], meta["num_tokens"]
    print(f"runs (wall s): megatron-sat {', '.join(f'{w:.1f}' for w, _ in t_ours)}"
          + (f"; Megatron-LM {', '.join(f'{w:.1f}' for w, _ in t_mlm)}" if tool else ""))
    print(f"{'tool':<14}{'wall s min':>11}{'median':>8}{'docs/s':>10}{'tokens/s':>12}{'CPU s':>8}{'tokens/CPU s':>14}")
    rows = {"megatron-sat": t_ours, **({"Megatron-LM": t_mlm} if tool else {})}
    best = {}
    for name, runs in rows.items():
        wall, cpu = min(w for w, _ in runs), statistics.median(c for _, c in runs)
        best[name] = (wall, statistics.median(w for w, _ in runs), cpu)
        print(f"{name:<14}{wall:>11.2f}{best[name][1]:>8.2f}{docs / wall:>10,.0f}{tokens / wall:>12,.0f}{cpu:>8.1f}"
              f"{tokens / cpu:>14,.0f}")
    if not tool:
        print("Megatron-LM comparison skipped: pass --megatron-lm PATH (a Megatron-LM checkout)")
        return 0
    (w0, m0, c0), (w1, m1, c1) = best["megatron-sat"], best["Megatron-LM"]
    identical = same_bytes(ours, os.path.join(work, "mlm_text_document"))
    print(f"speed-up {w1 / w0:.2f}x (fastest wall times), {m1 / m0:.2f}x (median wall times), {c1 / c0:.2f}x (median "
          f"CPU seconds); {args.workers} workers each, {docs:,} documents, {tokens:,} tokens; "
          f".bin/.idx {'identical' if identical else 'DIFFER'}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
