#!/usr/bin/env python
"""Preprocessing throughput, side by side: this project's tools/preprocess_data.py against Megatron-LM's
tools/preprocess_data.py and datatrove's MegatronDocumentTokenizer pipeline; same input, same tokenizer, same
number of worker processes; checks that all of them write identical .bin/.idx bytes.

Exact command (from the repository root)::

    python tools/benchmark_preprocess.py --megatron-lm /path/to/Megatron-LM --size-mb 200 --workers 2 --repeats 3

* The input is generated: about --size-mb of jsonl made of the embedded default corpus (the Python Language
  Reference and standard-library docstrings), pieces of 200-8,000 characters cut at random places with a fixed
  seed; and the same documents as a parquet shard (--parquet, default on; row groups of 8,192 rows).
* The tokenizer is --tokenizer, or a byte-level BPE (asked for 32,000 tokens, like Llama-2's) trained once on the
  default corpus into the work folder.
* Megatron-LM's tool runs as `python MEGATRON_LM/tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer
  --append-eod --workers N`, with Megatron-LM's `megatron` package (or the installed megatron-core where the
  checkout has only tools/). On Python 3.11 a sitecustomize in the work folder gives `typing.override` (3.12) to
  the Megatron-LM code that imports it; nothing else is changed. It reads jsonl only (no parquet row).
* datatrove (when installed; pip install datatrove) runs its documented pipeline: JsonlReader (or ParquetReader)
  -> MegatronDocumentTokenizer(tokenizer.json, eos_token) on a LocalPipelineExecutor with N tasks and N workers
  (start method fork). datatrove gives each task whole files, so it reads the same documents split into N files
  (made once, not timed) and writes one dataset per task; these are joined (megatron-core's add_index, not
  timed) and compared with the others.
* Every command runs with TOKENIZERS_PARALLELISM=false and OMP_NUM_THREADS=1: N worker processes use N cores.
* The tools are timed as whole commands (start-up included), alternately, --repeats times each: wall time
  (fastest and median) and the CPU seconds of all their processes (median; the least disturbed by other load on
  a shared machine). MB/s is input MB per median wall second; MB per CPU s is the throughput of one fully used
  core. The machine's load average (uptime) is printed before every run.
Without --megatron-lm the Megatron-LM rows are skipped (with a message saying so). Exit status 1 when any output
differs.
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

from megatron_sat.data.corpus import default_corpus_documents, write_default_corpus
from megatron_sat.data.shards import merge_datasets
from megatron_sat.data.tokenizer import load_tokenizer, train_bpe_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SHIM = """import typing
if not hasattr(typing, "override"):  # Python 3.11: Megatron-LM's training code imports typing.override (3.12)
    import typing_extensions
    typing.override = typing_extensions.override
"""
_DATATROVE = """import sys
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader, ParquetReader
from datatrove.pipeline.tokens.megatron_tokenizer import MegatronDocumentTokenizer

if __name__ == "__main__":
    kind, data_dir, out_dir, tokenizer_json, eos, n, logs = sys.argv[1:]
    reader = (JsonlReader if kind == "jsonl" else ParquetReader)(data_dir, text_key="text")
    LocalPipelineExecutor(pipeline=[reader, MegatronDocumentTokenizer(output_folder=out_dir,
                                    tokenizer_name_or_path=tokenizer_json, eos_token=eos)],
                          tasks=int(n), workers=int(n), logging_dir=logs, start_method="fork").run()
