"""Issue 27: the ecosystem's command lines work unchanged (real trainer, real lm-eval, real converter).

    pytest -q tests/test_ecosystem.py        # five trainer launches, one evaluation, one export

A word-level corpus is preprocessed twice, with Megatron-LM's command line and with the native flags (the same
.bin/.idx bytes); then one tiny SATFormer (2 layers, hidden 32) is trained on it:

  A   a Megatron-LM command line: --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR --data-path PREFIX
      --train-samples --lr-warmup-fraction --recompute-method --ckpt-format torch_dist --exit-signal-handler
  C1  --config of what --print-config printed for A's command line           -> A's losses, exactly
  C2  --config A/config.json, --data-args-path in place of its --data-path   -> A's losses, exactly
  F   --finetune --load A: A's final weights (the validation loss after a step at lr 0 is A's last), from step 1
  N   --load A --ckpt-step 3 --no-load-optim --no-load-rng: step 4 has A's loss (weights and data position
      loaded), the LR schedule starts over (lr 0 at step 4), Adam's state is new (step 5 differs)
then tools/evaluate.py in lm-eval's form (--tasks a,b --output_path P --log_samples) on A, and an export of A
under umask 022 (files readable by others, a model card with the arch, final loss and the scores). Precedence,
outside recipes and the refusals are checked in-process (no training).
"""

import contextlib
import io
import json
import os
import random
import stat
import subprocess
import sys

import pytest
import yaml
from train_cli import ROOT, env, metrics, train
from transformers import PreTrainedTokenizerFast

from megatron_sat.training import schedule
from megatron_sat.training.arguments import build_parser, parse_args

sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
from conversion import write_tokenizer  # noqa: E402

from tools.preprocess_data import main as preprocess_main  # noqa: E402

pytestmark = pytest.mark.slow  # real trainer runs, exports and lm-eval

TASKS = os.path.join(ROOT, "tests", "data", "eval")
MODEL = ["--arch", "satformer", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--log-interval", "1",
         "--eval-iters", "1", "--no-progress-bar"]
MEGATRON_LM = [*MODEL, "--train-samples", "24", "--lr-warmup-fraction", "0.2", "--tokenizer-type",
               "HuggingFaceTokenizer", "--exit-signal-handler", "--ckpt-format", "torch_dist", "--recompute-granularity",
               "full", "--recompute-method", "uniform", "--recompute-num-layers", "1", "--eval-interval", "3",
               "--save-interval", "3"]


def _tokenizer(folder: str) -> str:
    """A Hugging Face tokenizer folder: word level, <|endoftext|> (eos), <unk>, w0 ... w125."""
    write_tokenizer(os.path.join(folder + "_raw", "tokenizer.json"))
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder + "_raw", "tokenizer.json"),
                                  eos_token="<|endoftext|>", unk_token="<unk>")
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eco")
    rng = random.Random(0)
    corpus = tmp / "corpus.jsonl"
    with open(corpus, "w") as f:
        for _ in range(200):
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(40)}" for _ in range(rng.randrange(20, 60)))}) + "\n")
    tok = _tokenizer(str(tmp / "tok"))
    out = {"tmp": tmp, "tok": tok}
    # Megatron-LM's README command line, local paths; then the native flags
    assert preprocess_main(["--input", str(corpus), "--output-prefix", str(tmp / "mlm"), "--tokenizer-type",
                            "HuggingFaceTokenizer", "--tokenizer-model", tok, "--workers", "2", "--append-eod"]) == 0
    assert preprocess_main(["--input", str(corpus), "--tokenizer", tok, "--output-prefix",
                            str(tmp / "native_text_document"), "--workers", "1", "--quiet"]) == 0
    prefix = str(tmp / "mlm_text_document")
    a_cmd = [*MEGATRON_LM, "--tokenizer-model", tok, "--data-path", prefix, "--save", str(tmp / "A")]
    out["A_log"] = train(*a_cmd)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as e:
        parse_args([*a_cmd, "--print-config"])
    assert e.value.code == 0
    (tmp / "printed.yaml").write_text(printed.getvalue())
    out["C1_log"] = train("--config", tmp / "printed.yaml", "--save", tmp / "C1")
    (tmp / "data_args.txt").write_text(prefix + "\n")
    out["C2_log"] = train("--config", tmp / "A" / "config.json", "--save", tmp / "C2", "--data-args-path",
                          tmp / "data_args.txt")
    out["F_log"] = train("--config", tmp / "A" / "config.json", "--finetune", "--load", tmp / "A", "--save", tmp / "F",
                         "--train-samples", "8", "--lr-warmup-iters", "1", "--eval-interval", "1")
    out["N_log"] = train("--config", tmp / "A" / "config.json", "--load", tmp / "A", "--ckpt-step", "3",
                         "--no-load-optim", "--no-load-rng", "--save", tmp / "N")
    ev = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "evaluate.py"), "--checkpoint", str(tmp / "A"),
                         "--tasks", "megatron_sat_tiny_mc,megatron_sat_tiny_gen", "--include_path", TASKS,
                         "--output_path", str(tmp / "lm_eval_out"), "--log_samples", "--seed", "1234",
                         "--num_fewshot", "0", "--limit", "4", "--batch_size", "2",
                         "--output", str(tmp / "A" / "eval" / "tiny")],
                        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    export = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_to_hf.py"), "--load",
                             str(tmp / "A"), "--output", str(tmp / "hf")], cwd=ROOT, env=env(), capture_output=True,
                            text=True, timeout=600, preexec_fn=lambda: os.umask(0o022))
    assert export.returncode == 0, export.stdout[-3000:] + export.stderr[-3000:]
    return out


