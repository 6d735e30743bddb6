"""Faults in files and folders, tested like features (issue 28, items 1, 2, 3, 8, 9). Real trainer and tool
processes where the fault is in what they do; the lock and record helpers in-process.

Every run is debug_satformer on mock data, 8 steps, a checkpoint every 4 (the word-level test tokenizer is
recorded, so that `evaluate --checkpoint` can read the checkpoints). R trains straight through and gives
the reference losses.

  torn records     R as a job killed while writing step 5's line: that line and config.json cut in half, its
                   lock left (a dead pid) -> resumed from 4: all three set aside / taken over with a warning,
                   losses exactly R's; sweep records under _grid/ and line parsing in-process
  one job a folder A trains (saves held 8 s); B on the same folder -> exit 2, one line naming A's host and pid;
                   A ends exactly as R; stale heartbeats and Slurm requeues (in-process)
  verified reads   a flipped byte in a .distcp: convert_to_hf and evaluate --checkpoint refuse it (exit 2, in
                   this process: before any set-up), accept it with --no-verify-checkpoint; the trainer's
                   --pretrained-checkpoint refuses it; an import (convert_from_hf) carries a manifest
  mid-save         iter_XXXXXXX.tmp never offered nor read (convert_to_hf, evaluate --checkpoint)
  read-only        an immutable run folder (chattr +i, which stops root too) -> one line, exit 2
  another model    a resume whose model differs only in fields that keep every tensor shape (the gate function,
                   value_residual_last_k, the ResFormer lambda mode) -> one line naming each, exit 2
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from train_cli import ROOT, env, metrics, start, train, wait_for

from megatron_sat.analysis.grid import read_metrics
from megatron_sat.conversion.mapping import ConversionError
from megatron_sat.conversion.megatron_io import find_checkpoint
from megatron_sat.sweep.records import record_sweep, sweep_records
from megatron_sat.training import records, run_lock
from megatron_sat.training.integrity import verify
from megatron_sat.training.run_lock import NotWritable, RunLock

pytestmark = pytest.mark.slow  # fault suite: real trainer and tool processes

TASKS = os.path.join(ROOT, "tests", "data", "eval")


def _base(tok):
    return ["--recipe", "debug_satformer", "--train-iters", "8", "--save-interval", "4", "--log-interval", "1",
            "--eval-interval", "4", "--no-progress-bar", "--tokenizer-model", tok]


def _tool(*argv, expect=2):
    proc = subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == expect, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _errors(log):
    return [line for line in log.splitlines() if "error:" in line]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults-files")
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(126)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp / "tok").mkdir()
    tok.save(str(tmp / "tok" / "tokenizer.json"))
    base = _base(str(tmp / "tok" / "tokenizer.json"))
    train(*base, "--save", tmp / "R")
    return dict(tmp=tmp, base=base)


def _same_losses(ref, folder):
    want, want_val = metrics(ref["tmp"] / "R")
    got, val = metrics(folder)
    assert sorted(got) == list(range(1, 9)), sorted(got)
    assert [got[s]["loss"] for s in range(1, 9)] == [want[s]["loss"] for s in range(1, 9)]
    assert val == want_val


def _copy(ref, tmp_path, name="run"):
    dst = tmp_path / name
    shutil.copytree(ref["tmp"] / "R", dst)
    return dst


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def _first_distcp(directory):
    return next(os.path.join(directory, n) for n in sorted(os.listdir(directory)) if n.endswith(".distcp"))


# ---------------------------------------------------------------------------------------------
# 1. torn records
# ---------------------------------------------------------------------------------------------

def test_torn_records_and_a_dead_jobs_lock_do_not_stop_the_resume(ref, tmp_path):
    """R as a job killed while it wrote step 5's line (the checkpoint at 4 its last), with config.json cut in half
    and its lock left behind (the pid is gone): the resume warns about all three and ends exactly as R."""
    run = _copy(ref, tmp_path)
    (run / "latest_checkpointed_iteration.txt").write_text("4")
    shutil.rmtree(run / "iter_0000008")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line)["step"] <= 4]
    step5 = next(line for line in lines if json.loads(line)["step"] == 5)
    (run / "metrics.jsonl").write_text("".join(kept) + step5[: len(step5) // 2])  # the line cut in half
    config = (run / "config.json").read_text()
    (run / "config.json").write_text(config[: len(config) // 2])
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run / ".run.lock").write_text(json.dumps(dict(host=socket.gethostname(), pid=dead.pid, started="then",
                                                   token="x")))
    log = train(*ref["base"], "--save", run, "--load", run)
    assert "Traceback" not in log and "resumed from" in log and "iter_0000004" in log
    assert f"warning: {run / 'metrics.jsonl'}: line(s) {len(kept) + 1} did not read back" in log, log[-3000:]
    assert f"set aside in {run / 'metrics.jsonl.torn'}" in log
    assert step5[: len(step5) // 2] in (run / "metrics.jsonl.torn").read_text()  # kept, not lost
    assert f"warning: {run / 'config.json'} did not read back" in log
    torn_configs = list(run.glob("config.json.torn-*"))
    assert len(torn_configs) == 1 and torn_configs[0].read_text() == config[: len(config) // 2]
    assert json.loads((run / "config.json").read_text())["restarts"] == 0  # its start list went with it, as said
    assert f"warning: took over the lock of {run} from a job that is gone" in log
    assert f"its process {dead.pid} on this host is gone" in log
    assert not (run / ".run.lock").exists()
    _same_losses(ref, run)


def test_torn_lines_and_sweep_records_in_process(tmp_path, capsys):
    good, bad = records.parse_lines('{"step": 1}\n{"step": 2, "lo\n\n{"step": 3}\n\0\0\0')
    assert [r["step"] for _, r in good] == [1, 3] and [n for n, _ in bad] == [2, 5]
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    assert [r["step"] for r in read_metrics(str(path))] == [1]
    assert "its last line is cut short" in capsys.readouterr().err
    said = []
    assert records.set_aside(str(path), bad, said.append) == str(path) + ".torn"
    assert records.set_aside(str(path), bad[:1], said.append)  # a second tear is appended, the first stays
    assert (tmp_path / "m.jsonl.torn").read_text().count("set aside") == 2 and len(said) == 2
    grid = tmp_path / "runs" / "_grid"
    grid.mkdir(parents=True)
    (grid / "ladder.json").write_text('{"sweep": "ladder", "arrays": [{"job": "1"')
    assert sweep_records([str(tmp_path / "runs")]) == []
    assert "ladder.json: unreadable" in capsys.readouterr().err
    record_sweep(str(grid), "ladder", [dict(job="2", jobs=["2"], manifest="m", entries=[])])
    assert "set aside as" in capsys.readouterr().err
    assert [a["job"] for a in sweep_records([str(tmp_path / "runs")])[0]["arrays"]] == ["2"]
    assert len(list(grid.glob("ladder.json.torn-*"))) == 1


# ---------------------------------------------------------------------------------------------
# 3. one job per run folder
# ---------------------------------------------------------------------------------------------

def test_a_second_trainer_on_a_folder_is_refused_and_the_first_unharmed(ref, tmp_path):
    run = tmp_path / "shared"
    proc = start(*ref["base"], "--save", run, "--load", run, "--debug-save-delay", "8", log_path=tmp_path / "A.log")
    try:
        wait_for(lambda: (run / "metrics.jsonl").exists(), proc, "the first trainer's start")
        holder = json.loads((run / ".run.lock").read_text())
        assert holder["pid"] == proc.pid and holder["host"] == socket.gethostname()
        log = train(*ref["base"], "--save", run, "--load", run, "--seed", "2", expect=2)
        assert proc.poll() is None, "the first trainer ended before the second tried: this test no longer checks"
        lines = _errors(log)
        assert len(lines) == 1 and "is in use by another job" in lines[0], log[-3000:]
        assert f"host {socket.gethostname()}, pid {proc.pid}" in lines[0] and "Traceback" not in log
        assert proc.wait(timeout=300) == 0, (tmp_path / "A.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not (run / ".run.lock").exists()  # released at the end
    _same_losses(ref, run)  # the first run never saw the second
    config = json.loads((run / "config.json").read_text())
    assert config["seed"] != 2 and config["restarts"] == 0


def test_lock_heartbeat_and_slurm_restarts_in_process(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    folder.mkdir()
    lock_path = folder / run_lock.LOCK
    other = dict(host="node-elsewhere", pid=4242, slurm_job="77", slurm_restart="0", started="then", token="t")
    lock_path.write_text(json.dumps(other))
    with pytest.raises(run_lock.LockHeld, match=r"in use by another job \(host node-elsewhere, pid 4242, Slurm job "
                                                r"77, since then; heartbeat \d+ s ago\)"):
        run_lock.RunLock(str(folder)).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the same job, requeued: its earlier start is gone
    said = []
    lock = run_lock.RunLock(str(folder), said.append).acquire()
    assert "an earlier start of this Slurm job (77, restart 0)" in said[0]
    assert json.loads(lock_path.read_text())["token"] == lock.token
    lock.release()
    assert not lock_path.exists()
    monkeypatch.delenv("SLURM_JOB_ID")
    lock_path.write_text(json.dumps(other))
    old = time.time() - run_lock.STALE_S - 10  # a heartbeat older than the stated time
    os.utime(lock_path, (old, old))
    lock = run_lock.RunLock(str(folder), said.append).acquire()
    assert "its heartbeat is" in said[-1] and f"(more than {run_lock.STALE_S:.0f} s)" in said[-1]
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    second = run_lock.RunLock(str(folder))
    with pytest.raises(run_lock.LockHeld, match=f"pid {os.getpid()}"):  # held by this live process
        second.acquire()
    lock.release()
    fresh = run_lock.RunLock(str(folder)).acquire()  # the heartbeat thread keeps the mtime fresh
    os.utime(lock_path, (old, old))
    time.sleep(0.5)
    assert time.time() - os.stat(lock_path).st_mtime < 5
    lock_path.write_text(json.dumps(other))  # taken over meanwhile by a job that judged ours stale
    fresh.release()  # not ours any more: left alone
    assert json.loads(lock_path.read_text()) == other


def test_a_lock_younger_than_the_stale_age_is_held_and_an_older_one_taken_over(tmp_path):
    """docs/reliability_files.md: on any host, a heartbeat older than 300 s (MEGATRON_SAT_LOCK_STALE_S) is stale;
    the heartbeat period is 30 s (MEGATRON_SAT_LOCK_HEARTBEAT_S). A holder on another host whose heartbeat is
    ten heartbeats old but 2 s younger than the stale age is refused; 2 s older than it, taken over."""
    assert (run_lock.STALE_S, run_lock.HEARTBEAT_S) == (300.0, 30.0)  # the documented defaults (no env set here)
    folder = tmp_path / "run"
    folder.mkdir()
    lock_path = folder / run_lock.LOCK
    other = dict(host="node-elsewhere", pid=4242, slurm_job=None, slurm_restart="0", started="then", token="t")
    for age, taken in ((run_lock.STALE_S - 2, False), (run_lock.STALE_S + 2, True)):
        assert age > 9 * run_lock.HEARTBEAT_S  # far more than one missed heartbeat either way
        lock_path.write_text(json.dumps(other))
        then = time.time() - age
        os.utime(lock_path, (then, then))
        said = []
        if not taken:
            with pytest.raises(run_lock.LockHeld, match=r"host node-elsewhere, pid 4242, since then; heartbeat 29[89] s"):
                run_lock.RunLock(str(folder), said.append).acquire()
            assert json.loads(lock_path.read_text()) == other and not said  # left alone
            continue
        lock = run_lock.RunLock(str(folder), said.append).acquire()
        assert len(said) == 1 and "its heartbeat is 30" in said[0] and "(more than 300 s)" in said[0], said
        assert json.loads(lock_path.read_text())["token"] == lock.token
        lock.release()
    # the two numbers come from the environment
    code = "from megatron_sat.training import run_lock as r; print(r.STALE_S, r.HEARTBEAT_S)"
    out = subprocess.run([sys.executable, "-c", code], env={**env(), "MEGATRON_SAT_LOCK_STALE_S": "45",
                                                             "MEGATRON_SAT_LOCK_HEARTBEAT_S": "5"},
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.split() == ["45.0", "5.0"], out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------
# 2. every reader verifies; 8. never an unfinished checkpoint
# ---------------------------------------------------------------------------------------------

def _tool_main(tool, argv, capsys):
    """A tool's main() in this process (its refusals come before any set-up); (exit code, stderr)."""
    sys.path.insert(0, ROOT)
    module = __import__(f"tools.{tool}", fromlist=["main"])
    code = module.main([str(a) for a in argv])
    assert not _dist_initialized(), f"{tool} set up a process group before refusing"
    return code, capsys.readouterr().err


