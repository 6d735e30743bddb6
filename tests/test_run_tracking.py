"""One wandb run and one TensorBoard history per run folder across preemptions (issue 26, items 1 and 2).

    .venv/bin/python -m pytest -q tests/test_run_tracking.py      # about 1 minute on 2 idle cores

A real trainer (debug_satformer, mock data, 16 steps, a save every 4), wandb offline and --tensorboard-dir,
preempted twice as Slurm does it (SIGUSR1 to the process group after a save: it saves and exits 0), resumed twice:
  * one wandb run: every offline-run-* folder has the id, name and group of the first start (config.json "wandb"),
    and over all of them every step 1..16 is logged once, with metrics.jsonl's values;
  * TensorBoard's own reader (EventAccumulator) sees every scalar once per step, with metrics.jsonl's values;
  * a run that starts over without a checkpoint gets a new wandb id; bad --tensorboard-dir input exits 2.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading

import pytest
import train_cli
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from train_cli import ROOT, latest, rows, start, wait_for
from wandb_records import offline_runs

from megatron_sat.training.arguments import parse_args
from megatron_sat.training.monitor import Monitor

pytestmark = pytest.mark.slow  # real trainer runs, preempted and resumed

FLAGS = ["--recipe", "debug_satformer", "--train-iters", "16", "--save-interval", "4", "--log-interval", "1",
         "--eval-interval", "8", "--no-progress-bar", "--wandb-project", "msat-test", "--wandb-mode", "offline"]


def _steps(folder):
    return max((r["step"] for r in rows(folder) if "loss" in r), default=0)


def _preempt_after_save(folder, tb, log_path, saved_at):
    """Start (or resume) the run, wait for the save at `saved_at` and one more step, SIGUSR1 to the group."""
    proc = start(*FLAGS, "--save", folder, "--load", folder, "--tensorboard-dir", tb, log_path=log_path)
    try:
        wait_for(lambda: latest(folder) == saved_at and _steps(folder) > saved_at, proc, f"the save at {saved_at}")
        os.killpg(proc.pid, signal.SIGUSR1)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = open(log_path).read()
    assert rc == 0 and "signal SIGUSR1" in log, log[-3000:]
    return log


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracking")
    folder, tb = str(tmp / "run"), str(tmp / "tb")
    os.environ["MSAT_SWEEP"] = "sweep-26"  # the trainer's group; the children inherit it
    try:
        logs = [_preempt_after_save(folder, tb, tmp / "w1.log", 4),
                _preempt_after_save(folder, tb, tmp / "w2.log", 8)]
        logs.append(train_cli.train(*FLAGS, "--save", folder, "--load", folder, "--tensorboard-dir", tb))
    finally:
        os.environ.pop("MSAT_SWEEP")
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return dict(tmp=tmp, folder=folder, tb=tb, logs=logs, config=config, rows=rows(folder))


def test_preempted_twice_is_one_wandb_run_with_every_step_once(run):
    config, recs = run["config"], run["rows"]
    assert len(config["attempts"]) == 3 and config["restarts"] == 2
    ident = config["wandb"]
    assert ident == {"id": ident["id"], "name": "run", "group": "sweep-26"} and len(ident["id"]) == 8, ident
    wandb_runs = offline_runs(run["folder"])
    assert len(wandb_runs) == 3, [r["path"] for r in wandb_runs]  # one offline folder per attempt ...
    assert {(r["id"], r["name"], r["group"]) for r in wandb_runs} == {(ident["id"], "run", "sweep-26")}  # ... one run
    steps = [h["_step"] for r in wandb_runs for h in r["history"]]
    assert sorted(steps) == list(range(1, 17)), steps  # every step once over the three attempts
    history = {h["_step"]: h for r in wandb_runs for h in r["history"]}
    train = {r["step"]: r for r in recs if "loss" in r}
    assert sorted(train) == list(range(1, 17))
    for step, r in train.items():
        assert history[step]["loss"] == r["loss"] and history[step]["lr"] == r["lr"], step
    assert {s: history[s]["val_loss"] for s in (8, 16)} == {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    assert "gate_mean/layer02" in history[16]
    assert [r["status"] for r in recs if r.get("event") == "end"] == ["stopped", "stopped", "complete"]
    assert f"wandb: offline run {ident['id']}" in run["logs"][2] and "resumed after step" in run["logs"][2]


def test_tensorboard_has_every_scalar_once_per_step(run):
    assert len([f for f in os.listdir(run["tb"]) if f.startswith("events.out.tfevents.")]) == 3
    acc = EventAccumulator(run["tb"], size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "val_ppl", "wall_time_s",
            "gate_mean/layer02", "gate_zero_frac/layer04"} <= set(tags), tags
    for tag in tags:
        steps = [e.step for e in acc.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)
    train = {r["step"]: r for r in run["rows"] if "loss" in r}
    loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert sorted(loss) == list(range(1, 17))
    assert all(loss[s] == pytest.approx(train[s]["loss"], rel=1e-6) for s in train)  # float32 in the event file
    assert [e.step for e in acc.Scalars("val_loss")] == [8, 16]
    assert sorted(e.step for e in acc.Scalars("wall_time_s")) == list(range(1, 17))


def test_purged_steps_and_a_new_start(run, tmp_path):
    """A resume from an older checkpoint (steps after it logged once already): TensorBoard drops the old ones
    (purge_step), wandb does not log them twice; a start without checkpoint gets a new wandb id."""
    folder, tb = tmp_path / "run", tmp_path / "tb"
    shutil.copytree(run["folder"], folder, ignore=shutil.ignore_patterns("wandb"))
    shutil.copytree(run["tb"], tb)
    with open(folder / "latest_checkpointed_iteration.txt", "w") as f:
        f.write("12")  # as if the saves at 16 had been lost: steps 13-16 run again
    shutil.rmtree(folder / "iter_0000016")
    out = train_cli.train(*FLAGS, "--save", folder, "--load", folder, "--tensorboard-dir", tb)
    assert "resumed after step 16" in out
    wandb_runs = offline_runs(folder)
    assert [h["_step"] for r in wandb_runs for h in r["history"]] == []  # 13..16 are in the run already
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
        steps = [e.step for e in acc.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)
    assert sorted(e.step for e in acc.Scalars("loss")) == list(range(1, 17))
    wall = {e.step: e.value for e in acc.Scalars("wall_time_s")}
    new = {r["step"]: r["wall_time_s"] for r in rows(folder) if "loss" in r}
    assert wall[16] == pytest.approx(new[16], rel=1e-6)  # the resumed value, not the purged one

    # a start without a checkpoint to resume (the run died before its first save) is a new wandb run
    args = parse_args([*FLAGS, "--wandb-mode", "disabled", "--save", str(tmp_path / "fresh")])
    ids = []
    for _ in range(2):
        Monitor(args, dict(vars(args), num_parameters=1000, vocab_size=256), 0, resumed=False, is_logger=True).close()
        ids.append(json.loads((tmp_path / "fresh" / "config.json").read_text())["wandb"]["id"])
    assert ids[0] != ids[1]


def _file(path, below=None):
    path.write_text("x")
    return path / below if below else path


def _immutable(folder):
    """Tests run as root, where chmod stops no write: chattr +i stops root too (skipped where it is refused)."""
    folder.mkdir()
    made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make a folder immutable here (chattr +i: {made.stderr.strip()})")
    return folder / "tb"


@pytest.mark.parametrize("make, message", [
    (lambda t: _file(t / "tb"), "is a file: give a folder"),
    (lambda t: _file(t / "f", "tb"), "f is a file): pass a --tensorboard-dir this job can write"),
    (lambda t: _immutable(t / "frozen"), "frozen cannot be written: a read-only file system"),
], ids=["a file", "below a file", "immutable parent"])
def test_bad_tensorboard_dir_exits_2(tmp_path, make, message):
    """A file, a folder below a file, a folder in an immutable one: one line, exit 2, before anything is written
    (the last two were a traceback after config.json and metrics.jsonl were written)."""
    bad = make(tmp_path)
    try:
        proc = subprocess.run([sys.executable, "-m", "megatron_sat.train", *FLAGS, "--save", tmp_path / "r",
                               "--tensorboard-dir", bad], cwd=ROOT, env=train_cli.env(), capture_output=True,
                              text=True, timeout=300)
    finally:
        if (tmp_path / "frozen").exists():
            subprocess.run(["chattr", "-i", str(tmp_path / "frozen")], check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "r").exists()


# the trainer under a socket audit: every connect and name lookup made by its Python process (wandb's own service
# runs in another process; gloo connects from C++), written to $AUDIT_OUT at exit
_AUDITED_TRAIN = """
import json, os, runpy, sys
seen = []
sys.addaudithook(lambda event, args: seen.append([event, repr(args[1] if event == "socket.connect" else args[0])])
                 if event in ("socket.connect", "socket.getaddrinfo") else None)
