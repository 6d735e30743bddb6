"""A sweep entry keeps its run (megatron_sat/sweep/pins.py): slurm/launch.sh's msat_train pins the run name at a
job's first start, and a config file or recipe edited before a requeue is refused (exit 2, one line naming what
changed) instead of starting a new run at step 0.

Tested on launch.sh itself, sourced by bash as the sbatch scripts source it, without Slurm: `srun` and `scontrol`
are shell functions that record the command (a requeue is Slurm's to make; what matters here is the name the
restarted script resolves, which it does before any srun). The Slurm tests (tests/test_slurm.py) run the same
script under a real Slurm, pins included, with unedited configs.

pins.py's functions at their edges, called directly (the tests named `test_check_pin_*` and `test_named_values_*`, a
fraction of a second; mutation testing's selection, docs/development.md): the pin written at the first start, the
same name continued, each kind of change refused with exactly its line, an unreadable pin refused.
"""

import argparse
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

import pytest

from megatron_sat.sweep.pins import PinMismatch, check_pin, named_values

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _msat_train(tmp_path, pin_env: dict, *args) -> subprocess.CompletedProcess:
    """One start of a job: slurm/launch.sh's msat_train RECIPE FLAGS in a batch shell of job 7 (array task 7_0 when
    MSAT_PIN is given, as array.sbatch sets it), srun and scontrol recorded into srun.txt."""
    script = "\n".join([
        f"source {shlex.quote(os.path.join(ROOT, 'slurm', 'launch.sh'))}",
        "srun() { echo \"srun $*\" >> srun.txt; }",
        "scontrol() { echo \"scontrol $*\" >> srun.txt; }",
        f"MSAT_REPO={shlex.quote(ROOT)} MSAT_PYTHON={shlex.quote(sys.executable)} MSAT_RUNS=runs",
        "MSAT_SRUN_CONTAINER=() MSAT_EXEC=() MSAT_SRUN_EXTRA= MSAT_MAX_RESTARTS=3 MSAT_DATA_PATH= MSAT_TOKENIZER=",
        "MSAT_WANDB_PROJECT= MSAT_SIGNAL= MSAT_STEP_PID=",
        "msat_train " + " ".join(shlex.quote(str(a)) for a in args),
    ])
    env = dict(os.environ, SLURM_JOB_ID="7", SLURM_RESTART_COUNT="0", PYTHONPATH=ROOT, **pin_env)
    return subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def _run_of(proc) -> str:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("megatron-sat slurm: run ")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    return lines[0].split()[3]


def test_a_requeued_job_keeps_its_run_and_refuses_an_edited_config(tmp_path):
    """A plain job (train.sbatch: pinned by job id) with --config exp.yaml: restarted unchanged, it continues its
    run; exp.yaml edited (train-iters and lr), it is refused with one line naming both values, exit 2, srun never
    called and the pin untouched; restored, it continues; the pin removed, the edited config is a new run."""
    (tmp_path / "exp.yaml").write_text("train-iters: 30\n")
    first = _msat_train(tmp_path, {}, "debug_transformer", "--config", "exp.yaml")
    assert first.returncode == 0, first.stdout + first.stderr
    run = _run_of(first)
    pin = tmp_path / "runs" / "_grid" / "pins" / "job_7.json"
    assert json.loads(pin.read_text())["run"] == os.path.basename(run) and "_it30_" in run
    again = _msat_train(tmp_path, {}, "debug_transformer", "--config", "exp.yaml")
    assert again.returncode == 0 and _run_of(again) == run

    (tmp_path / "exp.yaml").write_text("train-iters: 40\nlr: 0.004\n")
    calls = (tmp_path / "srun.txt").read_text()
    before = pin.read_text()
    edited = _msat_train(tmp_path, {}, "debug_transformer", "--config", "exp.yaml")
    assert edited.returncode == 2, edited.stdout + edited.stderr
    err = edited.stderr.strip().splitlines()
    assert len(err) == 1, edited.stderr
    assert f"the configuration of run {os.path.basename(run)} changed since job 7 started it" in err[0], err
    assert "--lr 0.004 (the run's: 0.003)" in err[0] and "--train-iters 40 (the run's: 30)" in err[0], err
    assert f"remove {pin.relative_to(tmp_path)}" in err[0], err
    assert (tmp_path / "srun.txt").read_text() == calls and pin.read_text() == before  # nothing started or written

    (tmp_path / "exp.yaml").write_text("train-iters: 30\n")  # restored: the run goes on
    assert _run_of(_msat_train(tmp_path, {}, "debug_transformer", "--config", "exp.yaml")) == run
    (tmp_path / "exp.yaml").write_text("train-iters: 40\n")
    pin.unlink()  # the user's explicit choice: the edited config as a new run, the old one left as it is
    new = _run_of(_msat_train(tmp_path, {}, "debug_transformer", "--config", "exp.yaml"))
    assert new != run and "_it40_" in new