def _losses(folder):
    return {step: row["loss"] for step, row in metrics(folder)[0].items()}


def test_megatron_lm_preprocessing_gives_the_native_bytes(world):
    tmp = world["tmp"]
    for ext in ("bin", "idx"):  # Megatron-LM's output name: PREFIX_KEY_document
        assert (tmp / f"mlm_text_document.{ext}").read_bytes() == (tmp / f"native_text_document.{ext}").read_bytes()
    assert (tmp / "mlm_text_document.bin").stat().st_size > 1000


def test_a_megatron_lm_training_command_runs(world):
    a = world["tmp"] / "A"
    train_rows, val = metrics(a)
    assert sorted(train_rows) == [1, 2, 3, 4, 5, 6]  # --train-samples 24 / global batch 4
    assert sorted(val) == [3, 6]
    # --lr-warmup-fraction 0.2 of 6 decay steps: Megatron's warmup over 1.2 steps, step k uses lr * (k - 1) / 1.2
    assert train_rows[1]["lr"] == 0.0 and train_rows[2]["lr"] == pytest.approx(3e-3 / 1.2)
    config = json.load(open(a / "config.json"))
    assert config["train_iters"] == 6 and config["arguments"]["train_samples"] == 24
    assert config["arguments"]["train_iters"] is None and config["arguments"]["tokenizer_type"] == "HuggingFaceTokenizer"
    assert config["arguments"]["recompute_method"] == "uniform" and os.path.isdir(a / "iter_0000006")


def test_print_config_then_config_reproduces_the_losses(world):
    text = (world["tmp"] / "printed.yaml").read_text()
    assert text.startswith("# megatron-sat-train arguments") and "train_samples: 24" in text
    assert _losses(world["tmp"] / "C1") == _losses(world["tmp"] / "A")
    assert metrics(world["tmp"] / "C1")[1] == metrics(world["tmp"] / "A")[1]


def test_a_runs_config_json_reproduces_the_run(world):
    assert _losses(world["tmp"] / "C2") == _losses(world["tmp"] / "A")
    c2 = json.load(open(world["tmp"] / "C2" / "config.json"))["arguments"]
    a = json.load(open(world["tmp"] / "A" / "config.json"))["arguments"]
    assert c2["data_path"] is None and c2["data_args_path"].endswith("data_args.txt")
    assert {k: v for k, v in c2.items() if k not in ("save", "data_path", "data_args_path", "config")} == \
        {k: v for k, v in a.items() if k not in ("save", "data_path", "data_args_path", "config")}