sys.argv = ["megatron_sat.train", *sys.argv[1:]]
try:
    runpy.run_module("megatron_sat.train", run_name="__main__", alter_sys=True)
finally:
    json.dump(seen, open(os.environ["AUDIT_OUT"], "w"))
"""


def test_wandb_server_that_does_not_answer_means_offline_with_one_warning(tmp_path):
    """WANDB_MODE unset, no --wandb-mode, a wandb server (WANDB_BASE_URL, 127.0.0.1) that accepts connections and
    never answers: wandb.init fails after its own init_timeout, the trainer warns once (what failed, how to sync)
    and trains with wandb offline; its Python process opens no socket to anything but this machine and never looks
    up the public wandb host (the socket probe it used to make)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held = []
    threading.Thread(target=lambda: [held.append(server.accept()) for _ in iter(int, 1)], daemon=True).start()
    env = {k: v for k, v in train_cli.env().items() if not k.startswith("WANDB_")}
    env.update(WANDB_BASE_URL=f"http://127.0.0.1:{server.getsockname()[1]}", WANDB_API_KEY="0" * 40,
               WANDB_INIT_TIMEOUT="5", AUDIT_OUT=str(tmp_path / "audit.json"))
    folder = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _AUDITED_TRAIN, "--recipe", "debug_satformer", "--train-iters", "3",
                           "--log-interval", "1", "--no-progress-bar", "--wandb-project", "msat-test", "--save",
                           str(folder)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    warnings = [line for line in out.splitlines() if "wandb did not start online" in line]
    assert len(warnings) == 1, out[-4000:]
    assert f"wandb sync {folder}/wandb/offline-run-*" in warnings[0] and "Error" in warnings[0], warnings[0]
    assert held, "wandb never tried the server"
    ident = json.loads((folder / "config.json").read_text())["wandb"]["id"]
    (offline,) = offline_runs(str(folder))
    assert offline["id"] == ident and [h["_step"] for h in offline["history"]] == [1, 2, 3]
    seen = json.load(open(tmp_path / "audit.json"))
    assert not [e for e in seen if "wandb.ai" in e[1]], seen
    for event, addr in seen:
        if event == "socket.connect" and addr.startswith("("):
            assert addr.startswith(("('127.0.0.1'", "('localhost'", "('::1'")), (event, addr)


