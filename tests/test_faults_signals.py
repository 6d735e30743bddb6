"""Faults, part 2, tested like features: Ctrl-C, preemption signals to a launcher's group, a changed LR schedule on
resume, data edge cases, and a hung rank. Real trainer processes, torchrun and megatron_sat.torchrun throughout.

  helper: the checkpoint writer's results server (a Manager) gives back what was put and never loads torch
  R   debug_satformer on mock data, 16 steps, checkpoint every 4: the reference losses
  I   SIGINT to the group during the save at 4 (held 2 s)  -> that save completes, step 5 saves, exit 0
      -> resumed, two SIGINTs in training                   -> stops at once, exit 130, one line naming what was kept,
                                                               no helper process left
      -> resumed to the end: R's 16 losses exactly
  schedule: --lr changed on resume without a flag (exit 2, one line), with --override-opt_param-scheduler (the new
      cosine from the resumed step; tests/workers/schedule_resume.py: Adam moments kept bit for bit, plain and
      distributed optimizer), a longer --train-iters (the checkpoint's decay length kept, said), an HF import
      resumed with a recipe's other lr values
  data: an empty .bin, a NaN blend weight, one long document under the default split: exit 2, no traceback
  launchers: USR1 to megatron_sat.torchrun's group, TP2 x PP2 (every rank saves, exit 0, no rank outlives it);
      USR1 to plain torchrun's group (it dies of the signal; its ranks save and exit on their parent-death signal)
  hang: one rank of a DP2 job SIGSTOPped -> the watchdog names it within --hang-timeout-minutes, exit 75, nothing
      left running; the rerun resumes and repeats the first attempt's losses exactly; with the process groups'
      timeout below the watchdog's, the timed-out collective ends the same way (report, marker, exit 75)
  suspension: the whole DP2 job SIGSTOPped for 2x the hang timeout, then SIGCONT -> one line with its length, no exit,
      the losses of an unsuspended run exactly; a rank left stopped after a second suspension -> named, exit 75
(Slurm's srun launch, USR1 then requeue: tests/test_slurm.py::test_preempted_job_requeues_and_resumes.)
"""

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from small_disk import small_tmpfs
from train_cli import ROOT, env, free_port, latest, metrics, rows, start, train, wait_for

from megatron_sat.data import preprocess, train_bpe_tokenizer
from megatron_sat.data.checks import check_dataset, split_errors
from megatron_sat.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # fault suite: real trainer processes under signals

BASE = ["--recipe", "debug_satformer", "--train-iters", "16", "--save-interval", "4", "--log-interval", "1",
        "--eval-interval", "8", "--no-progress-bar"]
RECIPE_LR, RECIPE_MIN_LR, WARMUP = 3e-3, 3e-4, 2  # debug_satformer's schedule


def _steps(folder):
    return max((r["step"] for r in rows(folder) if "loss" in r), default=0)


def _log(path):
    with open(path) as f:
        return f.read()


def _descendants(pid):
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(pids, wait_s=15.0):
    """The pids still running (not zombies) after up to wait_s seconds."""
    deadline = time.time() + wait_s
    while True:
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not left or time.time() > deadline:
            return left
        time.sleep(0.1)