def test_an_array_task_keeps_its_run_when_its_recipe_is_edited(tmp_path):
    """An array task (array.sbatch's MSAT_PIN, per manifest line: shared by its requeues and a resubmission) on an
    external recipe file: the recipe edited between two starts is refused, one line naming the value."""
    recipe = tmp_path / "mine.py"
    recipe.write_text("import recipes\n\ndef small():\n    return dict(recipes.get('debug_transformer'), seed=5)\n")
    pin = tmp_path / "runs" / "_grid" / "m.txt.pins" / "task_0.json"
    env = dict(MSAT_PIN=str(pin), SLURM_ARRAY_JOB_ID="7", SLURM_ARRAY_TASK_ID="0")
    first = _msat_train(tmp_path, env, f"{recipe}:small")
    assert first.returncode == 0, first.stdout + first.stderr
    assert json.loads(pin.read_text())["job"] == "7_0"
    recipe.write_text(recipe.read_text().replace("seed=5", "seed=6"))
    edited = _msat_train(tmp_path, env, f"{recipe}:small")
    assert edited.returncode == 2 and len(edited.stderr.strip().splitlines()) == 1, edited.stderr
    assert "changed since job 7_0 started it: --seed 6 (the run's: 5)" in edited.stderr, edited.stderr


def test_named_values_are_the_naming_dests_json_plain_in_order():
    """Every dest but the unnamed ones, sorted, as JSON reads them back: a tuple as a list, an object by its repr."""
    args = argparse.Namespace(seed=5, lr=0.003, save="/runs/a", data_path=("a", "b"), dtype=pathlib.PurePosixPath("x"),
                              mock=None)
    values = named_values(args, {"save", "mock"})
    assert list(values.items()) == [("data_path", ["a", "b"]), ("dtype", "PurePosixPath('x')"), ("lr", 0.003),
                                    ("seed", 5)]
    assert named_values(args, set()) == dict(values, mock=None, save="/runs/a")


def test_check_pin_writes_the_pin_at_the_first_start_and_continues_the_same_name(tmp_path, monkeypatch):
    """No pin: written (its folders made), the name returned; the same name later: returned, the pin untouched."""
    pin = tmp_path / "runs" / "_grid" / "pins" / "job_7.json"
    values = dict(lr=0.003, seed=5)
    assert check_pin(str(pin), "run_a", values, job="7") == "run_a"
    written = json.loads(pin.read_text())
    assert {k: written[k] for k in ("run", "job", "values")} == dict(run="run_a", job="7", values=values)
    time.strptime(written["pinned"], "%Y-%m-%dT%H:%M:%S%z")  # when the job first started, for whoever reads it
    before = pin.read_text()
    assert check_pin(str(pin), "run_a", dict(lr=0.004, seed=6), job="8") == "run_a"  # the name decides, not values
    assert pin.read_text() == before and sorted(os.listdir(pin.parent)) == ["job_7.json"]
    # a pin in a folder that exists already, and one named relative to the working folder
    assert check_pin(str(tmp_path / "p.json"), "run_b", {}) == "run_b"
    assert json.loads((tmp_path / "p.json").read_text())["job"] is None
    monkeypatch.chdir(tmp_path)
    assert check_pin("q.json", "run_c", {}) == "run_c"
    assert json.loads((tmp_path / "q.json").read_text())["run"] == "run_c"


