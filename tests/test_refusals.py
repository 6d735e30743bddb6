"""Every argument check in one place (training/argument_checks.py), reported together as one short line, exit 2,
nothing written: the trainer's parse_args (argparse's own errors among them: an unrecognized flag, a bad value, a
misspelled --config key), --print-config, plan-layout and the dry run.

    .venv/bin/python -m pytest -q tests/test_refusals.py        # a few seconds
"""

import argparse
import os

import pytest

from megatron_sat.training.argument_checks import (
    GPT2_TO_TOKENIZER_JSON,
    argument_errors,
    megatron_lm_errors,
    megatron_lm_flag_errors,
    problems,
    validate_args,
)
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


# Each Megatron-LM flag check (argument_checks.megatron_lm_flag_errors) at both sides of its edge: the value on the
# accepted side passes, one step over is refused with exactly its line. (name, {attribute: accepted value}, {attribute:
# refused value}, the refusal); on TINY (--arch satformer, --seq-length 32, --train-iters 2). Called directly: no launch.
CONFLICT = "conflicts with --arch satformer: {}; drop the flag (it describes the model)"
FLAG_EDGES = [
    ("normalization", dict(normalization="RMSNorm"), dict(normalization="LayerNorm"),
     "--normalization LayerNorm " + CONFLICT.format("every norm here is RMSNorm")),
    ("position embedding", dict(position_embedding_type="rope"), dict(position_embedding_type="learned_absolute"),
     "--position-embedding-type learned_absolute " + CONFLICT.format("every arch here uses RoPE")),
    ("rotary percent below 1", dict(rotary_percent=1.0), dict(rotary_percent=0.5),
     "--rotary-percent 0.5 " + CONFLICT.format("RoPE rotates the whole head here (1.0)")),
    ("rotary percent above 1", dict(rotary_percent=1.0), dict(rotary_percent=1.01),
     "--rotary-percent 1.01 " + CONFLICT.format("RoPE rotates the whole head here (1.0)")),
    ("position table", dict(max_position_embeddings=32), dict(max_position_embeddings=31),
     "--max-position-embeddings 31 is below --seq-length 32: give at least the sequence length"),
    ("kv channels", dict(kv_channels=1), dict(kv_channels=0), "--kv-channels must be >= 1 (got 0)"),
    ("norm epsilon", dict(layernorm_epsilon=1e-300), dict(layernorm_epsilon=0.0), "--norm-epsilon must be > 0 (got 0.0)"),
    ("attention dropout", dict(attention_dropout=0.0), dict(attention_dropout=1e-9),
     "--attention-dropout 1e-09 " + CONFLICT.format("the archs here train without dropout (0)")),
    ("hidden dropout", dict(hidden_dropout=0.0), dict(hidden_dropout=0.1),
     "--hidden-dropout 0.1 " + CONFLICT.format("the archs here train without dropout (0)")),
    ("layernorm 1p", dict(apply_layernorm_1p=True, weight_decay_params="matrices"),
     dict(apply_layernorm_1p=True, weight_decay_params="all"),
     "--apply-layernorm-1p with --weight-decay-params all would decay norm weights towards 1, which the norms here "
     "do not: use --weight-decay-params matrices (norms undecayed), where it is a no-op"),
    ("init std", dict(init_method_std=1e-300), dict(init_method_std=0.0), "--init-method-std must be > 0 (got 0.0)"),
    ("workers", dict(num_workers=0), dict(num_workers=-1), "--num-workers and --manual-gc-interval must be >= 0"),
    ("gc interval", dict(manual_gc_interval=0), dict(manual_gc_interval=-1),
     "--num-workers and --manual-gc-interval must be >= 0"),
    ("param gather", dict(overlap_param_gather=True, use_distributed_optimizer=None),
     dict(overlap_param_gather=True, use_distributed_optimizer=False),
     "--overlap-param-gather needs the distributed optimizer: drop --no-use-distributed-optimizer"),
    ("decoupled min lr", dict(decoupled_min_lr=1e-5, decoupled_lr=1e-4), dict(decoupled_min_lr=0.0),
     "--decoupled-min-lr needs --decoupled-lr"),
    ("merge file", dict(merge_file=None, vocab_file=None), dict(merge_file="merges.txt"),
     "--vocab-file/--merge-file (GPT2BPETokenizer) are not read here: save them as one tokenizers file, "
     f"{GPT2_TO_TOKENIZER_JSON}, and pass --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json "
     "(the data must have been made with that tokenizer)"),  # the one-liner is run as typed: test_docs_commands
    ("decoupled lr", dict(decoupled_lr=1e-4, weight_decay_params="matrices"),
     dict(decoupled_lr=1e-4, weight_decay_params="all"),
     "--decoupled-lr goes with --weight-decay-params matrices (Megatron-Core's parameter groups); drop one of them"),
    ("recompute modules", dict(recompute_modules=["core_attn"]), dict(recompute_modules=["core_attn", "mlp"]),
     "--recompute-modules core_attn mlp: selective recompute here recomputes core attention only (core_attn, "
     "Megatron-LM's default); drop the others or use --recompute-granularity full"),
    ("profile start", dict(profile=True, profile_step_start=1, profile_step_end=1),
     dict(profile=True, profile_step_start=0, profile_step_end=1),
     "--profile-step-start 0 and --profile-step-end 1: need 1 <= start <= end"),
    ("profile order", dict(profile=True, profile_step_start=2, profile_step_end=2),
     dict(profile=True, profile_step_start=2, profile_step_end=1),
     "--profile-step-start 2 and --profile-step-end 1: need 1 <= start <= end"),
    ("profile end", dict(profile=True, profile_step_start=1, profile_step_end=2),
     dict(profile=True, profile_step_start=1, profile_step_end=3),
     "--profile-step-start 1 to --profile-step-end 3 ends past the run's last step (--train-iters 2): the trace is "
     "written after step 3, so nothing would be; give a range within 1..2"),
    ("profile off", dict(profile=False, profile_step_start=3, profile_step_end=1),
     dict(profile=True, profile_step_start=3, profile_step_end=1),
     "--profile-step-start 3 and --profile-step-end 1: need 1 <= start <= end"),
    ("warm-up samples", dict(lr_warmup_samples=0), dict(lr_warmup_samples=-1), "--lr-warmup-samples must be >= 0 (got -1)"),
    ("decay samples", dict(lr_decay_samples=0), dict(lr_decay_samples=-1), "--lr-decay-samples must be >= 0 (got -1)"),
]


