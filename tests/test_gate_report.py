"""tools/analyze_gates.py (megatron_sat/analysis/gate_report.py) on a tiny SATFormer export.

    pytest -q tests/test_gate_report.py            # about 20 s on 2 cores

The report's figures are recomputed here by other means: the gates from the attention inputs
(hooks on the norms, not on the mixing modules), the perplexities from the model's own loss, with
alpha_proj zeroed for the zero ablation and, for the mean ablation, a copy of the model whose
alpha_proj has zero weights and the per-head means as bias (ReLU passes them unchanged).
"""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from megatron_sat.analysis.gate_report import analyze, is_function_token, make_sequences

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "workers"))
from conversion import write_tiny_export  # noqa: E402

LAYERS, KV = 3, 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gates")
    rng = random.Random(0)
    docs = [" ".join(f"w{rng.randrange(40)}" for _ in range(rng.randrange(20, 40))) for _ in range(12)]
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return dict(sat=write_tiny_export(str(root / "sat"), "satformer", LAYERS, KV),
                res=write_tiny_export(str(root / "res"), "resformer", LAYERS, KV), docs=docs, data=str(data))


def _model(path, **config_changes):
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    for k, v in config_changes.items():
        setattr(config, k, v)
    ref = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    if not config_changes:
        return ref.eval()
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and all(k.endswith("alpha_proj.bias") for k in missing), (missing, unexpected)
    return model.eval()


def _loss(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, labels=ids, use_cache=False).loss.item()


def test_report_agrees_with_recomputation(setup):
    report = analyze(setup["sat"], setup["docs"], seq_length=16, max_sequences=8, batch_size=3, min_count=1,
                     log=lambda *a: None)
    ids = make_sequences(setup["docs"], AutoTokenizer.from_pretrained(setup["sat"]), 16, 8)  # [8, 16]
    assert report["sequences"] == 8 and report["tokens"] == ids.numel()
    assert report["mixing_layers"] == [2, 3]

    # gates from the attention inputs: x = attn_norm(h), alpha = relu(x W_alpha^T)
    model = _model(setup["sat"])
    inputs = {}
    hooks = [model.model.layers[i].attn_norm.register_forward_hook(
        lambda m, a, out, i=i: inputs.__setitem__(i, out)) for i in (1, 2)]
    assert _loss(model, ids) == pytest.approx(report["nll"]["gates"], rel=1e-5)
    for h in hooks:
        h.remove()
    alphas = {i: torch.relu(inputs[i] @ model.model.layers[i].attn.value_residual_mixing.alpha_proj.weight.T)
              for i in (1, 2)}  # [8, 16, KV]
    for row in report["per_head"]:
        alpha = alphas[row["layer"] - 1][..., row["head"]]
        assert row["mean_gate"] == pytest.approx(alpha.mean().item(), rel=1e-5)
        assert row["zero_fraction"] == pytest.approx((alpha == 0).double().mean().item(), abs=1e-12)
    assert 0.2 < report["per_layer"][0]["zero_fraction"] < 0.8  # a ReLU gate on random weights: some shut
    per_token = (alphas[1].mean(-1) + alphas[2].mean(-1)) / 2  # [8, 16]
    rows = {r["id"]: r for r in report["all_tokens"]}
    assert sum(r["count"] for r in rows.values()) == ids.numel()
    for tok in ids.unique().tolist():
        where = ids == tok
        assert rows[tok]["count"] == where.sum().item()
        assert rows[tok]["mean_gate"] == pytest.approx(per_token[where].mean().item(), rel=1e-5)
    assert [r["mean_gate"] for r in report["most_gated_tokens"]] == sorted(
        (r["mean_gate"] for r in rows.values()), reverse=True)[:20]
    classes = report["token_classes"]
    assert classes["function"]["tokens"] + classes["content"]["tokens"] == ids.numel()

    # ablations: alpha = 0 is alpha_proj = 0; the per-head mean is a zero-weight alpha_proj with that bias
    with torch.no_grad():
        for i in (1, 2):
            model.model.layers[i].attn.value_residual_mixing.alpha_proj.weight.zero_()
    assert _loss(model, ids) == pytest.approx(report["nll"]["zero"], rel=1e-5)
    biased = _model(setup["sat"], value_residual_proj_bias=True)
    means = {r["layer"] - 1: [] for r in report["per_head"]}
    for r in report["per_head"]:
        means[r["layer"] - 1].append(r["mean_gate"])
    with torch.no_grad():
        for i, m in means.items():
            proj = biased.model.layers[i].attn.value_residual_mixing.alpha_proj
            proj.weight.zero_()
            proj.bias.copy_(torch.tensor(m))
    assert _loss(biased, ids) == pytest.approx(report["nll"]["mean"], rel=1e-5)
    assert len({round(v, 6) for v in report["nll"].values()}) == 3  # the ablations change the model


def test_function_tokens():
    assert all(is_function_token(t) for t in ("\u0120the", "\u2581of", " and", ",", ".\n"))
    assert not any(is_function_token(t) for t in ("\u0120cat", "ing", " 42", "Paris"))


def _cli(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "analyze_gates.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd="/",
                          env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"))


def test_cli_writes_outputs_and_refuses_bad_input(setup, tmp_path):
    out = tmp_path / "report"
    r = _cli("--model", setup["sat"], "--data", setup["data"], "--seq-length", "16", "--max-sequences", "4",
             "--min-count", "1", "--output", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ("report.json", "layers.csv", "tokens.csv", "heatmap.png", "report.md"):
        assert (out / name).stat().st_size > 0, name
    report = json.load(open(out / "report.json"))
    assert report["sequences"] == 4 and set(report["perplexity"]) == {"gates", "zero", "mean"}
    assert len((out / "layers.csv").read_text().splitlines()) == 1 + 2 * KV
    assert (out / "report.md").read_text() in r.stdout and "| per-head mean |" in r.stdout

    for args, message in (
        (["--model", setup["res"]], "holds a ResFormer model; gate analysis needs a SATFormer export"),
        (["--model", str(tmp_path / "nothing")], "is not a Hugging Face model folder"),
        (["--model", setup["sat"], "--data", setup["data"], "--seq-length", "5000"], "fewer than one sequence"),
        (["--model", setup["sat"], "--data", str(tmp_path / "missing.jsonl")], "not found"),
        (["--model", setup["sat"], "--batch-size", "0"], "--batch-size must be at least 1"),
    ):
        r = _cli(*args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr[-2000:])