def _dist_initialized():
    return torch.distributed.is_initialized()


def test_corrupt_shard_refused_by_every_reader_unless_told(ref, tmp_path, capsys):
    run = _copy(ref, tmp_path)
    shard = _first_distcp(run / "iter_0000008")
    _flip(shard)
    code, err = _tool_main("convert_to_hf", ["--load", run, "--output", tmp_path / "hf_bad"], capsys)
    lines = _errors(err)
    assert code == 2 and len(lines) == 1 and f"{shard} does not match its checksum" in lines[0], err
    assert "--no-verify-checkpoint" in lines[0] and not (tmp_path / "hf_bad").exists()
    evaluate = ["--checkpoint", run, "--tasks", "megatron_sat_tiny_mc", "--include-path", TASKS, "--limit", "2",
                "--device", "cpu"]
    code, err = _tool_main("evaluate", evaluate, capsys)
    assert code == 2 and f"{shard} does not match its checksum" in err, err
    log = _tool("tools/convert_to_hf.py", "--load", run, "--output", tmp_path / "hf_unchecked",
                "--no-verify-checkpoint", expect=0)
    assert "without checking its files" in log and (tmp_path / "hf_unchecked" / "config.json").exists()
    log = _tool("tools/evaluate.py", *evaluate, "--no-verify-checkpoint", expect=0)
    assert "| megatron_sat_tiny_mc" in log, log[-3000:]
    log = train(*ref["base"], "--save", tmp_path / "new", "--pretrained-checkpoint", run, expect=2)
    assert f"{shard} does not match its checksum" in log and not (tmp_path / "new").exists()
    # an import (convert_from_hf) carries a manifest like every trainer save: its --load is checked the same way
    imported = tmp_path / "imported"
    _tool("tools/convert_from_hf.py", "--hf", tmp_path / "hf_unchecked", "--save", imported, "--lr", "3e-3",
          "--min-lr", "3e-4", "--train-iters", "8", expect=0)
    assert verify(str(imported / "iter_0000000"), collective=False)
    assert not (imported / ".run.lock").exists()


