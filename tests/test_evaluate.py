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

import glob
import inspect
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

from closeness import LOGLIKELIHOOD, ROLLING  # noqa: E402
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

from megatron_sat.analysis import lm_eval_cli  # noqa: E402
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
    # run from / (the tasks read their data beside their YAML); lm-eval's note on a custom dataset loader is one of
    # the known harmless messages filtered (compat/known_warnings.py)
    assert "Custom kwargs" not in r.stderr and "Warning" not in r.stderr, r.stderr
    summary = json.load(open(out / "results.json"))
    assert summary["skipped"] == ["no_such_task"]
    rows = {(row["task"], row["metric"]): row["value"] for row in summary["table"]}
    assert rows[("megatron_sat_tiny_mc", "acc")] == pytest.approx(expected_accuracy(export), abs=1e-9)
    assert ("megatron_sat_tiny_gen", "exact_match") in rows
    assert summary["n_samples"]["megatron_sat_tiny_gen"]["effective"] == 6
    assert summary["averages"]["all"]["complete"] is False  # no_such_task did not run
    md = (out / "results.md").read_text()
    assert "| megatron_sat_tiny_mc | acc |" in md and "Skipped" in md and md in r.stdout


def _lm_eval_results(folder):
    """{(task, metric): value} of the one results_<time>.json lm-eval wrote under folder/<model name>/."""
    (path,) = glob.glob(os.path.join(folder, "*", "results_*.json"))
    results = json.load(open(path))["results"]
    return {(t, k.split(",")[0]): v for t, m in results.items() for k, v in m.items()
            if "," in k and "_stderr" not in k and isinstance(v, (int, float))}


@pytest.mark.slow  # lm-eval's CLI indexes every task of lm-eval (as lm_eval itself does), plus a second evaluation
def test_lm_eval_form_as_typed(export, tmp_path, monkeypatch, capsys):
    """megatron-sat-evaluate with lm-eval's command line (run subcommand, short options, space-separated
    --model_args), run from another folder than the tasks': lm-eval's own CLI runs it, with the scores of this
    project's form on the same tasks."""
    # from a folder other than the tasks': the test tasks read their data beside their YAML (tiny_data.beside), so
    # lm-eval's own loader finds tiny.jsonl from any working folder
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "lm_eval"
    assert main(["run", "-b", "2", "-o", str(out), "--model", "hf", "--model_args", f"pretrained={export}",
                 "trust_remote_code=True", "-t", "megatron_sat_tiny_mc,megatron_sat_tiny_gen", "--include_path", TASKS,
                 "--device", "cpu", "-s", "--seed", "1234", "--gen_kwargs", "max_gen_toks=3", "-L", "6",
                 "-f", "0"]) == 0
    assert "|megatron_sat_tiny_mc" in capsys.readouterr().out.replace(" ", "")  # lm-eval's own table
    scores = _lm_eval_results(out)
    today = evaluate(export, ["megatron_sat_tiny_mc", "megatron_sat_tiny_gen"], include_paths=[TASKS], batch_size=2,
                     log=lambda *a: None)
    assert scores == {(r["task"], r["metric"]): r["value"] for r in today["table"]}
    assert scores[("megatron_sat_tiny_mc", "acc")] == pytest.approx(expected_accuracy(export), abs=1e-9)
    assert len(glob.glob(os.path.join(out, "*", "samples_megatron_sat_tiny_mc_*.jsonl"))) == 1  # -s