@pytest.mark.parametrize("name, accepted, refused_with, line", FLAG_EDGES, ids=[row[0] for row in FLAG_EDGES])
def test_megatron_lm_flag_checks_at_their_edges(tmp_path, name, accepted, refused_with, line):
    """docs/ecosystem.md's Megatron-LM flags: each check's edge from both sides (a check moved one step either way,
    or its test turned, fails a row); the refusal is exactly its line, and alone."""
    base = parse_args([*TINY, "--save", str(tmp_path / "r")])
    assert megatron_lm_flag_errors(base) == []
    assert megatron_lm_flag_errors(argparse.Namespace(**dict(vars(base), **accepted))) == [], accepted
    assert megatron_lm_flag_errors(argparse.Namespace(**dict(vars(base), **refused_with))) == [line]


def test_a_negative_sample_count_is_one_clear_problem(tmp_path, capsys):
    """--lr-warmup-samples=-1 (or --lr-decay-samples) is refused once, in its own terms (not as a negative warm-up
    of iterations "below the decay length"); the warm-up's edge in samples (TINY: global batch 2, 2 steps): 3 samples
    (1.5 steps) accepted, 4 (2 steps, the whole decay) refused naming the samples."""
    base = [*TINY, "--save", str(tmp_path / "r")]
    assert refused([*base, "--lr-warmup-samples=-1"], capsys) == ["--lr-warmup-samples must be >= 0 (got -1)"]
    assert refused([*base, "--lr-decay-samples=-1"], capsys) == ["--lr-decay-samples must be >= 0 (got -1)"]
    assert parse_args([*base, "--lr-warmup-samples", "3"]).lr_warmup_iters == 1.5
    assert refused([*base, "--lr-warmup-samples", "4"], capsys) == [
        "--lr-warmup-samples 4 (2 steps of 2 samples) must be >= 0 and below the decay length 2 steps "
        "(--lr-decay-iters or --lr-decay-samples, default --train-iters)"]
    assert refused([*base, "--lr-warmup-iters", "2"], capsys) == [
        "--lr-warmup-iters 2 must be >= 0 and below the decay length 2 steps (--lr-decay-iters or --lr-decay-samples, "
        "default --train-iters)"]
    assert parse_args([*base, "--lr-warmup-iters", "1"]).lr_warmup_iters == 1
    assert not (tmp_path / "r").exists()


