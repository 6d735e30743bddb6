"""Paths that hold from any folder (megatron_sat/training/run_paths.py): config.json records every path flag as typed
and resolved; tools/convert_to_hf.py and tools/evaluate.py --checkpoint find the run's tokenizer from any folder.

    pytest -q tests/test_run_paths.py        # one trainer launch (2 steps), exports and one lm-eval run in-process

A word-level corpus is preprocessed in a launch folder L and a tiny SATFormer trained there with relative paths
(--tokenizer-model tok --data-path data_text_document --save runs/R). From another folder: the export carries the
tokenizer, evaluate --checkpoint scores the run; an old run folder (config.json without the record) is found through
its relative --save; a moved tokenizer stops both with exit 2 naming the path; --no-tokenizer exports without one
and says so. The lookup's order and its hub-name and mock-data cases are checked on records alone (no training).
"""

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from train_cli import ROOT, env
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from megatron_sat.training.run_paths import TokenizerNotFound, find_tokenizer, record_paths

sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
sys.path.insert(0, ROOT)
from conversion import write_tokenizer  # noqa: E402

from tools.convert_to_hf import main as convert_main  # noqa: E402
from tools.evaluate import main as evaluate_main  # noqa: E402
from tools.preprocess_data import main as preprocess_main  # noqa: E402