def test_finetune_loads_the_weights_only(world):
    f_rows, f_val = metrics(world["tmp"] / "F")
    _, a_val = metrics(world["tmp"] / "A")
    assert sorted(f_rows) == [1, 2] and f_rows[1]["lr"] == 0.0  # iteration 0, a new LR schedule
    assert f_val[1] == a_val[6]  # after a step at lr 0: A's final weights, exactly
    assert "(--finetune): new optimizer state, LR schedule, RNG and data order" in world["F_log"]


def test_no_load_optim_and_rng_load_what_megatron_lm_loads(world):
    n, a = metrics(world["tmp"] / "N")[0], metrics(world["tmp"] / "A")[0]
    assert sorted(n) == [4, 5, 6]  # the iteration is loaded
    assert n[4]["loss"] == a[4]["loss"]  # the weights and the data position are loaded
    assert n[4]["lr"] == 0.0 < a[4]["lr"]  # the scheduler is not: it starts over (Megatron-LM)
    assert n[5]["loss"] != a[5]["loss"]  # nor Adam's state
    assert "optimizer and LR schedule not loaded (--no-load-optim)" in world["N_log"]
    assert "RNG state not loaded (--no-load-rng)" in world["N_log"]


def test_evaluate_writes_lm_evals_layout(world):
    root = world["tmp"] / "lm_eval_out"
    (model_dir,) = os.listdir(root)  # <the checkpoint's path, sanitized as lm-eval does>
    files = sorted(os.listdir(root / model_dir))
    (results,) = [f for f in files if f.startswith("results_") and f.endswith(".json")]
    assert set(json.load(open(root / model_dir / results))["results"]) == {"megatron_sat_tiny_mc",
                                                                            "megatron_sat_tiny_gen"}
    for task in ("megatron_sat_tiny_mc", "megatron_sat_tiny_gen"):
        (samples,) = [f for f in files if f.startswith(f"samples_{task}_")]
        assert len((root / model_dir / samples).read_text().splitlines()) == 4  # --limit 4


def test_export_is_readable_by_others_and_has_a_model_card(world):
    hf = world["tmp"] / "hf"
    for name in os.listdir(hf):  # safetensors alone writes 0600
        mode = stat.S_IMODE(os.stat(hf / name).st_mode)
        assert mode == 0o644, (name, oct(mode))
    assert stat.S_IMODE(os.stat(hf).st_mode) == 0o755
    card = (hf / "README.md").read_text()
    a_val = metrics(world["tmp"] / "A")[1]
    assert "license: apache-2.0" in card and "| arch | `satformer` |" in card and "2605.03953" in card
    assert f"| final validation loss | {a_val[6]:.4f} (step 6) |" in card
    assert "| tiny | megatron_sat_tiny_mc | acc |" in card and "| tokens trained | 384 |" in card
    record = json.load(open(hf / "megatron_sat_conversion.json"))
    # the run folder's and the tokenizer's names, no path of the machine that converted (relative or absolute)
    assert record["source"] == os.path.join("A", "iter_0000006") and record["tokenizer"] == "tok"
    assert str(world["tmp"]) not in card + json.dumps(record) and "../" not in card + json.dumps(record)
    assert 'AutoTokenizer.from_pretrained("THIS_FOLDER", trust_remote_code=True)' in card


# ------------------------------------------------------------------------------------------------------------------
# in-process: precedence, outside recipes, refusals (no training)
# ------------------------------------------------------------------------------------------------------------------

def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_precedence_recipe_config_command_line(tmp_path):
    assert "recipe < config file < command line" in " ".join(build_parser().format_help().split())
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("recipe: debug_satformer\nhidden-size: 96\nlr: 2.0e-3\ndata_path: null\n")
    json_file = tmp_path / "c.json"
    json_file.write_text(json.dumps({"hidden_size": 96, "lr": 2e-3, "recipe": "debug_satformer"}))
    for config in (yaml_file, json_file):
        args = parse_args(["--config", str(config), "--lr", "5e-4", "--save", str(tmp_path / "r")])
        assert args.num_layers == 4 and args.mock_data  # the recipe's
        assert args.hidden_size == 96  # the config file's over the recipe's 64
        assert args.lr == 5e-4  # the command line's over both
    # a data source of a higher layer replaces a lower one's (the recipe's mock data and its vocabulary)
    (tmp_path / "d.yaml").write_text(f"embedded_data: {tmp_path / 'corpus'}\n")
    args = parse_args(["--recipe", "debug_satformer", "--config", str(tmp_path / "d.yaml"), "--save", str(tmp_path / "s")])
    assert (args.mock_data, args.vocab_size, args.embedded_data) == (False, None, str(tmp_path / "corpus"))