def test_a_torn_config_keeps_the_wandb_run(run, tmp_path, capsys):
    """config.json cut short (set aside on resume): the wandb id is recovered from RUN/wandb, else from the
    set-aside text, and the warning says so; with neither, the warning says that a new wandb run starts."""
    want = run["config"]["wandb"]["id"]
    args = parse_args([*FLAGS, "--wandb-mode", "disabled", "--save", str(tmp_path / "x")])

    def resume(folder):
        args.save = str(folder)
        Monitor(args, dict(vars(args), num_parameters=1000, vocab_size=256), 16, resumed=True, is_logger=True).close()
        return json.loads((folder / "config.json").read_text())["wandb"]["id"], capsys.readouterr().out

    def tear(folder, keep):
        text = (folder / "config.json").read_text()
        (folder / "config.json").write_text(text[:keep(text)])

    with_wandb = tmp_path / "with_wandb"
    shutil.copytree(run["folder"], with_wandb)
    tear(with_wandb, lambda text: len(text) // 3)  # the id is cut off
    got, out = resume(with_wandb)
    assert got == want and f"kept {want} (found in {with_wandb / 'wandb'}" in out, out

    text_only = tmp_path / "text_only"
    shutil.copytree(run["folder"], text_only, ignore=shutil.ignore_patterns("wandb"))
    tear(text_only, lambda text: len(text) - 3)  # the id is in the torn text
    got, out = resume(text_only)
    assert got == want and "config.json.torn-" in out.split(f"kept {want} (found in ")[1], out

    neither = tmp_path / "neither"
    shutil.copytree(run["folder"], neither, ignore=shutil.ignore_patterns("wandb"))
    tear(neither, lambda text: 10)
    got, out = resume(neither)
    assert got != want and f"this start logs to a new wandb run {got}" in out, out