def _cosine(step, max_lr, min_lr, decay, warmup=WARMUP):
    """Megatron's warmup + cosine LR used at `step` (the scheduler has stepped step - 1 times)."""
    n = step - 1
    if n < warmup:
        return max_lr * n / warmup
    ratio = min(1.0, (n - warmup) / (decay - warmup))
    return min_lr + (max_lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults-signals")
    out = {"tmp": tmp}
    out["R"] = train(*BASE, "--save", tmp / "R")

    i = str(tmp / "I")
    proc = start(*BASE, "--save", i, "--load", i, "--debug-save-delay", "2", log_path=tmp / "I1.log")
    try:
        wait_for(lambda: "debug: holding the save of iteration 4" in _log(tmp / "I1.log"), proc, "the save at 4")
        os.killpg(proc.pid, signal.SIGINT)
        out["I1_rc"] = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out["I1"], out["I1_stop"] = _log(tmp / "I1.log"), latest(i)

    proc = start(*BASE, "--save", i, "--load", i, log_path=tmp / "I2.log")
    try:
        wait_for(lambda: _steps(i) >= out["I1_stop"] + 2 and "resumed from" in _log(tmp / "I2.log"), proc,
                 "two more steps")
        out["I2_children"] = _descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        # the second once the first is taken (two signals before Python's handler runs would count as one)
        wait_for(lambda: "saving at the end of this step" in _log(tmp / "I2.log"), proc, "the first SIGINT")
        os.killpg(proc.pid, signal.SIGINT)
        out["I2_rc"] = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out["I2"], out["I2_stop"] = _log(tmp / "I2.log"), latest(i)
    out["I2_left"] = _alive(out["I2_children"])
    out["I3"] = train(*BASE, "--save", i, "--load", i)
    return out


WRITE_RESULTS = """
import json
from megatron.core.dist_checkpointing.strategies import filesystem_async
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from megatron_sat.training import signals

signals.install_write_results_queue()
queue = filesystem_async._results_queue
result = {0: [WriteResult(index=MetadataIndex("w"), size_in_bytes=3, storage_data=None)]}
queue.put(result)
queue.put(OSError(28, "No space left on device"))  # a writer's failure travels the same way
back, error = queue.get_nowait(), queue.get_nowait()
maps = lambda pid: open(f"/proc/{pid}/maps").read()  # noqa: E731
print(json.dumps({"same": back == result, "error": repr(error), "torch_here": "libtorch" in maps("self"),
                  "torch_in_server": "libtorch" in maps(signals._manager._process.pid)}))
"""


def test_the_write_results_server_holds_bytes_and_imports_neither_torch_nor_megatron_core():
    """signals.install_write_results_queue: Megatron-Core's write results (and a writer's exception) come back as put,
    while the Manager server never loads torch (so neither megatron-core): it imports signals.py alone and holds
    the results pickled. It used to import both, seconds of every rank's start and again at its first save."""
    out = subprocess.run([sys.executable, "-c", WRITE_RESULTS], capture_output=True, text=True, timeout=300,
                         env=env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"same": True, "error": "OSError(28, 'No space left on device')", "torch_here": True,
                    "torch_in_server": False}, seen


def test_sigint_once_during_a_save_and_twice_in_training(runs):
    assert runs["I1_rc"] == 0 and runs["I1_stop"] == 5, runs["I1"][-3000:]  # the held save, then step 5's
    assert "signal SIGINT" in runs["I1"] and "saving at the end of this step" in runs["I1"]
    for name in ("I1", "I2"):
        assert "Traceback" not in runs[name] and "KeyboardInterrupt" not in runs[name], runs[name][-3000:]
    assert runs["I2_rc"] == 130, runs["I2"][-3000:]
    lines = [line for line in runs["I2"].splitlines() if "second SIGINT" in line]
    assert len(lines) == 1, runs["I2"][-3000:]
    stop = runs["I2_stop"]
    assert f"kept: {runs['tmp'] / 'I'}/iter_{stop:07d} (iteration {stop}); resume with --load" in lines[0], lines
    assert stop >= 5
    assert not runs["I2_left"], f"processes outlived the trainer: {runs['I2_left']}"
    ref, ref_val = metrics(runs["tmp"] / "R")
    got, val = metrics(runs["tmp"] / "I")
    assert sorted(got) == list(range(1, 17))
    assert all(got[s]["loss"] == ref[s]["loss"] for s in got) and val == ref_val
    assert latest(runs["tmp"] / "I") == 16


def test_lr_changed_on_resume(runs, tmp_path):
    r = runs["tmp"] / "R"
    changed = ["--lr", "1e-2", "--min-lr", "1e-3"]
    log = train(*BASE, "--save", tmp_path / "a", "--load", r, "--ckpt-step", "8", *changed, expect=2)
    lines = [line for line in log.splitlines() if "error:" in line]
    assert len(lines) == 1 and "--lr 0.01 (checkpoint: 0.003)" in lines[0], log[-3000:]
    assert "--override-opt_param-scheduler" in lines[0] and "--use-checkpoint-opt_param-scheduler" in lines[0]
    assert "Traceback" not in log and "Could not find parameter group" not in log
    log = train(*BASE, "--save", tmp_path / "b", "--load", r, "--ckpt-step", "8", *changed,
                "--override-opt_param-scheduler")
    assert "LR schedule: this command's from iteration 8 on" in log, log[-3000:]
    got, _ = metrics(tmp_path / "b")
    ref, _ = metrics(r)
    assert sorted(got) == list(range(9, 17))
    for step in got:  # the new schedule, as if it had run from step 0, from the resumed step on
        assert got[step]["lr"] == pytest.approx(_cosine(step, 1e-2, 1e-3, 16), rel=1e-12), step
    assert got[9]["loss"] == ref[9]["loss"]  # the weights resumed exactly (step 9's loss precedes its update)
    assert got[10]["loss"] != ref[10]["loss"]  # and step 9's update used the new LR
    # the checkpoint's schedule kept: config.json records the LR the run follows, not the command's
    log = train(*BASE, "--save", tmp_path / "c", "--load", r, "--ckpt-step", "8", *changed,
                "--use-checkpoint-opt_param-scheduler")
    got, _ = metrics(tmp_path / "c")
    assert all(got[s]["lr"] == ref[s]["lr"] for s in got), log[-3000:]
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    assert config["lr_schedule_from"] == "checkpoint", config
    assert [config["lr"], config["min_lr"]] == pytest.approx([RECIPE_LR, RECIPE_MIN_LR], rel=1e-12)  # 0.1 x 3e-3
    assert json.loads((tmp_path / "b" / "config.json").read_text())["lr"] == 1e-2
    # the Adam moments and step counts, bit for bit (one process, plain and distributed optimizer)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "workers", "schedule_resume.py"),
                           str(tmp_path / "w")], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "plain optimizer: " in proc.stdout and "distributed optimizer: " in proc.stdout, proc.stdout
    # a finished run resumed with a longer --train-iters: the decay length it was saved with is kept, and said
    d = tmp_path / "longer"
    shutil.copytree(r, d)
    log = train(*BASE[:2], "--train-iters", "18", *BASE[4:], "--save", d, "--load", d)
    assert "the checkpoint's decay over 16 iterations is kept" in log and "--override-opt_param-scheduler" in log
    got, _ = metrics(d)
    assert [got[s]["lr"] for s in (17, 18)] == pytest.approx([RECIPE_MIN_LR] * 2, rel=1e-12)
    assert json.loads((d / "config.json").read_text())["lr_decay_iters"] == 16


