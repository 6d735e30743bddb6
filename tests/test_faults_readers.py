"""Readers that race with retention: a checkpoint being read (convert-to-hf, evaluate --checkpoint, a
--pretrained-checkpoint load) is marked (RUN/.readers/), and --save-retain-interval leaves it until it is free.

  marks: a live reader's mark keeps a checkpoint; a dead reader's (its pid gone) and another host's old one expire
  race:  10 exports (two at a time) of the run folder while a run saves every 2 steps with --save-retain-interval
         1000 (each save deletes the previous): every export exits 0 with a complete folder or 2 with one line,
         none a traceback; the run keeps training and ends with exit 0; at least one checkpoint was kept for a reader,
         and every kept one is deleted at a later save
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from train_cli import ROOT, env, rows, start, wait_for

from megatron_sat.training import run_folder


def _fake_checkpoint(root, iteration):
    d = run_folder.checkpoint_dir(str(root), iteration)
    os.makedirs(d)
    open(os.path.join(d, "metadata.json"), "w").close()
    return d


def test_reader_marks_keep_a_checkpoint_and_stale_ones_expire(tmp_path):
    root = str(tmp_path)
    _fake_checkpoint(root, 4)
    mark = run_folder.hold(root, 4, "convert-to-hf")
    assert run_folder.readers(root, 4) == [f"convert-to-hf (host {os.uname().nodename}, pid {os.getpid()})"]
    assert run_folder.retain(root, 4)[0] is False and run_folder.is_complete(run_folder.checkpoint_dir(root, 4))
    mark.release()
    assert run_folder.readers(root, 4) == []

    folder = os.path.join(root, run_folder.READERS)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with open(os.path.join(folder, "iter_0000004.x.1.json"), "w") as f:
        json.dump(dict(host=os.uname().nodename, pid=int(dead.stdout), tool="evaluate"), f)  # its process is gone
    elsewhere = os.path.join(folder, "iter_0000004.other.2.json")
    with open(elsewhere, "w") as f:
        json.dump(dict(host="another-host", pid=2, tool="evaluate"), f)
    assert run_folder.readers(root, 4) == ["evaluate (host another-host, pid 2)"]  # alive until its heartbeat ages
    old = time.time() - 1000
    os.utime(elsewhere, (old, old))
    assert run_folder.retain(root, 4) == (True, [])
    assert not os.path.exists(run_folder.checkpoint_dir(root, 4)) and not os.path.exists(folder)

    _fake_checkpoint(root, 6)  # retention took it first: the reader is told, and leaves no mark
    run_folder.retain(root, 6)
    with pytest.raises(run_folder.CheckpointGone, match="was deleted"):
        run_folder.hold(root, 6, "convert-to-hf")
    assert os.listdir(folder) == []  # the reader's own folder stays (it made it); its mark is gone


def _kept_not_yet_deleted(log: str):
    """(the checkpoints the run kept for a reader, those of them not deleted after their last keeping)."""
    lines = log.splitlines()
    kept = {line.split("kept checkpoint ")[1].split(" for now")[0]: i for i, line in enumerate(lines)
            if "kept checkpoint " in line}
    deleted = {line.split("deleted checkpoint ")[1].split(" (")[0]: i for i, line in enumerate(lines)
               if "deleted checkpoint " in line}
    return sorted(kept), [p for p, i in kept.items() if deleted.get(p, -1) < i]


@pytest.mark.slow
def test_exports_racing_retention_never_fail_with_a_traceback(tmp_path):
    run = tmp_path / "run"
    proc = start("--recipe", "debug_satformer", "--train-iters", "100000", "--save-interval", "2",
                 "--save-retain-interval", "1000", "--log-interval", "1", "--eval-interval", "100000",
                 "--no-progress-bar", "--save", run, "--load", run, log_path=tmp_path / "train.log")
    results = []
    try:
        wait_for(lambda: run_folder.latest_iteration(str(run)) is not None, proc, "the first checkpoint")
        steps_before = len(rows(run))
        exports = []
        for i in range(10):
            out = tmp_path / f"hf{i}"
            exports.append((out, subprocess.Popen(
                [sys.executable, os.path.join(ROOT, "tools", "convert_to_hf.py"), "--load", str(run), "--output",
                 str(out)], cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
            if len(exports) % 2 == 0:  # two at a time
                for out, p in exports[-2:]:
                    so, se = p.communicate(timeout=300)
                    results.append((out, p.returncode, so + se))
        assert proc.poll() is None, "the run stopped during the exports"
        steps_during = len(rows(run)) - steps_before
        # every checkpoint kept for a reader is deleted at a later save, once the reader let it go
        wait_for(lambda: not _kept_not_yet_deleted(open(tmp_path / "train.log").read())[1], proc,
                 "the deletion of the checkpoints kept for the readers")
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = open(tmp_path / "train.log").read()
    assert rc == 0, log[-3000:]
    assert steps_during > 10, f"the run made {steps_during} steps during the exports"
    for out, code, text in results:
        assert "Traceback" not in text, text[-3000:]
        if code == 0:
            assert (out / "config.json").is_file() and (out / "megatron_sat_conversion.json").is_file(), text
            assert any(n.endswith(".safetensors") for n in os.listdir(out)), text
        else:
            errors = [line for line in text.splitlines() if line.startswith("error:")]
            assert code == 2 and len(errors) == 1, (code, text[-3000:])
    ok = sum(code == 0 for _, code, _ in results)
    assert ok >= 8, [(code, text[-300:]) for _, code, text in results if code]
    assert "kept checkpoint" in log and "read by convert_to_hf.py" in log, "no export was ever held"
    assert "deleted checkpoint" in log
    kept, _ = _kept_not_yet_deleted(log)
    assert kept and not [p for p in kept if os.path.exists(p)], kept  # held ones were kept, then deleted
    marks = os.listdir(run / run_folder.READERS) if (run / run_folder.READERS).exists() else []
    assert not [n for n in marks if n.endswith(".json")], f"a reader mark was left: {marks}"
