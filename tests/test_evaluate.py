"""tools/evaluate.py (megatron_sat/analysis/evaluation.py): lm-eval on an export, offline.

    pytest -q tests/test_evaluate.py            # about 90 s on 2 cores

A tiny SATFormer export (random weights, written with the converter's own writer, word-level
tokenizer) is evaluated by lm-eval 0.4.13 on the local tasks in tests/data/eval/ (a multiple-choice
loglikelihood task and a generate_until task over tiny.jsonl); the accuracy is recomputed here
from the model's logits. The bundled based_* recall tasks are checked for their protocol, and one of
them runs on tiny_recall.jsonl, its `contains` score recomputed from the model's greedy generations. The
megatron_sat backend (tools/evaluate.py --checkpoint) is checked on trainer checkpoints of all six archs
(tests/workers/lm_eval_backend.py). Skipped when lm-eval is not installed (pip install "lm-eval[hf]==0.4.13").
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

from dist_utils import run_distributed  # noqa: E402
from lm_eval.tasks._yaml_loader import load_yaml  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from megatron_sat.analysis.evaluation import (  # noqa: E402
    BUNDLED_TASKS,
    RETRIEVAL,
    SUITES,
    EvaluationError,
    evaluate,
    resolve_tasks,
)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TASKS = os.path.join(HERE, "data", "eval")
sys.path.insert(0, os.path.join(HERE, "workers"))
sys.path.insert(0, REPO)
from conversion import write_tiny_export  # noqa: E402

from tools.evaluate import main  # noqa: E402


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return write_tiny_export(str(tmp_path_factory.mktemp("eval") / "hf"), "satformer", num_layers=2)


def expected_accuracy(model_dir):
    """Multiple-choice accuracy from the model's own log-likelihoods (what lm-eval should compute)."""
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
                        "--tasks", "megatron_sat_tiny_mc", "megatron_sat_tiny_gen", "no_such_task", "--skip-missing",
                        "--include-path", TASKS, "--device", "cpu", "--batch-size", "2", "--output", str(out)],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"),
                       timeout=600, cwd="/")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.load(open(out / "results.json"))
    assert summary["skipped"] == ["no_such_task"]
    rows = {(row["task"], row["metric"]): row["value"] for row in summary["table"]}
    assert rows[("megatron_sat_tiny_mc", "acc")] == pytest.approx(expected_accuracy(export), abs=1e-9)
    assert ("megatron_sat_tiny_gen", "exact_match") in rows
    assert summary["n_samples"]["megatron_sat_tiny_gen"]["effective"] == 6
    assert summary["averages"]["all"]["complete"] is False  # no_such_task did not run
    md = (out / "results.md").read_text()
    assert "| megatron_sat_tiny_mc | acc |" in md and "Skipped" in md and md in r.stdout


def test_unknown_tasks_refused():
    assert RETRIEVAL == ["swde", "fda", "squad_completion", "based_triviaqa", "based_nq_2048", "based_drop"]
    assert set(SUITES) == {"retrieval", "zeroshot"}
    specs, _, skipped = resolve_tasks(RETRIEVAL, [], skip_missing=False)  # the based_* tasks are bundled
    assert specs == RETRIEVAL and skipped == []
    with pytest.raises(EvaluationError, match="no_such_task.*--include-path"):
        resolve_tasks(["swde", "no_such_task"], [TASKS], skip_missing=False)
    specs, _, skipped = resolve_tasks(["swde", "megatron_sat_tiny_mc", "no_such_task"], [TASKS], skip_missing=True,
                                      log=lambda *a: None)
    assert skipped == ["no_such_task"] and specs[0] == "swde"
    local = specs[1]
    assert local["task"] == "megatron_sat_tiny_mc"
    assert local["dataset_kwargs"]["data_files"]["test"] == os.path.join(TASKS, "tiny.jsonl")


def _bundled(task):
    return load_yaml(os.path.join(BUNDLED_TASKS, task + ".yaml"), resolve_func=True)


def test_based_recall_protocol():
    """The bundled based_* configs: hub data set, prompt, 0-shot greedy answer to a newline, contains metric."""
    configs = {t: _bundled(t) for t in ("based_triviaqa", "based_nq_2048", "based_drop")}
    for task, cfg in configs.items():
        assert cfg["task"] == task and cfg["dataset_path"] == "hazyresearch/" + task
        assert cfg["validation_split"] == "validation" and cfg["output_type"] == "generate_until"
        assert cfg["generation_kwargs"] == {"until": ["\n"], "max_gen_toks": 48, "do_sample": False}
        assert cfg["metric_list"] == [{"metric": "contains", "aggregation": "mean", "higher_is_better": True}]
    trivia, drop = configs["based_triviaqa"], configs["based_drop"]
    doc = {"context": "[DOC] [TLE] Paris [PAR] Paris is the capital of France. The capital of France is",
           "question": "The capital of France is", "answers": ["Paris", "paris, france"]}
    assert trivia["doc_to_text"](doc) == "Paris  Paris is the capital of France. The capital of France is"
    assert drop["doc_to_text"](doc).startswith("[DOC] [TLE] Paris [PAR]")  # markers are TriviaQA's only
    repeated = {"context": "He scored 3 goals. How many goals", "question": "how many goals",  # cut, any case
                "answers": ["3"]}
    assert drop["doc_to_text"](repeated) == "He scored 3 goals. how many goals"
    assert drop["doc_to_target"](repeated) == " 3" and drop["doc_to_target"](dict(repeated, answers=[])) == \
        " unanswerable"
    score = lambda gen, answers: drop["process_results"]({"answers": answers}, [gen])  # noqa: E731
    assert score(" PARIS, the city", ["Paris"]) == {"contains": 1}
    assert score(" Lyon", ["Paris", "Marseille"]) == {"contains": 0}
    assert score(" 3.5 (approx)", ["3.5 (approx)"]) == {"contains": 1}  # answers are literal text, not regexes
    assert score(" 305", ["3.5"]) == {"contains": 0}
    assert score(" anything", []) == {"contains": 0}