PIN = "P"  # the pin's path in a refusal line
# name: (the pin's run, job and values; the values now) -> the refusal line
PIN_REFUSED = [
    ("one value changed", dict(run="a", job="7", values=dict(lr=0.003, seed=5)), dict(lr=0.004, seed=5),
     "the configuration of run a changed since job 7 started it: --lr 0.004 (the run's: 0.003). Restore the config "
     "file or recipe to continue that run, or remove P to start the edited configuration as a new run (the "
     "half-trained one stays)"),
    ("two changed, sorted by name", dict(run="a", job="7_0", values=dict(train_iters=30, lr=0.003)),
     dict(train_iters=40, lr=0.004),
     "the configuration of run a changed since job 7_0 started it: --lr 0.004 (the run's: 0.003), --train-iters 40 "
     "(the run's: 30). Restore the config file or recipe to continue that run, or remove P to start the edited "
     "configuration as a new run (the half-trained one stays)"),
    ("a value added, one gone", dict(run="a", job="7", values=dict(seq_length=32)), dict(rope_base="1e4"),
     "the configuration of run a changed since job 7 started it: --rope-base '1e4' (the run's: None), --seq-length "
     "None (the run's: 32). Restore the config file or recipe to continue that run, or remove P to start the edited "
     "configuration as a new run (the half-trained one stays)"),
    ("the same values, another name; no job recorded", dict(run="a", job=None, values=dict(seed=5)), dict(seed=5),
     "the configuration of run a changed since job ? started it: its name b. Restore the config file or recipe to "
     "continue that run, or remove P to start the edited configuration as a new run (the half-trained one stays)"),
    ("a pin without values or job", dict(run="a"), dict(seed=5),
     "the configuration of run a changed since job ? started it: --seed 5 (the run's: None). Restore the config file "
     "or recipe to continue that run, or remove P to start the edited configuration as a new run (the half-trained "
     "one stays)"),
]


@pytest.mark.parametrize("name, pinned, values, line", PIN_REFUSED, ids=[row[0] for row in PIN_REFUSED])
def test_check_pin_refuses_another_name_with_its_line(tmp_path, monkeypatch, name, pinned, values, line):
    """Another name than the pinned one: PinMismatch (a ValueError: submit_grid's exit 2) with exactly its line,
    the pin left as it was."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / PIN).write_text(json.dumps(pinned))
    with pytest.raises(PinMismatch) as refused:
        check_pin(PIN, "b", values, job="8")
    assert str(refused.value) == line and isinstance(refused.value, ValueError)
    assert json.loads((tmp_path / PIN).read_text()) == pinned


@pytest.mark.parametrize("text, why", [("", "Expecting value: line 1 column 1 (char 0)"),
                                       ("{\"run\": ", "Expecting value: line 1 column 9 (char 8)"),
                                       ("not json", "Expecting value: line 1 column 1 (char 0)"),
                                       ("[]", "not a JSON object but list"), ("null", "not a JSON object but NoneType"),
                                       ("\"run_a\"", "not a JSON object but str")])
def test_check_pin_refuses_an_unreadable_pin(tmp_path, text, why):
    """A pin that does not parse or is no JSON object (edited by hand), or a folder in its place: ValueError naming it
    and the way on, not a new pin nor a traceback."""
    pin = tmp_path / "pin.json"
    pin.write_text(text)
    with pytest.raises(ValueError) as refused:
        check_pin(str(pin), "b", {})
    assert str(refused.value) == (f"the run pin {pin} is unreadable ({why}): remove it to let this job start the run "
                                  "its configuration names now")
    assert not isinstance(refused.value, PinMismatch) and pin.read_text() == text
    folder = tmp_path / "folder.json"
    folder.mkdir()
    with pytest.raises(ValueError, match=re.escape(f"the run pin {folder} is unreadable ([Errno 21] Is a directory")):
        check_pin(str(folder), "b", {})