"""


def make_input(path: str, size_mb: float, seed: int = 0) -> int:
    """Write about size_mb MB of jsonl; returns the number of documents."""
    texts = [t for _, t in default_corpus_documents()]
    rng = random.Random(seed)
    target, written, n = int(size_mb * 1e6), 0, 0
    with open(path, "w") as f:
        while written < target:
            t = rng.choice(texts)
            start = rng.randrange(len(t))
            piece = t[start:start + rng.randint(200, 8000)]
            if not piece:
                continue
            line = json.dumps({"text": piece}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode())
            n += 1
    return n


def split_input(data: str, folder: str, parts: int, parquet: bool) -> None:
    """The jsonl as `parts` jsonl (and parquet) files of consecutive documents, in order (datatrove's input)."""
    with open(data, "rb") as f:
        lines = f.readlines()
    os.makedirs(os.path.join(folder, "jsonl"), exist_ok=True)
    step = -(-len(lines) // parts)
    for k in range(parts):
        part = lines[k * step:(k + 1) * step]
        with open(os.path.join(folder, "jsonl", f"part{k:03d}.jsonl"), "wb") as f:
            f.writelines(part)
        if parquet:
            import pyarrow as pa  # the hf extra: only for the parquet rows
            import pyarrow.parquet as pq

            os.makedirs(os.path.join(folder, "parquet"), exist_ok=True)
            pq.write_table(pa.table({"text": [json.loads(x)["text"] for x in part]}),
                           os.path.join(folder, "parquet", f"part{k:03d}.parquet"), row_group_size=8192)


def make_tokenizer(folder: str, vocab_size: int) -> str:
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        info = write_default_corpus(os.path.join(folder, "raw"))
        train_bpe_tokenizer([info.path], vocab_size, folder)
    return folder


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def timed(cmd, env=None) -> tuple:
    """(wall seconds, CPU seconds of the command and all its processes: user + system, worker pools included)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark_preprocess: error: {' '.join(cmd[:3])} failed ({proc.returncode}):\n"
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


def join_datatrove(out_dir: str, parts: int, prefix: str) -> str:
    # datatrove writes no .meta.json; its parts are of one tokenizer (this benchmark's)
    merge_datasets([os.path.join(out_dir, f"{k:05d}_tokens") for k in range(parts)], prefix, allow_missing_meta=True)
    return prefix


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--megatron-lm", default=None, help="a Megatron-LM checkout (needs tools/preprocess_data.py)")
    p.add_argument("--size-mb", type=float, default=200.0, help="generated jsonl size")
    p.add_argument("--workers", type=int, default=2, help="worker processes, for every tool")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: a BPE trained here)")
    p.add_argument("--vocab-size", type=int, default=32000, help="vocabulary of the BPE trained here")
    p.add_argument("--work-dir", default=None, help="where input and outputs go (default: a temporary folder)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each tool (alternated)")
    p.add_argument("--no-datatrove", action="store_true", help="skip datatrove even when it is installed")
    p.add_argument("--no-parquet", action="store_true", help="skip the parquet shard rows")
    p.add_argument("--one-worker", action="store_true", help="also run ours with 1 worker (scaling 1 -> N)")
    args = p.parse_args(argv)
    tool = None
    if args.megatron_lm:
        tool = os.path.join(args.megatron_lm, "tools", "preprocess_data.py")
        if not os.path.isfile(tool):
            p.error(f"--megatron-lm {args.megatron_lm} has no tools/preprocess_data.py")
    datatrove = not args.no_datatrove
    if datatrove:
        try:
            import datatrove as _  # noqa: F401
        except ImportError:
            print("datatrove comparison skipped: pip install datatrove", flush=True)
            datatrove = False
    parquet = not args.no_parquet
    work = args.work_dir or tempfile.mkdtemp(prefix="bench_preprocess_")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, f"input_{args.size_mb:g}mb.jsonl")
    if not os.path.isfile(data):
        make_input(data + ".tmp", args.size_mb)
        os.replace(data + ".tmp", data)
    mb = os.path.getsize(data) / 1e6
    split = os.path.join(work, f"split_{args.size_mb:g}mb_{args.workers}")
    if (datatrove or parquet) and not os.path.isdir(split):
        split_input(data, split + ".tmp", args.workers, parquet)
        os.replace(split + ".tmp", split)
    tok = args.tokenizer or make_tokenizer(os.path.join(work, f"bpe{args.vocab_size}"), args.vocab_size)
    tok_obj = load_tokenizer(tok)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
    print(f"input {data}: {mb:.1f} MB; tokenizer {tok} (vocabulary {tok_obj.vocab_size}); {args.workers} workers; "
          f"{os.cpu_count()} CPUs; load average {load()}", flush=True)

    out = work
    ours = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--tokenizer", tok, "--quiet"]
    runs = {"megatron-sat jsonl": (ours + ["--input", data, "--output-prefix", os.path.join(out, "ours"),
                                           "--workers", str(args.workers)], env, os.path.join(out, "ours"))}
    if args.one_worker:
        runs["megatron-sat jsonl 1w"] = (ours + ["--input", data, "--output-prefix", os.path.join(out, "ours1"),
                                                 "--workers", "1"], env, os.path.join(out, "ours1"))
    if tool:
        shim = os.path.join(work, "py311_shim")
        os.makedirs(shim, exist_ok=True)
        with open(os.path.join(shim, "sitecustomize.py"), "w") as f:
            f.write(_SHIM)
        mlm_env = dict(env, PYTHONPATH=f"{shim}:{os.path.abspath(args.megatron_lm)}")
        runs["Megatron-LM jsonl"] = (
            [sys.executable, tool, "--input", data, "--output-prefix", os.path.join(out, "mlm"),
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok, "--workers", str(args.workers),
             "--append-eod", "--json-keys", "text", "--log-interval", "1000000"], mlm_env,
            os.path.join(out, "mlm_text_document"))
    dt_script = os.path.join(work, "run_datatrove.py")
    with open(dt_script, "w") as f:
        f.write(_DATATROVE)
    eos = tok_obj.hf.convert_ids_to_tokens(tok_obj.eod)
    tok_json = os.path.join(tok, "tokenizer.json") if os.path.isdir(tok) else tok
    kinds = ["jsonl"] + (["parquet"] if parquet else [])
    for kind in kinds:
        if kind == "parquet":
            runs["megatron-sat parquet"] = (ours + ["--input", os.path.join(split, "parquet"), "--output-prefix",
                                                    os.path.join(out, "ours_pq"), "--workers", str(args.workers)],
                                            env, os.path.join(out, "ours_pq"))
        if datatrove:
            runs[f"datatrove {kind}"] = ([sys.executable, dt_script, kind, os.path.join(split, kind),
                                          os.path.join(out, f"dt_{kind}"), tok_json, eos, str(args.workers),
                                          os.path.join(out, f"dt_{kind}_logs")], env, None)
    times = {name: [] for name in runs}
    for r in range(max(1, args.repeats)):
        for name, (cmd, run_env, _) in runs.items():
            if name.startswith("datatrove"):  # a fresh log folder, or datatrove skips the tasks as completed
                subprocess.run(["rm", "-rf", cmd[4], cmd[-1]], check=True)
            before = load()
            times[name].append(timed(cmd, run_env))
            print(f"run {r + 1} {name}: {times[name][-1][0]:.1f} s wall, {times[name][-1][1]:.1f} CPU s "
                  f"(load average before: {before})", flush=True)

    with open(os.path.join(out, "ours.meta.json")) as f:
        meta = json.load(f)
    print(f"\n{mb:.1f} MB, {meta['num_docs']:,} documents, {meta['num_tokens']:,} tokens; ours tokenized with "
          f"{meta.get('encoder')}; its main process used {meta.get('main_cpu_seconds', 0):.1f} CPU s (last run)")
    head = f"{'tool':<24}{'wall s min':>11}{'median':>8}{'CPU s':>8}{'MB/s':>7}{'MB/s/worker':>12}{'MB/CPU s':>10}"
    print(head)
    stats = {}
    for name, t in times.items():
        wall, med, cpu = min(w for w, _ in t), statistics.median(w for w, _ in t), statistics.median(c for _, c in t)
        workers = 1 if name.endswith("1w") else args.workers
        stats[name] = (wall, med, cpu)
        print(f"{name:<24}{wall:>11.1f}{med:>8.1f}{cpu:>8.1f}{mb / med:>7.2f}{mb / med / workers:>12.2f}"
              f"{mb / cpu:>10.2f}")
    ok = True
    ref = os.path.join(out, "ours")
    checks = []
    for name, (cmd, _, prefix) in runs.items():
        if name.startswith("datatrove"):
            prefix = join_datatrove(cmd[4], args.workers, os.path.join(out, f"joined_{name.split()[1]}"))
        if prefix != ref:
            same = same_bytes(ref, prefix)
            ok &= same
            checks.append(f"{name} {'identical' if same else 'DIFFER'}")
    print(".bin/.idx against megatron-sat jsonl: " + ("; ".join(checks) or "nothing else ran"))
    o = stats["megatron-sat jsonl"]
    for name in stats:
        if name.startswith(("Megatron-LM", "datatrove")):
            s = stats[name]
            mine = stats["megatron-sat parquet"] if name.endswith("parquet") else o
            print(f"speed-up over {name}: {s[0] / mine[0]:.2f}x (fastest wall), {s[1] / mine[1]:.2f}x (median wall), "
                  f"{s[2] / mine[2]:.2f}x (median CPU s)")
    if "megatron-sat jsonl 1w" in stats:
        one = stats["megatron-sat jsonl 1w"]
        print(f"scaling 1 -> {args.workers} workers: {one[1] / o[1]:.2f}x (median wall), CPU s {one[2]:.1f} -> {o[2]:.1f}")
    if not tool:
        print("Megatron-LM comparison skipped: pass --megatron-lm PATH (a Megatron-LM checkout)")
    print(f"load average at the end: {load()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