def test_use_checkpoint_schedule_ignores_the_commands_lr_values(runs, tmp_path):
    """--use-checkpoint-opt_param-scheduler with other --lr / --min-lr / --lr-warmup-iters on the command line: the
    resumed run follows the checkpoint's schedule, so steps 9-16 have R's learning rates and R's losses exactly."""
    r = runs["tmp"] / "R"
    log = train(*BASE, "--save", tmp_path / "c", "--load", r, "--ckpt-step", "8", "--lr", "1e-2", "--min-lr", "1e-3",
                "--lr-warmup-iters", "4", "--use-checkpoint-opt_param-scheduler")
    assert "LR schedule: the checkpoint's (--use-checkpoint-opt_param-scheduler; ignored: --lr 0.01 (checkpoint: " \
           "0.003), --min-lr 0.001 (checkpoint: 0.0003), --lr-warmup-iters 4 (checkpoint: 2))" in log, log[-3000:]
    got, _ = metrics(tmp_path / "c")
    ref, _ = metrics(r)
    assert sorted(got) == list(range(9, 17))
    for step in got:
        assert got[step]["lr"] == pytest.approx(_cosine(step, RECIPE_LR, RECIPE_MIN_LR, 16), rel=1e-12), step
        assert (got[step]["lr"], got[step]["loss"]) == (ref[step]["lr"], ref[step]["loss"]), step


def test_an_import_resumes_under_a_recipe_with_other_lr_values(runs, tmp_path):
    def tool(*argv):
        proc = subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, env=env(), capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    tool("tools/convert_to_hf.py", "--load", runs["tmp"] / "R", "--output", tmp_path / "hf")
    tool("tools/convert_from_hf.py", "--hf", tmp_path / "hf", "--save", tmp_path / "imp")  # records lr 1e-3, min 0
    imp = tmp_path / "imp"
    log = train("--recipe", "debug_satformer", "--train-iters", "4", "--log-interval", "1", "--no-progress-bar",
                "--save", imp, "--load", imp)
    assert "the checkpoint at iteration 0 (an import)" in log and "--lr 0.003 (checkpoint: 0.001)" in log, log[-3000:]
    got, _ = metrics(imp)
    assert [got[s]["lr"] for s in range(1, 5)] == pytest.approx([_cosine(s, RECIPE_LR, RECIPE_MIN_LR, 4)
                                                                  for s in range(1, 5)], rel=1e-12, abs=0)


# ---------------------------------------------------------------------------------------------
# data edge cases
# ---------------------------------------------------------------------------------------------