def test_the_command_lines_recipe_is_the_base_under_a_config_that_names_another(tmp_path, capsys):
    """`--recipe A --config FILE` where FILE says `recipe: B`: A is the base layer (the command line's over the
    file's), FILE's own values over A's; through parse_args and through --print-config."""
    (tmp_path / "b.yaml").write_text("recipe: satformer_130M\nlr: 2.0e-3\n")
    argv = ["--recipe", "debug_transformer", "--config", str(tmp_path / "b.yaml"), "--mock-data", "--vocab-size", "64",
            "--save", str(tmp_path / "r")]
    args = parse_args(argv)
    assert (args.recipe, args.arch, args.num_layers, args.hidden_size, args.seq_length) == \
        ("debug_transformer", "transformer", 4, 64, 32)  # A's, not satformer_130M's (satformer, 11, 768, 4096)
    assert args.lr == 2e-3  # the file's value over A's 3e-3
    with pytest.raises(SystemExit) as e:
        parse_args([*argv, "--print-config"])
    assert e.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["recipe"], printed["arch"], printed["num_layers"], printed["lr"]) == \
        ("debug_transformer", "transformer", 4, 2e-3)
    # without --recipe on the command line, the file's recipe is the base
    args = parse_args(["--config", str(tmp_path / "b.yaml"), "--mock-data", "--vocab-size", "64", "--save",
                       str(tmp_path / "r")])
    assert (args.recipe, args.arch, args.num_layers, args.lr) == ("satformer_130M", "satformer", 11, 2e-3)


def test_train_samples_floors_to_whole_global_batches(tmp_path, capsys):
    """docs/ecosystem.md: --train-samples N trains floor(N / global batch) iterations (Megatron-LM's rounding), the LR
    decays over those iterations; fewer samples than one global batch exit 2. debug_satformer's global batch is 8.
    --lr-warmup-fraction F warms up over F x the decay length, unrounded."""
    base = ["--recipe", "debug_satformer", "--lr-warmup-iters", "0", "--save", str(tmp_path / "r")]
    for samples, iters in ((8, 1), (15, 1), (16, 2), (23, 2), (24, 3), (31, 3)):  # floor: 15 -> 1, not 2
        args = parse_args([*base, "--train-samples", str(samples)])
        assert args.train_iters == iters, (samples, args.train_iters)
        assert schedule.wanted(args)["lr_decay_steps"] == iters
    args = parse_args([*base, "--train-samples", "31", "--lr-warmup-fraction", "0.3"])
    assert (args.lr_warmup_iters, schedule.wanted(args)["lr_warmup_steps"]) == (0, pytest.approx(0.9, rel=1e-12))
    err = _refused([*base, "--train-samples", "7"], capsys)
    assert "--train-samples 7 is less than one global batch (8): give at least 8" in err


