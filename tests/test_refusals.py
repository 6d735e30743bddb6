"""Every argument check in one place (training/argument_checks.py), reported together as one short line, exit 2,
nothing written: the trainer's parse_args (argparse's own errors among them: an unrecognized flag, a bad value, a
misspelled --config key), --print-config, plan-layout and the dry run.

    .venv/bin/python -m pytest -q tests/test_refusals.py        # a few seconds
"""

import os

import pytest

from megatron_sat.training.argument_checks import problems
from megatron_sat.training.arguments import parse_args

SHAPE = ["--arch", "satformer", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--train-iters", "2", "--global-batch-size", "2"]
TINY = [*SHAPE, "--mock-data", "--vocab-size", "64"]
CLASH = ["--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"]


def refused(argv, capsys) -> list:
    """The problems of a refusal: exit 2, one line on stderr, nothing on stdout."""
    with pytest.raises(SystemExit) as e:
        parse_args([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "", (e.value.code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron-sat-train: error: "), err
    assert "usage:" not in err
    return problems(lines[0])


def test_two_problems_one_line_nothing_written(tmp_path, capsys):
    """An unrecognized flag (argparse's own error) and a clash of two flags: both, in one line; no run folder."""
    save = tmp_path / "run"
    found = refused([*TINY, "--save", save, "--no-such-flag", "--grad-reduce-in-bf16",
                     "--accumulate-allreduce-grads-in-fp32"], capsys)
    assert len(found) == 2, found
    assert found[0].startswith("unrecognized arguments: --no-such-flag")
    assert "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict" in found[1]
    assert not os.path.exists(save)


def test_one_problem_is_one_line(tmp_path, capsys):
    found = refused([*TINY, "--save", tmp_path / "run", "--fp16", "--bf16"], capsys)
    assert found == ["--fp16 and --bf16 contradict: give one"]
    assert not os.path.exists(tmp_path / "run")


def test_a_bad_value_is_one_line(capsys):
    found = refused([*TINY, "--hidden-size", "wide"], capsys)
    assert len(found) == 1 and "--hidden-size" in found[0] and "invalid int value: 'wide'" in found[0]


def test_a_misspelled_config_key_is_one_line(tmp_path, capsys):
    config = tmp_path / "exp.yaml"
    config.write_text("hiden-size: 64\n")
    found = refused([*TINY, "--config", config], capsys)
    assert len(found) == 1 and "unknown argument(s) hiden-size" in found[0]


def test_megatron_lm_flags_two_conflicts_in_one_run(tmp_path, capsys):
    """A Megatron-LM command line with two problems gets both (it got one per run)."""
    found = refused([*TINY, "--save", tmp_path / "run", "--normalization", "LayerNorm", "--hidden-dropout", "0.1"],
                    capsys)
    assert len(found) == 2 and found[0].startswith("--normalization LayerNorm conflicts") \
        and found[1].startswith("--hidden-dropout 0.1 conflicts"), found


def test_print_config_sees_the_clash(capsys):
    """--print-config runs the value checks (not the disk's): the clash is refused, no config printed."""
    found = refused([*TINY, "--print-config", *CLASH], capsys)
    assert found == ["--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict: give one"]
    with pytest.raises(SystemExit) as e:  # nothing on disk is checked: a missing dataset still prints
        parse_args([*SHAPE, "--data-path", "missing/prefix", "--print-config"])
    assert e.value.code == 0 and "data_path:" in capsys.readouterr().out


def test_help_keeps_the_usage(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: megatron-sat-train")


def test_plan_layout_and_dry_run_see_the_clash():
    """The planner (plan-layout, submit-grid) and the dry run check the arguments as the trainer does; the dry run
    refuses before it builds anything (usage_error: its tool exits 2)."""
    from megatron_sat.profiling.dry_run import dry_run_recipe
    from megatron_sat.training.planner import plan_recipe

    flags = ["--grad-reduce-in-bf16", "--no-bf16"]
    plan = plan_recipe("debug_satformer", flags)
    assert not plan.ok and any("--grad-reduce-in-bf16 needs --bf16" in e for e in plan.errors), plan.errors
    assert plan_recipe("debug_satformer", ["--grad-reduce-in-bf16", "--bf16"]).ok
    report = dry_run_recipe("debug_satformer", [*CLASH, "--fp16", "--bf16"])
    assert report.usage_error and not report.roles and report.layout == "?"
    assert report.failure == ("--fp16 and --bf16 contradict: give one; --grad-reduce-in-bf16 and "
                              "--accumulate-allreduce-grads-in-fp32 contradict: give one"), report.failure


def test_evaluate_refusals_are_one_line(tmp_path, capsys):
    """tools/evaluate.py's own form (analysis/evaluate_command.py): every problem at once, one line, exit 2, no
    output folder made."""
    from megatron_sat.analysis.evaluate_command import parse

    with pytest.raises(SystemExit) as e:
        parse(["--checkpoint", str(tmp_path / "none"), "--tasks", "x", "--tensor-model-parallel-size", "2",
               "--output", str(tmp_path / "out")], world=1)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "usage:" not in err, err
    found = problems(err)
    assert len(found) == 2 and "is not a folder" in found[0] and "needs exactly that many processes" in found[1]
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(SystemExit) as e:  # argparse's own errors: one line too
        parse(["--tasks", "x"], world=1)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == "megatron-sat-evaluate: error: one of the arguments --model --checkpoint is " \
                                        "required"