def test_an_iteration_folder_is_verified_as_the_run_folder_is(ref, tmp_path, capsys):
    """convert-to-hf --load RUN/iter_0000004 and evaluate --checkpoint RUN/iter_0000004 (an iteration folder, not the
    latest, named directly) check that folder's manifest: a flipped byte there is refused (exit 2, one line)."""
    run = _copy(ref, tmp_path)
    shard = _first_distcp(run / "iter_0000004")
    _flip(shard)
    code, err = _tool_main("convert_to_hf", ["--load", run / "iter_0000004", "--output", tmp_path / "hf"], capsys)
    lines = _errors(err)
    assert code == 2 and len(lines) == 1 and f"{shard} does not match its checksum" in lines[0], err
    assert "--no-verify-checkpoint" in lines[0] and not (tmp_path / "hf").exists()
    code, err = _tool_main("evaluate", ["--checkpoint", run / "iter_0000004", "--tasks", "megatron_sat_tiny_mc",
                                        "--include-path", TASKS, "--limit", "2", "--device", "cpu"], capsys)
    assert code == 2 and f"{shard} does not match its checksum" in err, err


def test_an_unfinished_checkpoint_is_never_offered_nor_read(ref, tmp_path, capsys):
    run = _copy(ref, tmp_path)
    os.remove(run / "latest_checkpointed_iteration.txt")
    shutil.rmtree(run / "iter_0000008")
    shutil.copytree(ref["tmp"] / "R" / "iter_0000008", run / "iter_0000008.tmp")  # a save cut before its rename
    code, err = _tool_main("convert_to_hf", ["--load", run / "iter_0000008.tmp", "--output", tmp_path / "hf"], capsys)
    lines = _errors(err)
    assert code == 2 and len(lines) == 1 and "iter_0000008.tmp is an unfinished checkpoint" in lines[0], err
    assert f"pass {run} or {run / 'iter_0000004'}" in lines[0] and not (tmp_path / "hf").exists()
    with pytest.raises(ConversionError) as e:
        find_checkpoint(str(run))
    assert "its complete checkpoints: iter_0000004" in str(e.value) and ".tmp" not in str(e.value)
    shutil.rmtree(run / "iter_0000004")
    with pytest.raises(ConversionError, match=r"only unfinished checkpoints: iter_0000008.tmp; wait for the save"):
        find_checkpoint(str(run))
    code, err = _tool_main("evaluate", ["--checkpoint", run / "iter_0000008.tmp", "--tasks", "megatron_sat_tiny_mc",
                                        "--include-path", TASKS], capsys)
    assert code == 2 and "iter_0000008.tmp is an unfinished checkpoint" in err, err