TASKS = os.path.join(ROOT, "tests", "data", "eval")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module", autouse=True)
def own_process_group():
    """The tools run in this process set up a one-rank process group: gone again after this module if it made it."""
    before = torch.distributed.is_initialized()
    yield
    if not before and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """L/runs/R, trained in L with relative paths; `elsewhere` is another folder."""
    tmp = tmp_path_factory.mktemp("paths")
    launch, elsewhere = tmp / "L", tmp / "elsewhere"
    launch.mkdir()
    elsewhere.mkdir()
    write_tokenizer(str(tmp / "raw" / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_file=str(tmp / "raw" / "tokenizer.json"), eos_token="<|endoftext|>",
                            unk_token="<unk>").save_pretrained(str(launch / "tok"))
    with open(launch / "corpus.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": " ".join(f"w{(i * 7 + j) % 50}" for j in range(30))}) + "\n")
    assert preprocess_main(["--input", str(launch / "corpus.jsonl"), "--tokenizer", str(launch / "tok"),
                            "--output-prefix", str(launch / "data_text_document"), "--workers", "1", "--quiet"]) == 0
    argv = ["--arch", "satformer", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
            "--train-iters", "2", "--eval-iters", "1", "--no-progress-bar", "--tokenizer-model", "tok",
            "--data-path", "data_text_document", "--save", os.path.join("runs", "R")]
    proc = subprocess.run([sys.executable, "-m", "megatron_sat.train", *argv], cwd=launch, env=env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return SimpleNamespace(tmp=tmp, launch=launch, elsewhere=elsewhere, run=launch / "runs" / "R")


def _convert(argv, capsys):
    code = convert_main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _evaluate(argv, capsys):
    code = evaluate_main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_config_json_records_resolved_paths(run):
    config = json.load(open(run.run / "config.json"))
    assert config["launch_dir"] == str(run.launch)
    assert config["paths"]["tokenizer_model"] == dict(typed="tok", resolved=str(run.launch / "tok"))
    assert config["paths"]["data_path"] == dict(typed=["data_text_document"],
                                                resolved=[str(run.launch / "data_text_document")])
    assert config["tokenizer_model"] == "tok"  # the arguments stay as typed (--config RUN/config.json reproduces)


@pytest.mark.slow
def test_export_and_evaluate_from_another_folder(run, monkeypatch, capsys):
    monkeypatch.chdir(run.elsewhere)
    code, out, err = _convert(["--load", run.run, "--output", "hf"], capsys)
    assert code == 0, err
    assert all((run.elsewhere / "hf" / name).is_file() for name in TOKENIZER_FILES)
    assert f"tokenizer {run.launch / 'tok'}" in out
    tok = AutoTokenizer.from_pretrained(str(run.elsewhere / "hf"))
    assert tok("w1 w2")["input_ids"] == [3, 4] and tok.model_max_length == 16
    code, out, err = _evaluate(["--checkpoint", run.run, "--tasks", "megatron_sat_tiny_mc", "--include_path", TASKS,
                                "--limit", "2", "--batch_size", "2"], capsys)
    assert code == 0, err
    assert "megatron_sat_tiny_mc" in out


@pytest.mark.slow
def test_old_run_folder_found_through_its_relative_save(run, tmp_path, monkeypatch, capsys):
    """A config.json written before the record: runs/R found at X/runs/R was launched in X (its tokenizer X/tok)."""
    old = tmp_path / "X"
    shutil.copytree(run.run, old / "runs" / "R")
    shutil.copytree(run.launch / "tok", old / "tok")
    config = json.load(open(old / "runs" / "R" / "config.json"))
    del config["launch_dir"], config["paths"]
    json.dump(config, open(old / "runs" / "R" / "config.json", "w"))
    monkeypatch.chdir(run.elsewhere)
    code, out, err = _convert(["--load", old / "runs" / "R", "--output", tmp_path / "hf"], capsys)
    assert code == 0, err
    assert f"tokenizer {old / 'tok'}" in out and (tmp_path / "hf" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_moved_tokenizer_exits_2_naming_the_path_unless_no_tokenizer(run, tmp_path, monkeypatch, capsys):
    """The tokenizer moved away: convert_to_hf and evaluate --checkpoint exit 2 naming it, nothing is written;
    --no-tokenizer exports the model alone and says so."""
    moved = tmp_path / "R"
    shutil.copytree(run.run, moved)  # a copy whose record names a tokenizer that is gone
    config = json.load(open(moved / "config.json"))
    gone = str(tmp_path / "gone" / "tok")
    config["paths"]["tokenizer_model"]["resolved"], config["launch_dir"] = gone, str(tmp_path / "gone")
    json.dump(config, open(moved / "config.json", "w"))
    monkeypatch.chdir(run.elsewhere)
    code, out, err = _convert(["--load", moved, "--output", tmp_path / "hf"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"the run's tokenizer tok is not found (tried {gone}" in err and "--no-tokenizer" in err
    assert not (tmp_path / "hf").exists() and not [n for n in os.listdir(tmp_path) if n.startswith("hf.")]
    code, out, err = _evaluate(["--checkpoint", moved, "--tasks", "megatron_sat_tiny_mc", "--include_path", TASKS,
                                "--limit", "2"], capsys)
    assert code == 2 and f"the run's tokenizer tok is not found (tried {gone}" in err, err
    code, out, err = _convert(["--load", moved, "--output", tmp_path / "hf", "--no-tokenizer"], capsys)
    assert code == 0, err
    assert "no tokenizer (--no-tokenizer)" in out
    files = os.listdir(tmp_path / "hf")
    assert "model.safetensors" in files and not [n for n in files if n.startswith(("tokenizer", "special_tokens"))]
    code, out, err = _convert(["--load", moved, "--output", tmp_path / "hf2", "--tokenizer", tmp_path / "none"], capsys)
    assert code == 2 and f"--tokenizer {tmp_path / 'none'} cannot be loaded" in err and not (tmp_path / "hf2").exists()


# ------------------------------------------------------------------------------------------------------------------
# the lookup on records alone (no training)
# ------------------------------------------------------------------------------------------------------------------

def test_record_paths_resolves_blends_and_hub_names(tmp_path):
    (tmp_path / "tok").mkdir()
    args = SimpleNamespace(tokenizer_model="tok", data_path=["0.3", "a/b", "0.7", "/abs/c"], train_data_path=None,
                           embedded_data=None, mock_data=True)
    rec = record_paths(args, cwd=str(tmp_path))
    assert rec["launch_dir"] == str(tmp_path)
    assert rec["paths"] == {"tokenizer_model": dict(typed="tok", resolved=str(tmp_path / "tok")),
                            "data_path": dict(typed=["0.3", "a/b", "0.7", "/abs/c"],
                                              resolved=["0.3", str(tmp_path / "a" / "b"), "0.7", "/abs/c"])}
    hub = record_paths(SimpleNamespace(tokenizer_model="org/name"), cwd=str(tmp_path))
    assert hub["paths"]["tokenizer_model"] == dict(typed="org/name", resolved=None)


def test_find_tokenizer_order_and_failures(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "launch" / "tok").mkdir(parents=True)
    (tmp_path / "cwd_tok").mkdir()
    run_dir = str(tmp_path / "launch" / "runs" / "R")
    args = dict(tokenizer_model="tok", save="runs/R")
    # recorded and present
    recorded = dict(launch_dir="/nowhere", paths=dict(tokenizer_model=dict(typed="tok",
                                                                         resolved=str(tmp_path / "launch" / "tok"))))
    assert find_tokenizer(args, recorded, run_dir) == str(tmp_path / "launch" / "tok")
    # an old run: through the relative --save it recorded
    assert find_tokenizer(args, {}, run_dir) == str(tmp_path / "launch" / "tok")
    # an old run elsewhere: the current folder
    assert find_tokenizer(dict(tokenizer_model="cwd_tok", save="runs/R"), {}, "/other/R") == str(tmp_path / "cwd_tok")
    # a hub name the run was trained with: handed to the loader as it is
    assert find_tokenizer(dict(tokenizer_model="org/name"),
                          dict(paths=dict(tokenizer_model=dict(typed="org/name", resolved=None))), run_dir) == "org/name"
    # mock data without a tokenizer: none to find
    assert find_tokenizer(dict(mock_data=True), dict(tokenizer="NullTokenizer(vocab_size=128)"), run_dir) is None
    # recorded, and gone: every path tried is named
    with pytest.raises(TokenizerNotFound) as e:
        find_tokenizer(dict(tokenizer_model="gone/tok.json", save="runs/R"),
                       dict(launch_dir="/was", paths=dict(tokenizer_model=dict(typed="gone/tok.json",
                                                                              resolved="/was/gone/tok.json"))),
                       run_dir)
    assert str(e.value) == (f"the run's tokenizer gone/tok.json is not found (tried /was/gone/tok.json, "
                            f"{tmp_path / 'launch' / 'gone' / 'tok.json'}, {tmp_path / 'gone' / 'tok.json'})")
