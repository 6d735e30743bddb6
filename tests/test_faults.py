"""Faults, tested like features: signals at every moment, kill -9 mid-save, failed and full-disk saves,
corrupt checkpoints, mistaken arguments and mismatched data. Real trainer processes throughout.

Every run is debug_satformer on mock data, 16 steps, checkpoint every 4. R trains straight through and
gives the reference losses; every interrupted run below ends with the same 16 losses, exactly (the
torchrun chain at DP2: relative 1e-5, the DP all-reduce sums in another order).

  signals, in runs of their own process group (as Slurm steps and torchrun jobs are):
    P  SIGTERM to the group during a step (before any save)  -> saves, exit 0
       -> resumed, SIGUSR1 to the group after two saves      -> saves, exit 0 (the old BrokenPipeError)
       -> resumed to the end
    Q  SIGTERM to the group during a save (held 2 s)         -> that save completes, the next step saves, exit 0
       -> resumed, kill -9 during a save                     -> .tmp left, no helper process outlives it
       -> resumed: .tmp removed, back to the last complete checkpoint, to the end
    F  the save at 8 fails inside the write                  -> exit 4, one line, tracker at 4, no .tmp
       -> resumed to the end
    A  --async-save, SIGUSR1 to the group after a save       -> exit 0, manifests written -> resumed to the end
    T  torchrun 2 ranks: SIGUSR1 to rank 1 alone -> all save the same step; resumed, SIGTERM to torchrun's
       whole group (the agent forwards it) -> saves; resumed on one rank to the end
  run folders and checkpoints: no tracker, --save over a run, another shape, a flipped byte, a truncated
  file, --ckpt-fallback, retention, a full disk (tmpfs), the RNG round trip (tests/workers/checkpoint_rng.py)
  data: truncated .bin, ids past the vocabulary, another tokenizer, a missing tokenizer (tests/test_data.py
  covers preprocessing itself)
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from dist_utils import run_distributed
from safetensors.torch import save_file
from small_disk import small_tmpfs
from train_cli import ROOT, env, iter_dirs, latest, metrics, rows, start, train, wait_for

from megatron_sat.conversion.hf_io import read_hf_config, read_hf_weights
from megatron_sat.conversion.mapping import ConversionError
from megatron_sat.data import preprocess, train_bpe_tokenizer
from megatron_sat.training.integrity import verify

pytestmark = pytest.mark.slow  # fault suite: real trainer processes, signals and torchrun

BASE = ["--recipe", "debug_satformer", "--train-iters", "16", "--save-interval", "4", "--log-interval", "1",
        "--eval-interval", "8", "--no-progress-bar"]


def _steps(folder):
    return max((r["step"] for r in rows(folder) if "loss" in r), default=0)


def _log(path):
    with open(path) as f:
        return f.read()


def _interrupt(folder, log_path, condition, what, send, *extra, nproc=1, expect=(0,)):
    """Start a leg, wait for `condition`, call send(proc); returns (exit code, log)."""
    proc = start(*BASE, "--save", folder, "--load", folder, *extra, nproc=nproc, log_path=log_path)
    try:
        wait_for(condition, proc, what)
        send(proc)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = _log(log_path)
    assert rc in expect, f"exit {rc}:\n{log[-4000:]}"
    return rc, log


def _group(sig):
    return lambda proc: os.killpg(proc.pid, sig)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    out = {"tmp": tmp}
    out["R"] = train(*BASE, "--save", tmp / "R")

    p = str(tmp / "P")
    _, out["P1"] = _interrupt(p, tmp / "P1.log", lambda: _steps(p) >= 2, "step 2", _group(signal.SIGTERM))
    out["P1_stop"] = latest(p)
    _, out["P2"] = _interrupt(p, tmp / "P2.log", lambda: latest(p) == 8 and _steps(p) >= 9, "two saves",
                              _group(signal.SIGUSR1))
    out["P2_stop"] = latest(p)
    out["P3"] = train(*BASE, "--save", p, "--load", p)

    q = str(tmp / "Q")
    held = lambda: "debug: holding the save of iteration 4" in _log(tmp / "Q1.log")  # noqa: E731
    _, out["Q1"] = _interrupt(q, tmp / "Q1.log", held, "the save at 4", _group(signal.SIGTERM),
                              "--debug-save-delay", "2")
    out["Q1_stop"] = latest(q)
    children = {}

    def kill9(proc):
        children["pids"] = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        os.kill(proc.pid, signal.SIGKILL)

    held8 = lambda: "debug: holding the save of iteration 8" in _log(tmp / "Q2.log")  # noqa: E731
    _, out["Q2"] = _interrupt(q, tmp / "Q2.log", held8, "the save at 8", kill9, "--debug-save-delay", "30",
                              expect=(-signal.SIGKILL,))
    deadline = time.time() + 15
    while time.time() < deadline and any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                                         for pid in children["pids"]):
        time.sleep(0.1)
    out["Q2_children"] = children["pids"]
    out["Q2_left"] = [pid for pid in children["pids"] if psutil.pid_exists(pid)
                      and psutil.Process(pid).status() != "zombie"]
    out["Q2_listing"] = sorted(os.listdir(q))
    out["Q3"] = train(*BASE, "--save", q, "--load", q)

    f = str(tmp / "F")
    out["F1"] = train(*BASE, "--save", f, "--debug-fail-save-at", "8", expect=4)
    out["F1_listing"] = sorted(os.listdir(f))
    out["F2"] = train(*BASE, "--save", f, "--load", f)

    a = str(tmp / "A")
    _, out["A1"] = _interrupt(a, tmp / "A1.log", lambda: latest(a) == 4 and _steps(a) >= 6, "the async save at 4",
                              _group(signal.SIGUSR1), "--async-save")
    out["A1_stop"] = latest(a)
    out["A2"] = train(*BASE, "--save", a, "--load", a, "--async-save")

    t = str(tmp / "T")

    def rank1(proc):
        workers = sorted(psutil.Process(proc.pid).children(), key=lambda c: c.pid)
        os.kill(workers[-1].pid, signal.SIGUSR1)

    _, out["T1"] = _interrupt(t, tmp / "T1.log", lambda: _steps(t) >= 6, "step 6", rank1, nproc=2)
    out["T1_stop"] = latest(t)
    # torchrun's agent forwards SIGTERM to its workers and then exits 1 itself (its own design): the ranks save
    _, out["T2"] = _interrupt(t, tmp / "T2.log", lambda: _steps(t) >= out["T1_stop"] + 3, "3 more steps",
                              _group(signal.SIGTERM), nproc=2, expect=(0, 1))
    out["T2_stop"] = latest(t)
    out["T3"] = train(*BASE, "--save", t, "--load", t)
    return out


def _same_losses(runs, name, rel=0.0):
    ref, ref_val = metrics(runs["tmp"] / "R")
    got, val = metrics(runs["tmp"] / name)
    assert sorted(got) == list(range(1, 17)), sorted(got)
    for step in got:
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=rel, abs=0), step
    assert val == pytest.approx(ref_val, rel=rel, abs=0)
    assert latest(runs["tmp"] / name) == 16
    assert not [p for p in os.listdir(runs["tmp"] / name) if p.endswith((".tmp", ".del"))]
    assert all(os.path.isfile(runs["tmp"] / name / d / "manifest.json") for d in iter_dirs(runs["tmp"] / name))


def test_signals_to_the_process_group_during_a_step_and_after_saves(runs):
    assert runs["P1_stop"] is not None and 2 <= runs["P1_stop"] < 8, runs["P1"][-2000:]
    assert "signal SIGTERM" in runs["P1"]
    assert runs["P2_stop"] >= 9 and "signal SIGUSR1" in runs["P2"], runs["P2"][-3000:]
    assert "BrokenPipeError" not in runs["P2"] and "Traceback" not in runs["P2"]
    _same_losses(runs, "P")


def test_signal_during_a_save_and_kill_9_mid_save(runs):
    assert runs["Q1_stop"] == 5, runs["Q1"][-3000:]  # the held save finished, then step 5 saved and stopped
    assert "saved checkpoint" in runs["Q1"] and "signal SIGTERM" in runs["Q1"]
    assert "iter_0000008.tmp" in runs["Q2_listing"] and "latest_checkpointed_iteration.txt" in runs["Q2_listing"]
    assert runs["Q2_children"], "the save started no helper process: this test no longer checks them"
    assert not runs["Q2_left"], f"helper processes outlived the trainer: {runs['Q2_left']}"
    assert "removed what interrupted saves left" in runs["Q3"] and "iter_0000008.tmp" in runs["Q3"]
    assert "resumed from" in runs["Q3"] and "iter_0000005" in runs["Q3"]
    _same_losses(runs, "Q")


def test_a_failed_save_keeps_the_previous_checkpoint(runs):
    lines = [line for line in runs["F1"].splitlines() if "error:" in line]
    assert len(lines) == 1 and "could not write checkpoint" in lines[0] and "iter_0000008" in lines[0], runs["F1"]
    assert "iter_0000004 is intact" in lines[0]
    assert "Traceback" not in runs["F1"]
    assert runs["F1_listing"] == ["config.json", "iter_0000004", "latest_checkpointed_iteration.txt",
                                  "metrics.jsonl"]
    assert "resumed from" in runs["F2"] and "iter_0000004" in runs["F2"]
    _same_losses(runs, "F")


def test_async_save_survives_a_signal_and_resumes_exactly(runs):
    assert "in the background" in runs["A1"] and runs["A1_stop"] >= 6, runs["A1"][-3000:]
    assert "signal SIGUSR1" in runs["A1"]
    _same_losses(runs, "A")


def test_torchrun_signal_to_one_rank_then_to_the_whole_group(runs):
    assert "signal from another rank" in runs["T1"] or "signal SIGUSR1" in runs["T1"], runs["T1"][-3000:]
    assert runs["T1_stop"] is not None and runs["T1_stop"] >= 6
    assert runs["T2_stop"] >= runs["T1_stop"] + 3 and "signal SIGTERM" in runs["T2"], runs["T2"][-3000:]
    _same_losses(runs, "T", rel=1e-5)


# ---------------------------------------------------------------------------------------------
# run folders and checkpoints
# ---------------------------------------------------------------------------------------------

def _copy_run(runs, tmp_path, name="run"):
    dst = tmp_path / name
    shutil.copytree(runs["tmp"] / "R", dst)
    return dst


def test_a_run_without_its_tracker_is_resumed_not_restarted(runs, tmp_path):
    d = _copy_run(runs, tmp_path)
    os.remove(d / "latest_checkpointed_iteration.txt")
    before = (d / "metrics.jsonl").read_bytes()
    log = train(*BASE, "--save", d, "--load", d)
    assert "has no latest_checkpointed_iteration.txt: resuming from the newest complete checkpoint" in log
    assert "nothing to do" in log and "iter_0000016" in log
    assert (d / "metrics.jsonl").read_bytes() == before  # no duplicate validation line, nothing rewritten
    assert iter_dirs(d) == ["iter_0000004", "iter_0000008", "iter_0000012", "iter_0000016"]
    for text, message in (("abc", "holds 'abc', not an iteration; complete checkpoints there: 4, 8, 12, 16"),
                          ("30", "names iteration 30 but")):
        (d / "latest_checkpointed_iteration.txt").write_text(text)
        log = train(*BASE, "--save", d, "--load", d, expect=2)
        assert message in log and "Traceback" not in log, log[-2000:]


def test_save_over_another_run_and_another_shape_are_refused(runs, tmp_path):
    d = _copy_run(runs, tmp_path)
    log = train(*BASE, "--save", d, expect=2)
    assert f"--save {d} already holds a run's checkpoints: resume it with --load {d}" in log
    log = train(*BASE, "--save", d / "config.json", expect=2)
    assert "is a file, not a folder" in log
    log = train(*BASE, "--save", tmp_path / "new", "--load", d, "--num-layers", "2", "--hidden-size", "128",
                "--arch", "transformer", expect=2)
    line = next(line for line in log.splitlines() if "error:" in line)
    for field in ("arch 'satformer' in the checkpoint, 'transformer' now", "num_layers 4 in the checkpoint, 2 now",
                  "hidden_size 64 in the checkpoint, 128 now"):
        assert field in line, line
    assert "Traceback" not in log and not (tmp_path / "new").exists()


def _first_distcp(directory):
    return next(os.path.join(directory, n) for n in sorted(os.listdir(directory)) if n.endswith(".distcp"))


def test_corrupt_checkpoints_are_named_and_fallback_resumes_the_previous(runs, tmp_path):
    d = _copy_run(runs, tmp_path)
    shard = _first_distcp(d / "iter_0000016")
    with open(shard, "r+b") as f:  # 1 KB of zeros inside the file
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"\0" * 1024)
    log = train(*BASE, "--save", d, "--load", d, expect=2)
    assert f"{shard} does not match its checksum" in log and "--ckpt-fallback" in log, log[-2000:]
    log = train(*BASE, "--save", d, "--load", d, "--ckpt-fallback")
    assert "falling back to" in log and "iter_0000012" in log
    got, _ = metrics(d)
    ref, _ = metrics(runs["tmp"] / "R")
    assert [got[s]["loss"] for s in range(13, 17)] == [ref[s]["loss"] for s in range(13, 17)]
    # a truncated file, in a copy whose newest checkpoint is fine: asked for by --ckpt-step
    e = _copy_run(runs, tmp_path, "trunc")
    shard = _first_distcp(e / "iter_0000008")
    os.truncate(shard, os.path.getsize(shard) - 100)
    log = train(*BASE, "--save", tmp_path / "t2", "--load", e, "--ckpt-step", "8", expect=2)
    assert f"{shard} has" in log and "(truncated or replaced)" in log, log[-2000:]


def test_retention_keeps_multiples_of_the_interval_and_the_newest(tmp_path):
    log = train("--recipe", "debug_satformer", "--train-iters", "12", "--save-interval", "2",
                "--save-retain-interval", "4", "--save", tmp_path / "keep", "--no-progress-bar")
    assert iter_dirs(tmp_path / "keep") == ["iter_0000004", "iter_0000008", "iter_0000012"]
    assert log.count("deleted checkpoint") == 3


def test_a_full_disk_fails_the_save_cleanly(runs, tmp_path):
    size = sum(os.path.getsize(runs["tmp"] / "R" / "iter_0000004" / n)
               for n in os.listdir(runs["tmp"] / "R" / "iter_0000004"))
    with small_tmpfs(tmp_path / "small", int(size * 1.6) // 4096 * 4096 + 4096) as mnt:
        log = train(*BASE, "--save", mnt / "run", expect=4)
        line = next(line for line in log.splitlines() if "error:" in line)
        assert "the disk is full" in line and "iter_0000008" in line and "iter_0000004 is intact" in line, log
        assert sorted(os.listdir(mnt / "run")) == ["config.json", "iter_0000004", "latest_checkpointed_iteration.txt",
                                                   "metrics.jsonl"]
        assert verify(str(mnt / "run" / "iter_0000004"), collective=False)


def test_a_full_disk_fails_the_save_on_every_rank_whichever_write_it_stops(tmp_path):
    """Two ranks (tests/workers/full_disk_save.py) on a tmpfs filled so that exactly the files before one write fit:
    a shard, Megatron-Core's .metadata and metadata.json and our manifest.json (each written by rank 0 alone, then a
    collective the other rank waits in), the tracker. Each save fails on both ranks with the same one line, leaves the
    run folder as it was and the group in step; synchronous and asynchronous. Was: rank 0's .metadata failing left
    rank 1 in Megatron-Core's broadcast and rank 0 in our barrier, a deadlock (the chaos run's disk_full, once)."""
    with small_tmpfs(tmp_path / "small", 32 << 20) as mnt:
        out = run_distributed(os.path.join(ROOT, "tests", "workers", "full_disk_save.py") + ":main", 2, str(mnt),
                              timeout=180)[0]  # 20 s here; a deadlock fails it
    assert set(out["files"]) == {".metadata", "metadata.json", "manifest.json", "__0_0.distcp", "__1_0.distcp"}, out
    run = mnt / "run"
    failed = f"could not write checkpoint {run}/iter_0000004: the disk is full"
    as_before = ["iter_0000002", "latest_checkpointed_iteration.txt"]
    for mode in ("sync", "async"):
        for level in ("shard", ".metadata", "metadata.json", "manifest.json", "tracker"):
            seen = out["levels"][f"{mode} {level}"]
            said = seen["outcomes"]
            assert said[0] == said[1] and said[0].startswith(failed), (mode, level, said)
            assert said[0].endswith(f"({run}/iter_0000002 is intact)") and "\n" not in said[0], (mode, level, said)
            assert (seen["sum"], seen["listing"], seen["tracker"]) == (3, as_before, 2), (mode, level, seen)
        seen = out["levels"][f"{mode} room"]
        assert seen["outcomes"] == ["saved", "saved"], (mode, seen)
        assert (seen["listing"], seen["tracker"]) == (["iter_0000002", "iter_0000004", as_before[1]], 4), seen


def test_rng_state_round_trip(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "workers", "checkpoint_rng.py"),
                           str(tmp_path)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "draws after the resume equal those after the save" in proc.stdout


# ---------------------------------------------------------------------------------------------
# data against the run
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults-data")
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    text = d / "a.jsonl"
    other = d / "b.jsonl"
    with open(text, "w") as f:
        for i in range(64):
            f.write(json.dumps({"text": " ".join(words[(i + j) % 12] for j in range(3))}) + "\n")
    with open(other, "w") as f:
        for i in range(64):
            f.write(json.dumps({"text": f"{i * 7919} + {i} = {i * 7920}; " * 3}) + "\n")
    small = train_bpe_tokenizer([str(text)], 300, str(d / "tok_small"))
    big = train_bpe_tokenizer([str(text), str(other)], 600, str(d / "tok_big"))
    train_bpe_tokenizer([str(other)], 300, str(d / "tok_other"))
    preprocess([str(text)], small, str(d / "small_text_document"), progress=False)
    preprocess([str(other)], big, str(d / "big_text_document"), progress=False)
    shutil.copy(d / "small_text_document.idx", d / "cut_text_document.idx")
    with open(d / "small_text_document.bin", "rb") as f:
        blob = f.read()
    (d / "cut_text_document.bin").write_bytes(blob[:-10])
    return d


DATA_RUN = ["--arch", "satformer", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "16", "--train-iters", "2", "--split", "100,0,0", "--no-progress-bar"]


@pytest.mark.parametrize("prefix, tokenizer, message", [
    ("cut_text_document", "tok_small", "cut_text_document.bin has"),
    ("big_text_document", "tok_small", "but the tokenizer"),
    ("small_text_document", "tok_other", "was tokenized with"),
    ("small_text_document", "no_such_tokenizer", "--tokenizer-model: tokenizer path does not exist"),
])
def test_data_that_does_not_fit_the_run_is_refused_before_step_1(data, tmp_path, prefix, tokenizer, message):
    log = train(*DATA_RUN, "--data-path", data / prefix, "--tokenizer-model", data / tokenizer,
                "--save", tmp_path / "run", expect=2)
    lines = [line for line in log.splitlines() if "error:" in line]
    assert len(lines) == 1 and message in lines[0], log[-3000:]
    assert "Traceback" not in log
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_tokenizer_mismatch_can_be_allowed_and_repeated_epochs_are_warned(data, tmp_path):
    log = train(*DATA_RUN, "--data-path", data / "small_text_document", "--tokenizer-model", data / "tok_other",
                "--allow-tokenizer-mismatch", "--micro-batch-size", "16", "--global-batch-size", "128",
                "--save", tmp_path / "run")  # 2 x 128 x 17 tokens of a ~350-token corpus
    assert "passes over the training split" in log and "done: 2 steps" in log


# ---------------------------------------------------------------------------------------------
# tools: outputs apart from inputs, inputs that name their problem
# ---------------------------------------------------------------------------------------------

def _tool(*argv, expect=2):
    proc = subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_conversion_never_writes_over_its_input(runs, tmp_path):
    d = _copy_run(runs, tmp_path)
    before = sorted(os.listdir(d))
    log = _tool("tools/convert_to_hf.py", "--load", d, "--output", d, "--overwrite")
    assert f"--output {d} is --load {d}: write to a folder apart from the input" in log
    log = _tool("tools/convert_to_hf.py", "--load", d, "--output", d / "hf")
    assert "lies inside --load" in log
    assert sorted(os.listdir(d)) == before
    log = _tool("tools/evaluate.py", "--model", d, "--tasks", "lambada_openai")
    assert f"--model {d} is a Megatron checkpoint: convert it first" in log
    log = _tool("tools/submit_grid.py", "--seeds", "a,b", "--dry-run")
    assert "'a,b' must be comma-separated integers" in log
    log = _tool("tools/benchmark_checkpoint_hash.py", "--gib", "0")
    assert "--gib must be > 0" in log
    log = train(*BASE, "--save", d / "sub", "--load", d, expect=2)
    assert "--save" in log and "lies inside --load" in log


def test_damaged_hf_files_are_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "satformer", ')
    with pytest.raises(ConversionError, match=r"config.json is not valid JSON"):
        read_hf_config(str(tmp_path))
    save_file({"w": torch.ones(1000)}, str(tmp_path / "model.safetensors"))
    os.truncate(tmp_path / "model.safetensors", os.path.getsize(tmp_path / "model.safetensors") - 64)
    with pytest.raises(ConversionError, match=r"model.safetensors is unreadable .* truncated or damaged"):
        read_hf_weights(str(tmp_path))


def test_help_shows_no_default_for_switches():
    out = _tool("-m", "megatron_sat.train", "--help", expect=0)
    for flag in ("--no-save-final", "--hc-static", "--async-save", "--ckpt-fallback"):
        block = out[out.index(flag):].split("\n  -")[0]
        assert "(default:" not in block, block
    assert "(default: satformer)" in out  # valued options keep theirs
    assert "(default: None)" not in out.split("--ffn-hidden-size")[1].split("--value-residual-gate")[0]