# ---------------------------------------------------------------------------------------------
# 9. a run folder that cannot be written
# ---------------------------------------------------------------------------------------------

def test_a_read_only_run_folder_is_refused_before_anything_is_built(ref, tmp_path):
    """Tests run as root, where chmod stops no write: the folder is made immutable (chattr +i), which stops
    root as well (ext4, xfs, btrfs)."""
    run = _copy(ref, tmp_path)
    made = subprocess.run(["chattr", "+i", str(run)], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot make a folder immutable here (chattr +i: {made.stderr.strip()}); nothing else stops "
                    "root's writes without mounting")
    try:
        with pytest.raises(OSError):  # the fault is real: nothing can be created in it
            open(run / "probe", "w").close()
        log = train(*ref["base"], "--save", run, "--load", run, "--train-iters", "12", expect=2)
        assert f"--save {run} is not writable" in log and "Traceback" not in log, log[-3000:]
        log = train(*ref["base"], "--save", run / "sub" / "new", expect=2)
        assert f"--save {run / 'sub' / 'new'} is not writable ({run} cannot be written" in log
        with pytest.raises(NotWritable, match=r"is not writable \(not permitted"):  # the lock's own check
            RunLock(str(run)).acquire()
    finally:
        subprocess.run(["chattr", "-i", str(run)], check=False)
    assert sorted(os.listdir(run)) == sorted(os.listdir(ref["tmp"] / "R"))


def test_a_changed_model_that_keeps_every_shape_is_refused(ref, tmp_path):
    """The gate function, value_residual_last_k and the ResFormer lambda mode change the model's function but no
    tensor's shape, so the checkpoint would load: the resume check must refuse them, naming each."""
    new = tmp_path / "new"
    log = train(*ref["base"], "--save", new, "--load", ref["tmp"] / "R", "--value-residual-gate", "sigmoid",
                "--value-residual-last-k", "2", "--resformer-lambdas", "fixed", expect=2)
    line = next(iter(_errors(log)), log[-2000:])
    for field in ("value_residual_gate 'relu' in the checkpoint, 'sigmoid' now",
                  "value_residual_last_k None in the checkpoint, 2 now",
                  "resformer_lambdas 'learned' in the checkpoint, 'fixed' now"):
        assert field in line, line
    assert "Traceback" not in log and not new.exists()