def test_megatron_lm_pairs_refused_at_one_layer_and_the_higher_layer_wins(tmp_path, capsys):
    """docs/ecosystem.md: --train-samples with --train-iters at the same layer exits 2, else the higher layer wins (in
    either direction); --lr-warmup-fraction with a non-zero --lr-warmup-iters at the same layer exits 2 (a zero one
    does not), else the higher layer wins."""
    base = ["--recipe", "debug_satformer", "--save", str(tmp_path / "r")]
    both = tmp_path / "both.yaml"
    both.write_text("train_iters: 4\ntrain_samples: 64\n")
    assert "not both" in _refused([*base, "--config", str(both)], capsys)  # both in the file: one layer
    samples = tmp_path / "samples.yaml"
    samples.write_text("train_samples: 64\nlr_warmup_fraction: 0.25\n")
    args = parse_args([*base, "--config", str(samples)])  # the file's over the recipe's train_iters 20, warmup 2
    assert (args.train_iters, args.train_samples, args.lr_warmup_iters, args.lr_warmup_fraction) == (8, 64, 0, 0.25)
    args = parse_args([*base, "--config", str(samples), "--train-iters", "5", "--lr-warmup-iters", "1"])
    assert (args.train_iters, args.train_samples, args.lr_warmup_iters, args.lr_warmup_fraction) == (5, None, 1, None)
    assert "not both" in _refused([*base, "--lr-warmup-iters", "1", "--lr-warmup-fraction", "0.1"], capsys)
    args = parse_args([*base, "--lr-warmup-iters", "0", "--lr-warmup-fraction", "0.1"])
    assert (args.lr_warmup_iters, args.lr_warmup_fraction) == (0, 0.1)


def test_a_recipe_from_outside_the_repository(tmp_path, monkeypatch):
    (tmp_path / "eco_outside_recipes.py").write_text(
        "def tiny():\n    return dict(num_layers=3, hidden_size=48, num_attention_heads=4, train_iters=7, "
        "mock_data=True, vocab_size=128)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = parse_args(["--recipe", "eco_outside_recipes:tiny", "--save", str(tmp_path / "a")])
    assert (args.num_layers, args.hidden_size, args.train_iters) == (3, 48, 7)
    args = parse_args(["--recipe", f"{tmp_path / 'eco_outside_recipes.py'}:tiny", "--hidden-size", "64"])
    assert (args.num_layers, args.hidden_size, args.save) == (3, 64, os.path.join("runs", "tiny"))


def test_refusals_exit_2_with_what_to_do(tmp_path, capsys):
    err = _refused(["--mock-data", "--vocab-size", "64", "--save", str(tmp_path / "x")], capsys)
    assert "missing --num-layers, --hidden-size, --num-attention-heads, --train-iters (or --train-samples)" in err
    err = _refused(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--mock-data",
                    "--vocab-size", "64", "--save", str(tmp_path / "x")], capsys)
    assert "missing --train-iters (or --train-samples)" in err and "--num-layers" not in err.split("error:")[-1]
    base = ["--recipe", "debug_satformer", "--save", str(tmp_path / "x")]
    assert "--ckpt-format torch is not supported" in _refused([*base, "--ckpt-format", "torch"], capsys)
    assert "use --tokenizer-type HuggingFaceTokenizer" in _refused([*base, "--tokenizer-type", "GPT2BPETokenizer"],
                                                                   capsys)
    assert "not both" in _refused([*base, "--train-iters", "4", "--train-samples", "64"], capsys)
    assert "--finetune needs --load" in _refused([*base, "--finetune"], capsys)
    (tmp_path / "bad.yaml").write_text("hidden_size: 64\nno_such_flag: 1\n")
    assert "unknown argument(s) no_such_flag" in _refused([*base, "--config", str(tmp_path / "bad.yaml")], capsys)
    (tmp_path / "typed.yaml").write_text("hidden_size: wide\n")
    assert "cannot read 'wide' as int" in _refused([*base, "--config", str(tmp_path / "typed.yaml")], capsys)
    assert not (tmp_path / "x").exists()


def test_the_config_json_of_an_hf_import_is_a_config_file(tmp_path):
    """tools/convert_from_hf.py records vars(args) + vocab_size + imported_from: --config takes its flags."""
    recorded = vars(build_parser().parse_args(["--arch", "resformer", "--num-layers", "3", "--hidden-size", "48",
                                               "--num-attention-heads", "4", "--train-iters", "9"]))
    (tmp_path / "config.json").write_text(json.dumps(dict(recorded, vocab_size=50000, imported_from="/hf/x",
                                                          save=str(tmp_path))))
    args = parse_args(["--config", str(tmp_path / "config.json"), "--mock-data", "--vocab-size", "64",
                       "--save", str(tmp_path / "more")])
    assert (args.arch, args.num_layers, args.hidden_size, args.train_iters, args.vocab_size) == \
        ("resformer", 3, 48, 9, 64)