# The same for the other Megatron-LM checks (argument_checks.megatron_lm_errors): tokenizer types, checkpoint format,
# --finetune, --recompute-method, --train-samples; on TINY (--mock-data) with --save R.
USE_HF = "--tokenizer-model DIR (a Hugging Face tokenizer folder, tokenizer.json or hub name)"
OTHER_EDGES = [
    ("tokenizer type", dict(tokenizer_type="NullTokenizer"), dict(tokenizer_type="GPT2BPETokenizer"),
     "--tokenizer-type GPT2BPETokenizer is not read here: use --tokenizer-type HuggingFaceTokenizer " + USE_HF),
    ("null tokenizer", dict(tokenizer_type="NullTokenizer", mock_data=True),
     dict(tokenizer_type="NullTokenizer", mock_data=False),
     "--tokenizer-type NullTokenizer goes with --mock-data --vocab-size N; for a dataset use --tokenizer-type "
     "HuggingFaceTokenizer --tokenizer-model DIR"),
    ("hf tokenizer", dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="tok"),
     dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None),
     "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer folder, tokenizer.json or hub "
     "name)"),
    ("checkpoint format", dict(ckpt_format="torch_dist"), dict(ckpt_format="torch"),
     "--ckpt-format torch is not supported: checkpoints here are torch_dist (Megatron-Core dist checkpointing); "
     "drop the flag or pass --ckpt-format torch_dist"),
    ("finetune load", dict(finetune=True, load="{tmp}/other"), dict(finetune=True, load=None),
     "--finetune needs --load (the checkpoint whose weights to start from)"),
    ("finetune own folder", dict(finetune=True, load="{tmp}/other"), dict(finetune=True, load="{tmp}/r/../r"),
     "--finetune --load {tmp}/r/../r would write over the run it reads: pass a new --save folder (or "
     "--pretrained-checkpoint DIR --load NEW --save NEW, which a requeued job resumes)"),
    ("finetune or pretrained", dict(finetune=False, pretrained_checkpoint="{tmp}/p"),
     dict(finetune=True, load="{tmp}/other", pretrained_checkpoint="{tmp}/p"),
     "give --finetune --load DIR or --pretrained-checkpoint DIR, not both"),
    ("recompute method", dict(recompute_method="uniform", recompute_granularity="full"),
     dict(recompute_method="uniform", recompute_granularity="selective"),
     "--recompute-method needs --recompute-granularity full (selective recompute has no method)"),
    ("train samples", dict(train_samples=1), dict(train_samples=0), "--train-samples must be >= 1"),
]


@pytest.mark.parametrize("name, accepted, refused_with, line", OTHER_EDGES, ids=[row[0] for row in OTHER_EDGES])
def test_megatron_lm_checks_at_their_edges(tmp_path, name, accepted, refused_with, line):
    """Each of megatron_lm_errors' checks from both sides, the refusal exactly its line and alone."""
    base = parse_args([*TINY, "--save", str(tmp_path / "r")])
    assert megatron_lm_errors(base) == []

    def at(values):
        values = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in values.items()}
        return argparse.Namespace(**dict(vars(base), **values))

    assert megatron_lm_errors(at(accepted)) == [], accepted
    assert megatron_lm_errors(at(refused_with)) == [line.format(tmp=tmp_path)]


def test_the_world_size_and_the_inputs_are_checked_by_default(tmp_path):
    """argument_errors checks the world size against TP x PP x CP when it is given (2 ranks at TP2 fit, 3 do not), and
    validate_args checks the inputs (a data source) by default."""
    args = argparse.Namespace(**dict(vars(parse_args([*TINY, "--save", str(tmp_path / "r")])),
                                     tensor_model_parallel_size=2))
    assert argument_errors(args, 2) == []
    assert argument_errors(args, 3) == ["world size 3 is not divisible by TP x PP x CP = 2 x 1 x 1"]
    validate_args(args, 2)
    with pytest.raises(ValueError, match="give exactly one data source"):
        validate_args(argparse.Namespace(**dict(vars(args), mock_data=False)), 2)