def test_based_recall_offline(export, tmp_path):
    """based_triviaqa on a local copy of its data (a YAML that includes the bundled one), scored by lm-eval and
    recomputed here from the model's own greedy generations."""
    data = os.path.join(TASKS, "tiny_recall.jsonl")
    shutil.copy(data, tmp_path / "recall.jsonl")
    (tmp_path / "local_trivia.yaml").write_text(  # the README's example: data_files relative to the YAML
        f"include: {os.path.join(BUNDLED_TASKS, 'based_triviaqa.yaml')}\ntask: tiny_based_triviaqa\n"
        "dataset_path: json\ndataset_kwargs: {data_files: {validation: recall.jsonl}}\n")
    summary = evaluate(export, ["tiny_based_triviaqa"], include_paths=[str(tmp_path)], batch_size=1,
                       log=lambda *a: None)
    rows = {(r["task"], r["metric"]): r["value"] for r in summary["table"]}

    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=torch.float32).eval()
    prompt, hits = _bundled("based_triviaqa")["doc_to_text"], []
    for line in open(data):
        doc = json.loads(line)
        ids = torch.tensor([tok(prompt(doc))["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=0, pad_token_id=0)
        generation = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        hits.append(any(a.lower() in generation.lower() for a in doc["answers"]))
    assert summary["n_samples"]["tiny_based_triviaqa"]["effective"] == 4
    assert rows[("tiny_based_triviaqa", "contains")] == pytest.approx(sum(hits) / len(hits), abs=1e-9)


@pytest.mark.slow  # a launch building every arch
def test_checkpoint_backend(tmp_path):
    """The megatron_sat backend on trainer checkpoints of all six archs (tests/workers/lm_eval_backend.py):
    its loglikelihoods (batched, right-padded, one left-truncated), rolling loglikelihood and greedy generations
    equal direct unpadded forwards of the saved model; tools/evaluate.py --checkpoint and evaluate(checkpoint=)
    give finite scores, equal to lm-eval's HF backend on the export for the archs that have one."""
    out = run_distributed(os.path.join(HERE, "workers", "lm_eval_backend.py") + ":check_all_archs", 1,
                          str(tmp_path), timeout=900)[0]
    assert out["registered"]
    for arch in ("transformer", "resformer", "satformer", "denseformer", "muddformer", "hyperconnections"):
        res = out[arch]
        for (logp, greedy), (ref, ref_greedy) in zip(res["ll"], res["ll_ref"]):
            assert logp == pytest.approx(ref, rel=1e-5, abs=1e-5), arch
            assert greedy == ref_greedy, arch
        assert res["rolling"] == pytest.approx(res["rolling_ref"], rel=1e-5), arch
        assert res["gens"] == res["gens_ref"] and all(res["gens"]), arch
        scores = {(r["task"], r["metric"]): r["value"] for r in res["scores"]}
        assert set(scores) >= {("megatron_sat_tiny_mc", "acc"), ("megatron_sat_tiny_gen", "exact_match")}, arch
        assert all(0.0 <= v <= 1.0 for v in scores.values()), (arch, scores)
        if "hf_scores" in res:
            assert scores == {(r["task"], r["metric"]): r["value"] for r in res["hf_scores"]}, arch
            assert res["gens"] == res["hf_gens"], arch  # lm-eval's HF backend on the export, the same requests
            for (logp, greedy), (ref, ref_greedy) in zip(res["text_ll"], res["hf_ll"]):
                assert logp == pytest.approx(ref, rel=1e-5) and greedy == ref_greedy, arch
    assert {a for a, res in out.items() if isinstance(res, dict) and "hf_scores" in res} >= {"transformer",
                                                                                             "satformer"}
    assert out["denseformer"]["cli_code"] == 0


def test_checkpoint_cli_refusals(export, tmp_path, capsys):
    """--model and --checkpoint: exactly one; each refuses the other's kind of folder (exit 2, before any model)."""
    for argv, message in (
            (["--tasks", "x"], "one of the arguments --model --checkpoint is required"),
            (["--model", export, "--checkpoint", export, "--tasks", "x"], "not allowed with argument"),
            (["--checkpoint", str(tmp_path / "none"), "--tasks", "x"], "is not a folder"),
            (["--checkpoint", export, "--tasks", "x"], f"is a Hugging Face folder: pass it as --model {export}"),
            (["--checkpoint", str(tmp_path), "--tasks", "x", "--output", str(tmp_path / "iter_0000002" / "e")],
             "lies inside --checkpoint"),
            (["--model", export, "--tasks", "x", "--tensor-model-parallel-size", "2"], "needs --checkpoint"),
            (["--checkpoint", str(tmp_path), "--tasks", "x", "--tensor-model-parallel-size", "2"],
             "needs exactly that many processes (torchrun --nproc-per-node 2); this launch has 1")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--checkpoint", str(empty), "--tasks", "megatron_sat_tiny_mc", "--include-path", TASKS]) == 2
    assert f"{empty} has no latest_checkpointed_iteration.txt" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()  # refused before megatron_sat set anything up