def test_lm_eval_form_refusals(export, tmp_path, capsys):
    """megatron_sat --model_args: unknown keys and a missing checkpoint are one line, exit 2 (before any model);
    the project's form refuses --model_args keys it would not read."""
    for argv, message in (
            (["run", "--model", "megatron_sat", "--model_args", f"checkpoint={tmp_path}", "pretrained=x", "-t", "t"],
             "--model_args pretrained: not an argument of the megatron_sat backend; it takes checkpoint, dtype"),
            (["--model", "megatron_sat", "--model_args", "dtype=float32", "-t", "t"],
             "--model megatron_sat needs --model_args checkpoint=RUN")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(SystemExit) as e:
        main(["--model", "hf", "--model_args", f"pretrained={export},revision=x", "--tasks", "t", "--output",
              str(tmp_path / "o")])
    assert e.value.code == 2 and "--model_args revision: this form reads only pretrained" in capsys.readouterr().err
    from megatron_sat.analysis.lm_eval_backend import MegatronLM  # torch, megatron-core: only here
    from megatron_sat.analysis.lm_eval_registration import MODEL_ARGS

    with pytest.raises(ValueError, match="unknown model argument.s. bogus; it takes checkpoint"):  # plain lm_eval
        MegatronLM(checkpoint=str(tmp_path), bogus=1)
    params = set(inspect.signature(MegatronLM).parameters) - {"model", "tokenizer", "unknown"}
    assert params == set(MODEL_ARGS)
    assert lm_eval_cli._checkpoint_as_model_args(["run", "--checkpoint", "R", "-t", "x"]) == \
        ["run", "-t", "x", "--model", "megatron_sat", "--model_args", "checkpoint=R"]
    with pytest.raises(SystemExit) as e:  # lm-eval's own parser answers: every flag of lm-eval's run
        main(["run", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--apply_chat_template", "--gen_kwargs", "--write_out", "--use_cache", "--wandb_args",
                 "--trust_remote_code", "-b", "-o", "-s", "-L", "-f", "-C"):
        assert f"{flag} " in help_text or f"{flag}," in help_text, flag
    own = ("--checkpoint", "--output")
    assert lm_eval_cli.is_lm_eval_form(["run", "--checkpoint", "R"], own)
    assert not lm_eval_cli.is_lm_eval_form(["--checkpoint", "R", "--tasks", "x"], own)
    assert not lm_eval_cli.is_lm_eval_form(["--model", export, "--tasks", "x"], own)
    assert lm_eval_cli.is_lm_eval_form(["--model", "hf", "--tasks", "x"], own)
    assert not lm_eval_cli.is_lm_eval_form(["--model", "no/such/dir", "--tasks", "x"], own)  # ours: a clear refusal


@pytest.mark.slow  # lm-eval's CLI indexes every task of lm-eval before it builds the model
def test_plain_lm_eval_refuses_a_missing_or_torn_checkpoint_in_one_line(tmp_path, capsys, monkeypatch):
    """`lm_eval --model megatron_sat --model_args checkpoint=MISSING` as typed, and a run folder holding only a torn
    iter_XXXXXXX.tmp built the way lm-eval's CLI builds the model (create_from_arg_string, with its CLI loaded): one
    line (no traceback), exit 2, nothing written; from Python (no CLI) the same message is a ConversionError."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    missing, out = tmp_path / "MISSING", tmp_path / "out"
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "lm_eval"), "--model", "megatron_sat",
                        "--model_args", f"checkpoint={missing}", "--tasks", "megatron_sat_tiny_mc", "--include_path",
                        TASKS, "-o", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert errors == [f"error: --model_args checkpoint={missing}: checkpoint {missing} does not exist"], errors
    assert not out.exists()
    from megatron_sat.analysis.lm_eval_backend import MegatronLM  # torch, megatron-core: only here
    from megatron_sat.conversion.mapping import ConversionError

    run = tmp_path / "run"
    (run / "iter_0000005.tmp").mkdir(parents=True)
    (run / "iter_0000005.tmp" / "common.pt").write_bytes(b"torn")
    torn = (f"{run} has no latest_checkpointed_iteration.txt and is not a checkpoint folder (only unfinished "
            "checkpoints: iter_0000005.tmp; wait for the save to finish)")
    import lm_eval._cli  # noqa: F401  (loaded by an earlier lm-eval use in this process: still a Python caller)

    from megatron_sat.analysis import lm_eval_cli

    with pytest.raises(ConversionError, match="only unfinished checkpoints: iter_0000005.tmp"):
        MegatronLM.create_from_arg_string(f"checkpoint={run}")  # from Python: the exception, for the caller
    monkeypatch.setattr(lm_eval_cli, "RUNNING", True)  # as while megatron-sat-evaluate's lm-eval form runs lm-eval
    with pytest.raises(SystemExit) as e:
        MegatronLM.create_from_arg_string(f"checkpoint={run}")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().splitlines() == [f"error: --model_args checkpoint={run}: {torn}"], err
    assert sorted(os.listdir(run)) == ["iter_0000005.tmp"]  # nothing written, nothing removed


@pytest.mark.slow  # validate indexes every task of lm-eval
def test_lm_evals_ls_and_validate_forms_go_to_lm_eval(capsys):
    """megatron-sat-evaluate `ls` and `validate` (lm-eval 0.4.13's other subcommands) are lm-eval's form, with or
    without the project's flag names after them; `validate` answers as lm-eval does (exit 0 for a known task, with
    the bundled task folder searched)."""
    own = ("--checkpoint", "--output")
    for argv in (["ls", "tasks"], ["ls", "models"], ["validate", "--tasks", "x"], ["validate", "--tasks", "x",
                                                                                  "--output", "o"]):
        assert lm_eval_cli.is_lm_eval_form(argv, own), argv
    assert not lm_eval_cli.is_lm_eval_form(["lss", "tasks"], own) and not lm_eval_cli.is_lm_eval_form(
        ["--checkpoint", "R", "--tasks", "validate"], own)
    assert main(["validate", "--tasks", "based_drop,megatron_sat_tiny_mc", "--include_path", TASKS]) == 0
    assert "Validating tasks: ['based_drop', 'megatron_sat_tiny_mc']" in capsys.readouterr().out


def test_help_imports_no_torch():
    """evaluate --help answers without torch or lm-eval (the device default is chosen after parsing); and an
    interpreter of this install starts without importing lm-eval, while lm-eval's registry, once imported, knows
    the megatron_sat backend (megatron_sat_lm_eval.pth, lm_eval_registration.py) without importing it."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tools.evaluate import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'lm_eval' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, REPO], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "megatron-sat-evaluate run --help" in r.stdout, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False False"
    code = ("import sys; print('lm_eval' in sys.modules)\n"
            "from lm_eval.api.registry import model_registry as r\n"
            "print('megatron_sat' in r, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.stdout.split() == ["False", "True", "False"], \
        (r.stdout, r.stderr, "megatron_sat_lm_eval.pth missing from site-packages? reinstall: make venv")


def test_the_installed_package_never_shadows_a_checkout(tmp_path):
    """megatron_sat_lm_eval.pth (setup.py) imports a copy of lm_eval_registration.py, not the megatron_sat package:
    an interpreter of this venv starts without megatron_sat in sys.modules, so `python -m megatron_sat.X` in another
    checkout (here a copy of this one's package, changed) runs that checkout's code, and lm-eval's registry still
    knows the backend there."""
    import sysconfig

    with open(os.path.join(sysconfig.get_paths()["purelib"], "megatron_sat_lm_eval.pth")) as f:
        assert "megatron_sat." not in f.read()  # the hook module is top-level: no package import at start-up
    copy = tmp_path / "checkout"
    shutil.copytree(os.path.join(REPO, "megatron_sat"), copy / "megatron_sat",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "megatron_sat" / "which_checkout.py").write_text("import megatron_sat\nprint(megatron_sat.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "megatron_sat.which_checkout"], cwd=copy, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == str(copy / "megatron_sat" / "__init__.py"), (r.stdout, r.stderr)
    code = ("import sys; print(any(m.split('.')[0] == 'megatron_sat' for m in sys.modules))\n"
            "from lm_eval.api.registry import model_registry as r\n"
            "print('megatron_sat' in r, 'megatron_sat' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "True", "False"], (r.stdout, r.stderr)


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
            assert logp == pytest.approx(ref, **LOGLIKELIHOOD), arch
            assert greedy == ref_greedy, arch
        assert res["rolling"] == pytest.approx(res["rolling_ref"], **ROLLING), arch
        assert res["gens"] == res["gens_ref"] and all(res["gens"]), arch
        scores = {(r["task"], r["metric"]): r["value"] for r in res["scores"]}
        assert set(scores) >= {("megatron_sat_tiny_mc", "acc"), ("megatron_sat_tiny_gen", "exact_match")}, arch
        assert all(0.0 <= v <= 1.0 for v in scores.values()), (arch, scores)
        if "hf_scores" in res:
            assert scores == {(r["task"], r["metric"]): r["value"] for r in res["hf_scores"]}, arch
            assert res["gens"] == res["hf_gens"], arch  # lm-eval's HF backend on the export, the same requests
            for (logp, greedy), (ref, ref_greedy) in zip(res["text_ll"], res["hf_ll"]):
                assert logp == pytest.approx(ref, **ROLLING) and greedy == ref_greedy, arch
    assert {a for a, res in out.items() if isinstance(res, dict) and "hf_scores" in res} >= {"transformer",
                                                                                             "satformer"}
    assert out["denseformer"]["cli_code"] == 0
    # plain lm-eval, as typed, on a run folder of the launch, from a folder other than the tasks': the backend found
    # through the installed .pth (megatron_sat_lm_eval.pth), the scores of evaluate(checkpoint=)
    lm_eval = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "lm_eval"), "--model", "megatron_sat", "--model_args",
         f"checkpoint={tmp_path / 'transformer'}", "--tasks", "megatron_sat_tiny_mc,megatron_sat_tiny_gen",
         "--include_path", TASKS, "-b", "2", "-o", str(tmp_path / "plain")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,  # another folder than the tasks'
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")})
    assert lm_eval.returncode == 0, lm_eval.stdout[-3000:] + lm_eval.stderr[-3000:]
    assert "Transformer Engine and Apex are not installed" not in lm_eval.stderr, lm_eval.stderr  # known, filtered
    assert _lm_eval_results(tmp_path / "plain") == {(r["task"], r["metric"]): r["value"]
                                                    for r in out["transformer"]["scores"]}


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