def test_data_edge_cases_are_one_line_and_exit_2(tmp_path):
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    with open(tmp_path / "a.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"text": " ".join(words[(i + j) % 12] for j in range(3))}) + "\n")
    with open(tmp_path / "long.jsonl", "w") as f:
        f.write(json.dumps({"text": " ".join(words[(7 * j) % 12] for j in range(2000))}) + "\n")
    tok = train_bpe_tokenizer([str(tmp_path / "a.jsonl")], 300, str(tmp_path / "tok"))
    preprocess([str(tmp_path / "a.jsonl")], tok, str(tmp_path / "small_text_document"), progress=False)
    preprocess([str(tmp_path / "long.jsonl")], tok, str(tmp_path / "long_text_document"), progress=False)
    builder = IndexedDatasetBuilder(str(tmp_path / "zero_text_document.bin"), dtype=np.uint16)
    builder.finalize(str(tmp_path / "zero_text_document.idx"))  # 0 documents, an empty .bin
    run = ["--arch", "satformer", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
           "--seq-length", "16", "--train-iters", "2", "--no-progress-bar", "--tokenizer-model", tmp_path / "tok"]
    small, long_doc = tmp_path / "small_text_document", tmp_path / "long_text_document"
    for data, message in (([tmp_path / "zero_text_document"], "zero_text_document.bin is empty"),
                          (["nan", small, "1", long_doc], "blend weights must be finite numbers > 0, got nan 1"),
                          ([long_doc], "the valid split of")):
        log = train(*run, "--data-path", *data, "--save", tmp_path / "run", expect=2)
        assert "error:" in log and message in log, log[-3000:]
        assert "Traceback" not in log and "AttributeError" not in log and not (tmp_path / "run").exists()
    # the same dataset of one long document gives every split it is asked for a document under 100,0,0
    found = check_dataset(str(long_doc), load_tokenizer(str(tmp_path / "tok")))
    assert found["documents"] == 1 and found["tokens"] > 1000
    assert split_errors(str(long_doc), 1, [100, 0, 0], (1, 16, 0)) == []
    assert split_errors(str(long_doc), 1, [98, 2, 0], (1, 16, 0)) and not split_errors(str(long_doc), 1, [98, 2, 0],
                                                                                       (1, 0, 0))


def test_a_split_refusal_names_the_flags_that_give_that_split_data():
    (test,) = split_errors("P", 3, [98, 1, 1], (1, 0, 1))
    assert test.startswith("the test split of P") and "(--train-data-path TRAIN --test-data-path TEST)" in test
    (valid,) = split_errors("P", 3, [98, 1, 1], (1, 1, 0))
    assert "(--train-data-path TRAIN --valid-data-path VALID)" in valid


# ---------------------------------------------------------------------------------------------
# launchers: a preemption signal to the launcher's process group
# ---------------------------------------------------------------------------------------------

def _launch(launcher, nproc, folder, log_path, *extra):
    module = "megatron_sat.torchrun" if launcher == "megatron_sat.torchrun" else "torch.distributed.run"
    cmd = [sys.executable, "-m", module, f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           "-m", "megatron_sat.train", "--recipe", "debug_satformer", "--train-iters", "40", "--log-interval", "1",
           "--no-progress-bar", "--save", folder, "--load", folder, *map(str, extra)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _ranks(proc, n):
    """The launcher's worker processes (RANK in their environment), once all n are up."""
    deadline = time.time() + 120
    while time.time() < deadline:
        found = {}
        for child in psutil.Process(proc.pid).children():
            try:
                found[int(child.environ().get("RANK", "-1"))] = child
            except (psutil.Error, ValueError):
                pass
        if len(found) >= n:
            return found
        time.sleep(0.2)
    raise AssertionError("the launcher did not start its workers")


def test_usr1_to_the_launchers_group_saves_on_every_rank(tmp_path):
    tp2pp2 = tmp_path / "tp2pp2"
    proc = _launch("megatron_sat.torchrun", 4, tp2pp2, tmp_path / "a.log", "--tensor-model-parallel-size", "2",
                   "--pipeline-model-parallel-size", "2")
    try:
        wait_for(lambda: _steps(tp2pp2) >= 3, proc, "step 3")
        everything = _descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGUSR1)
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = _log(tmp_path / "a.log")
    assert rc == 0 and "every rank (4 here) stopped cleanly" in log, log[-4000:]
    stop = latest(tp2pp2)
    assert stop is not None and stop >= 3 and f"stopping at iteration {stop}/40 (signal SIGUSR1)" in log
    assert not _alive(everything, wait_s=0), "a process outlived megatron_sat.torchrun"

    # plain torchrun has no handler for USR1 and dies of it; its ranks, in sessions of their own, get SIGTERM
    # from their parent's death (PR_SET_PDEATHSIG), save and exit
    dp2 = tmp_path / "dp2"
    proc = _launch("torchrun", 2, dp2, tmp_path / "b.log")
    try:
        wait_for(lambda: _steps(dp2) >= 3, proc, "step 3")
        workers = [w.pid for w in _ranks(proc, 2).values()]
        everything = _descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGUSR1)
        rc = proc.wait(timeout=60)
        left = _alive(everything, wait_s=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in workers:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
    log = _log(tmp_path / "b.log")
    assert rc == -signal.SIGUSR1, log[-3000:]
    assert not left, f"ranks outlived plain torchrun by more than 120 s: {left}"
    stop = latest(dp2)
    assert stop is not None and stop >= 3 and "(signal SIGTERM)" in log, log[-3000:]


# ---------------------------------------------------------------------------------------------
# a hung rank
# ---------------------------------------------------------------------------------------------

HANG_TIMEOUT_MIN = 0.25  # 15 s without progress


def test_watchdog_heartbeat_period_off_switch_and_flag_bounds(tmp_path, capsys, monkeypatch):
    """docs/reliability_signals.md: the heartbeat is written every T/10, at least 0.2 s and at most 5 s (both edges
    one step either side); --hang-timeout-minutes 0 turns
    the watchdog off (>= 0 accepted, below refused); --distributed-timeout-minutes must be > 0; the flight recorder
    keeps 64 collectives (TORCH_FR_BUFFER_SIZE=64) unless that is set."""
    from megatron_sat.training.arguments import parse_args
    from megatron_sat.training.watchdog import FOLDER, Watchdog, enable_flight_recorder

    for timeout_s, period in ((0.5, 0.2), (1.9, 0.2), (2, 0.2), (2.1, 0.21), (15, 1.5), (49, 4.9), (50, 5.0),
                              (51, 5.0), (600, 5.0)):
        assert Watchdog(str(tmp_path), 0, 1, timeout_s).interval_s == pytest.approx(period), timeout_s
    off = Watchdog(str(tmp_path / "off"), 0, 1, 0).start()
    off.beat("step 1")
    off.close()
    assert not off.enabled and not (tmp_path / "off" / FOLDER).exists()  # off: no thread, nothing written
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    enable_flight_recorder()  # the flight recorder keeps the last 64 collectives unless TORCH_FR_BUFFER_SIZE is set
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "64"
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "8")
    enable_flight_recorder()
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "8"
    base = ["--recipe", "debug_satformer", "--save", str(tmp_path / "r")]
    assert parse_args([*base, "--hang-timeout-minutes", "0"]).hang_timeout_minutes == 0
    assert parse_args([*base, "--distributed-timeout-minutes", "0.01"]).distributed_timeout_minutes == 0.01
    for flags in (["--hang-timeout-minutes", "-0.01"], ["--distributed-timeout-minutes", "0"]):
        with pytest.raises(SystemExit) as e:
            parse_args([*base, *flags])
        assert e.value.code == 2 and "--distributed-timeout-minutes must be > 0 and --hang-timeout-minutes >= 0" in \
            capsys.readouterr().err, flags


