"""A sweep entry keeps its run (megatron_sat/sweep/pins.py): slurm/launch.sh's msat_train pins the run name at a
job's first start, and a config file or recipe edited before a requeue is refused (exit 2, one line naming what
changed) instead of starting a new run at step 0.

Tested on launch.sh itself, sourced by bash as the sbatch scripts source it, without Slurm: `srun` and `scontrol`
are shell functions that record the command (a requeue is Slurm's to make; what matters here is the name the
restarted script resolves, which it does before any srun). The Slurm tests (tests/test_slurm.py) run the same
script under a real Slurm, pins included, with unedited configs.
"""

import json
import os
import shlex
import subprocess
import sys

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
