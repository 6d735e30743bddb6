"""tools/evaluate.py (megatron_sat/analysis/evaluation.py): lm-eval on an export, offline.

    pytest -q tests/test_evaluate.py            # about 40 s on 2 cores

A tiny SATFormer export (random weights, written with the converter's own writer, word-level
tokenizer) is evaluated by lm-eval 0.4.13 on the local tasks in tests/data/eval/ (a multiple-choice
loglikelihood task and a generate_until task over tiny.jsonl); the accuracy is recomputed here
from the model's logits. Skipped when lm-eval is not installed (pip install "lm-eval[hf]==0.4.13").
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TASKS = os.path.join(HERE, "data", "eval")
sys.path.insert(0, os.path.join(HERE, "workers"))
from conversion import write_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    from megatron_sat.conversion.hf_io import write_hf_folder
    from megatron_sat.conversion.mapping import ModelSpec, hf_config, hf_shapes

    root = tmp_path_factory.mktemp("eval")
    spec = ModelSpec(arch="satformer", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=64, kv_channels=8, vocab_size=128, max_position_embeddings=64)
    g = torch.Generator().manual_seed(0)
    weights = {k: (torch.ones(s) if k.endswith("norm.weight") else 0.3 * torch.randn(s, generator=g))
               for k, s in hf_shapes(spec).items()}
    write_tokenizer(str(root / "tok" / "tokenizer.json"))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(root / "tok" / "tokenizer.json"), eos_token="<|endoftext|>")
    return write_hf_folder(str(root / "hf"), spec, hf_config(spec, torch.float32, eos=0), weights, tokenizer=tok)


def expected_accuracy(model_dir):
    """Multiple-choice accuracy from the model's own log-likelihoods (what lm-eval should compute)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32).eval()
    hits = []
    for line in open(os.path.join(TASKS, "tiny.jsonl")):
        doc = json.loads(line)
        ctx = tok(doc["context"])["input_ids"]
        scores = []
        for choice in doc["choices"]:
            cont = tok(" " + choice)["input_ids"]
            with torch.no_grad():
                logp = model(torch.tensor([ctx + cont])).logits.log_softmax(-1)[0]
            scores.append(sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont)))
        hits.append(float(max(range(len(scores)), key=scores.__getitem__) == doc["label"]))
    return sum(hits) / len(hits)


def test_evaluate_cli_offline(export, tmp_path):
    out = tmp_path / "results"
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "evaluate.py"), "--model", export,
                        "--tasks", "megatron_sat_tiny_mc", "megatron_sat_tiny_gen", "based_drop", "--skip-missing",
                        "--include-path", TASKS, "--device", "cpu", "--batch-size", "2", "--output", str(out)],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"), timeout=600, cwd="/")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.load(open(out / "results.json"))
    assert summary["skipped"] == ["based_drop"]
    rows = {(row["task"], row["metric"]): row["value"] for row in summary["table"]}
    assert rows[("megatron_sat_tiny_mc", "acc")] == pytest.approx(expected_accuracy(export), abs=1e-9)
    assert ("megatron_sat_tiny_gen", "exact_match") in rows
    assert summary["n_samples"]["megatron_sat_tiny_gen"]["effective"] == 6
    assert summary["averages"]["all"]["complete"] is False  # based_drop did not run
    md = (out / "results.md").read_text()
    assert "| megatron_sat_tiny_mc | acc |" in md and "Skipped" in md and md in r.stdout


def test_unknown_tasks_refused():
    from megatron_sat.analysis.evaluation import RETRIEVAL, SUITES, EvaluationError, resolve_tasks

    assert RETRIEVAL == ["swde", "fda", "squad_completion", "based_triviaqa", "based_nq_2048", "based_drop"]
    assert set(SUITES) == {"retrieval", "zeroshot"}
    with pytest.raises(EvaluationError, match="based_triviaqa.*--include-path"):
        resolve_tasks(["swde", "based_triviaqa"], [TASKS], skip_missing=False)
    specs, _, skipped = resolve_tasks(["swde", "megatron_sat_tiny_mc", "based_triviaqa"], [TASKS], skip_missing=True,
                                      log=lambda *a: None)
    assert skipped == ["based_triviaqa"] and specs[0] == "swde"
    local = specs[1]
    assert local["task"] == "megatron_sat_tiny_mc"
    assert local["dataset_kwargs"]["data_files"]["test"] == os.path.join(TASKS, "tiny.jsonl")