def test_a_stopped_rank_is_named_after_the_timeout_and_within_one_heartbeat_more(tmp_path):
    """docs/status.md: a stopped rank is named "within the timeout (15 s + one heartbeat)": the watchdog fires no
    sooner than the timeout after the last progress and no later than one heartbeat (timeout / 10) after it. Timed
    at a 3 s timeout on two bare watchdog processes (tests/workers/watchdog_rank.py): rank 0 stops making
    progress as rank 1 is SIGSTOPped. One heartbeat late, whatever the load: the watchdog's look before the one that
    fired (its heartbeat's time, seen by polling it) was still within the timeout (broken by hand: a watchdog firing
    at 0.9 T, at T + 1 and at T + 2 heartbeats each fails)."""
    from megatron_sat.training.watchdog import Watchdog

    assert Watchdog(str(tmp_path), 0, 2, 60 * HANG_TIMEOUT_MIN).interval_s == 1.5  # the 15 s test's heartbeat
    timeout = 3.0
    heartbeat = Watchdog(str(tmp_path), 0, 2, timeout).interval_s
    assert heartbeat == pytest.approx(0.3)
    run = tmp_path / "run"
    run.mkdir()
    worker = os.path.join(ROOT, "tests", "workers", "watchdog_rank.py")
    procs = [subprocess.Popen([sys.executable, worker, str(run), str(r), "2", str(timeout)], cwd=ROOT, env=env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        wait_for(lambda: all((run / ".watchdog" / f"rank_{r}.json").exists() for r in (0, 1)), procs[0],
                 "both heartbeats")
        os.kill(procs[1].pid, signal.SIGSTOP)
        (run / "stop").touch()
        t_stop = time.time()
        looks = set()  # rank 0's watchdog writes its heartbeat at each look: the times of its looks, as seen
        while procs[0].poll() is None and time.time() < t_stop + 120:
            try:
                looks.add(json.loads((run / ".watchdog" / "rank_0.json").read_text())["written_at"])
            except (OSError, ValueError):
                pass
            time.sleep(0.005)
        out, _ = procs[0].communicate(timeout=120)
        took = time.time() - t_stop
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert procs[0].returncode == 75, out[-3000:]
    assert "rank 1 stopped responding" in out and "rank 1 (" in out and "NOT RESPONDING" in out, out[-3000:]
    last_beat = json.loads((run / ".watchdog" / "rank_0.json").read_text())  # written at the look that fired
    progress_at = last_beat["progress_at"]  # rank 0's last beat
    looks.add(last_beat["written_at"])
    fired = json.loads((run / ".watchdog" / "hang.json").read_text())
    detected = fired["time"] - progress_at
    print(f"named after {detected:.2f} s without progress (timeout {timeout} s, heartbeat {heartbeat} s); "
          f"the process ended {took:.2f} s after the stop")
    assert fired["stopped"] == [1]
    # 0.25 s for the watchdog thread's wake-up on a loaded machine (less than one more heartbeat: a watchdog that
    # waited two heartbeats past the timeout fails); the exit after the report (it imports torch) is not timed
    assert timeout < detected <= timeout + heartbeat + 0.25, detected
    # it fired at its first look past the timeout: the look before was within it. Free of the machine's load (a
    # look missed by this poll only moves the one seen earlier); a watchdog that waited a heartbeat more had, at
    # the look before, already seen more than the timeout without progress
    looks = sorted(looks)
    assert looks[-1] == fired["time"] and len(looks) >= 2, looks[-3:]
    assert looks[-2] - progress_at <= timeout, (looks[-2] - progress_at, detected)


def test_on_a_full_disk_the_report_says_so_and_the_killed_rank_prints_its_stacks(tmp_path):
    """The chaos run's full disk, once: no heartbeat could be written any more, so the watchdog of the rank that
    stopped making progress saw the other, alive, as NOT RESPONDING and killed it without a word of where it was. Two
    bare watchdog processes (tests/workers/watchdog_rank.py, 3 s timeout) on a tmpfs filled once both heartbeats are
    written: rank 0's report says its own heartbeat cannot be written (No space left on device), and that launch.sh
    will not requeue (no room for the marker), exit 75; rank 1, running, prints its Python stacks (STACKS_SIGNAL)
    before the SIGKILL."""
    with small_tmpfs(tmp_path / "small", 1 << 20) as mnt:
        run = mnt / "run"
        run.mkdir()
        worker = os.path.join(ROOT, "tests", "workers", "watchdog_rank.py")
        procs = [subprocess.Popen([sys.executable, worker, str(run), str(r), "2", "3"], cwd=ROOT, env=env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        try:
            wait_for(lambda: all((run / ".watchdog" / f"rank_{r}.json").exists() for r in (0, 1)), procs[0],
                     "both heartbeats")
            try:
                with open(mnt / "filler", "wb") as f:
                    while True:
                        f.write(b"\0" * 65536)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
            (run / "stop").touch()  # an inode, no page: still possible on the full tmpfs
            outs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    assert procs[0].returncode == 75, outs[0][-3000:]
    assert "rank 1 stopped responding" in outs[0] and "NOT RESPONDING" in outs[0], outs[0][-3000:]
    assert "rank 0's own heartbeat could not be written since" in outs[0], outs[0][-3000:]
    assert "(No space left on device): a rank shown NOT RESPONDING may be alive" in outs[0], outs[0][-3000:]
    assert "cannot write hang.json" in outs[0] and "slurm/launch.sh will not requeue this job" in outs[0], outs[0]
    assert procs[1].returncode == -signal.SIGKILL, outs[1][-3000:]
    assert "(most recent call first)" in outs[1] and 'watchdog_rank.py", line' in outs[1], outs[1][-3000:]


def test_a_collective_that_times_out_before_the_watchdog_is_reported_as_a_hang(tmp_path):
    """The other order (M < T, given by hand): rank 1 of a real two-process gloo group SIGSTOPped; rank 0's
    all-reduce times out after M = 2 s, long before the watchdog's T = 60 s, and ends as a hang does: the watchdog's
    report naming rank 1 and the timeout, the marker, exit 75 (tests/workers/watchdog_rank.py; the trainer's loop
    hands such an exception over the same way)."""
    run = tmp_path / "run"
    run.mkdir()
    worker = os.path.join(ROOT, "tests", "workers", "watchdog_rank.py")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, worker, str(run), str(r), "2", "60", "2", port], cwd=ROOT, env=env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        wait_for(lambda: all((run / ".watchdog" / f"rank_{r}.json").exists() for r in (0, 1)), procs[0],
                 "both heartbeats")
        time.sleep(3)  # a few heartbeats: rank 1's last one is then from before its stop
        os.kill(procs[1].pid, signal.SIGSTOP)
        t_stop = time.time()
        out, _ = procs[0].communicate(timeout=120)
        took = time.time() - t_stop
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert procs[0].returncode == 75, out[-3000:]
    assert "megatron-sat watchdog (rank 0): a collective timed out (--distributed-timeout-minutes 0.0333333" in out, \
        out[-3000:]
    assert "rank 1 stopped responding" in out and "NOT RESPONDING" in out and "last collectives: #" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]  # the report, not the exception's
    assert json.loads((run / ".watchdog" / "hang.json").read_text())["stopped"] == [1]
    assert took < 30, f"ended {took:.0f} s after the stop (M = 2 s, T = 60 s)"


def _stop_rank_1(run, log, flags, after_step: int):
    """A DP2 job under megatron_sat.torchrun whose rank 1 is SIGSTOPped once `after_step` steps are logged, waited for:
    (its exit code, seconds from the stop to its end, every process it had); nothing of it is left running."""
    proc = _launch("megatron_sat.torchrun", 2, run, log, *flags)
    ranks = {}
    try:
        wait_for(lambda: _steps(run) >= after_step, proc, f"step {after_step}")
        ranks = _ranks(proc, 2)
        everything = _descendants(proc.pid)
        os.kill(ranks[1].pid, signal.SIGSTOP)
        t_stop = time.time()
        rc = proc.wait(timeout=300)
        return rc, time.time() - t_stop, everything
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in ranks.values():
            if psutil.pid_exists(p.pid):
                p.kill()


def test_a_stopped_rank_is_detected_and_the_rerun_resumes_exactly(tmp_path):
    run = tmp_path / "run"
    flags = ["--save-interval", "5", "--hang-timeout-minutes", HANG_TIMEOUT_MIN, "--distributed-timeout-minutes", "5"]
    rc, took, everything = _stop_rank_1(run, tmp_path / "a.log", flags, after_step=8)
    log = _log(tmp_path / "a.log")
    assert rc == 75, log[-4000:]
    assert took < 60 * HANG_TIMEOUT_MIN + 20, f"detected after {took:.0f} s"
    assert "megatron-sat watchdog (rank 0): no progress for" in log and "rank 1 stopped responding" in log, log[-4000:]
    assert "NOT RESPONDING" in log and "most recent call first" in log and "last collectives: #" in log
    assert not _alive(everything), "a process outlived the hung job"
    assert os.path.isfile(run / ".watchdog" / "hang.json")
    # docs/status.md's "within the timeout (15 s + one heartbeat)", both sides, in the trainer: from rank 0's last
    # progress to the report; 1 s for the watchdog thread's wake-up on a loaded machine (less than a heartbeat, 1.5 s)
    fired = json.loads((run / ".watchdog" / "hang.json").read_text())
    detected = fired["time"] - json.loads((run / ".watchdog" / "rank_0.json").read_text())["progress_at"]
    print(f"named after {detected:.2f} s without progress (timeout {60 * HANG_TIMEOUT_MIN:g} s)")
    assert fired["rank"] == 0 and fired["stopped"] == [1], fired
    assert 60 * HANG_TIMEOUT_MIN < detected <= 60 * HANG_TIMEOUT_MIN * 1.1 + 1.0, detected
    first = {r["step"]: r["loss"] for r in rows(run) if "loss" in r}
    stop = latest(run)
    assert stop in (5, 10) and max(first) > stop, (stop, sorted(first))

    log = train("--recipe", "debug_satformer", "--train-iters", "16", "--log-interval", "1", "--no-progress-bar",
                "--save", run, "--load", run, *flags, nproc=2)
    assert f"iter_{stop:07d}" in log and "resumed from" in log, log[-3000:]
    again = {r["step"]: r["loss"] for r in rows(run) if "loss" in r}
    repeated = [s for s in first if s > stop]
    assert repeated and all(again[s] == first[s] for s in repeated), [(s, first[s], again[s]) for s in repeated]
    assert not (run / ".watchdog").exists()


def test_a_stopped_rank_whose_collective_times_out_first_ends_as_a_hang(tmp_path):
    """The trainer's side of the other order: --distributed-timeout-minutes 0.4 below --hang-timeout-minutes 1, rank 1
    of a DP2 job SIGSTOPped after step 3. Rank 0's gloo collective times out first (24 s); the loop hands it to the
    watchdog: its report names the timeout and rank 1, the marker is written, megatron_sat.torchrun exits 75
    (launch.sh requeues on both; the rerun resumes as in the test above: nothing is saved on either path)."""
    run = tmp_path / "run"
    flags = ["--save-interval", "100", "--hang-timeout-minutes", "1", "--distributed-timeout-minutes", "0.4"]
    rc, took, everything = _stop_rank_1(run, tmp_path / "a.log", flags, after_step=3)
    log = _log(tmp_path / "a.log")
    assert rc == 75, log[-4000:]
    assert "--hang-timeout-minutes 1 is above 0.8 x --distributed-timeout-minutes 0.4: a hung collective may time " \
        "out first" in log, log[-4000:]
    assert "megatron-sat watchdog (rank 0): a collective timed out (--distributed-timeout-minutes 0.4: " in log, \
        log[-4000:]
    assert "rank 1 stopped responding" in log and "NOT RESPONDING" in log, log[-4000:]
    assert json.loads((run / ".watchdog" / "hang.json").read_text())["stopped"] == [1]
    assert 24 <= took < 60, f"ended {took:.0f} s after the stop (M = 24 s, T = 60 s)"
    assert not _alive(everything), "a process outlived the hung job"


# ---------------------------------------------------------------------------------------------
# a suspended job (every process stopped and continued) is not a hung one
# ---------------------------------------------------------------------------------------------

def _signal_all(procs, sig):
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _save_running_for(run, iteration: int) -> float:
    """Seconds since rank 0 began the save of `iteration`, from its heartbeat (RUN/.watchdog/rank_0.json); -1 while
    its last heartbeat is elsewhere."""
    try:
        beat = json.loads((run / ".watchdog" / "rank_0.json").read_text())
    except (OSError, ValueError):
        return -1.0
    return time.time() - beat["progress_at"] if beat.get("where") == f"save of iteration {iteration}" else -1.0


def test_a_suspended_job_carries_on_and_a_rank_left_stopped_is_still_named(tmp_path):
    """The whole DP2 job (launcher and ranks) SIGSTOPped for 2x the hang timeout, then SIGCONT: no exit, one
    line naming the suspension and its length, and losses exactly those of an unsuspended run. Then a suspension
    of 0.8x the timeout 5 s into a slow save (8 s, --debug-save-delay): together longer than the timeout, each alone
    shorter, so only a watchdog that counted a suspension shorter than the timeout as lost progress would fire.
    Then a third suspension after which rank 1 stays stopped (a hang that starts in a suspension window): named and
    exit 75 within the timeout plus the margin of the stopped-rank test, counted from the others' SIGCONT."""
    timeout_s = 60 * HANG_TIMEOUT_MIN
    save_delay_s = 8
    flags = ["--train-iters", "16", "--save-interval", "8", "--hang-timeout-minutes", HANG_TIMEOUT_MIN,
             "--distributed-timeout-minutes", "5"]
    reference = tmp_path / "reference"
    train("--recipe", "debug_satformer", "--log-interval", "1", "--no-progress-bar", "--save", reference, *flags,
          nproc=2)
    want = {r["step"]: r["loss"] for r in rows(reference) if "loss" in r}

    run = tmp_path / "run"
    proc = _launch("megatron_sat.torchrun", 2, run, tmp_path / "a.log", *flags, "--debug-save-delay", save_delay_s)
    ranks = {}
    try:
        wait_for(lambda: _steps(run) >= 3, proc, "step 3")
        ranks = _ranks(proc, 2)
        job = [psutil.Process(proc.pid), *ranks.values()]
        _signal_all(job, signal.SIGSTOP)
        time.sleep(2 * timeout_s)  # the suspension: twice the hang timeout
        _signal_all(job, signal.SIGCONT)
        t_cont = time.time()
        wait_for(lambda: "was suspended for" in _log(tmp_path / "a.log") and _steps(run) >= 6, proc,
                 "the suspension's line and step 6")
        assert proc.poll() is None

        # 5 s into the slow save (its heartbeat: the log's line of it may reach the file only later), stopped for
        # 0.8 x the timeout: 17 s without progress, of which 5 s (and what is left of the save) count
        wait_for(lambda: _save_running_for(run, 8) >= 5, proc, "5 s of the slow save at 8")
        _signal_all(job, signal.SIGSTOP)
        time.sleep(0.8 * timeout_s)  # shorter than the timeout, after the save's first 5 s
        _signal_all(job, signal.SIGCONT)
        wait_for(lambda: _steps(run) >= 10, proc, "step 10, after the slow save")
        assert proc.poll() is None

        _signal_all(job, signal.SIGSTOP)
        time.sleep(timeout_s / 2)
        _signal_all([psutil.Process(proc.pid), ranks[0]], signal.SIGCONT)  # rank 1 stays stopped: a hang
        t_cont = time.time()
        rc = proc.wait(timeout=300)
        took = time.time() - t_cont
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in ranks.values():
            if psutil.pid_exists(p.pid):
                p.kill()
    log = _log(tmp_path / "a.log")
    lines = [line for line in log.splitlines() if "was suspended for" in line]
    assert lines, log[-4000:]
    gone = float(lines[0].split("was suspended for ")[1].split(" s")[0])
    assert 2 * timeout_s - 5 <= gone <= 2 * timeout_s + 30, lines[0]  # the length measured, load allowing
    in_save = [float(line.split("was suspended for ")[1].split(" s")[0]) for line in lines[1:]]
    assert any(0.8 * timeout_s - 5 <= g <= 0.8 * timeout_s + 30 for g in in_save), lines  # the one in the save
    assert rc == 75 and "rank 1 stopped responding" in log, log[-4000:]
    assert took < timeout_s + 20, f"the rank left stopped was named {took:.0f} s after the others continued"
    got = {r["step"]: r["loss"] for r in rows(run) if "loss" in r}
    assert max(got) >= 6 and all(got[s] == want[s] for s in got), [(s, got[s], want[s]) for s in sorted(got)]
