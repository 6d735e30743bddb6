"""Every shell command in README.md and docs/*.md is classified, and the cheap ones run as typed (tests/doc_commands.py
has the rules); commands the tools print run as typed too.

    .venv/bin/python -m pytest -q tests/test_docs_commands.py      # about 1.5 minutes on 2 cores

  * every command matches a rule, every rule a command, and each COVERED rule names a test that exists;
  * the RUN commands, from a scratch folder: the shell ones by bash (a heredoc, `cp "$(...)"`, `x=$(...)`) first,
    then the Python ones in one interpreter (tests/doc_batch.py): `--help`, `--print-config`, plan-layout (plan,
    --search, --all, --json), submit-grid --dry-run, the dry runs, param_counts; each exits 0 with its output;
  * the one-liner the trainer prints for GPT-2's vocab.json + merges.txt makes a tokenizer the trainer reads.
  * every relative link and figure of the pages exists inside the repository.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest
import tokenizers
from doc_commands import KINDS, PAGES, RULES, classify, commands

from megatron_sat.data.tokenizer import load_tokenizer
from megatron_sat.training.arguments import parse_args
from megatron_sat.training.planner import resolve_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_COMMAND = re.compile(r"^(python |megatron-sat-[a-z-]+ )")


def _env():
    """python and the console scripts of this venv first on PATH, as an activated venv has them."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("MSAT_SITE", None)
    return env


def _runnable():
    return [c for c in commands() if classify(c).kind == "RUN"]


def test_every_command_is_classified_and_every_rule_used():
    found = commands()
    assert len(found) > 100, len(found)  # the extraction reads the pages (fenced and indented blocks)
    missing = [str(c) for c in found if classify(c) is None]
    assert not missing, ("docs commands no rule of tests/doc_commands.py classifies (add one: docs/development.md):\n"
                         + "\n".join(missing))
    used = {id(classify(c)) for c in found}
    stale = [r.pattern for r in RULES if id(r) not in used]
    assert not stale, f"rules that match no docs command (the command changed or is gone): {stale}"
    assert {r.kind for r in RULES} <= set(KINDS)
    for r in RULES:
        if r.kind == "COVERED":  # the named test exists
            path, name = r.why.split("::")
            source = open(os.path.join(ROOT, path)).read()
            assert re.search(rf"^def {name}\(", source, re.M), f"{r.why} (covering {r.pattern!r}) is not a test"
        else:
            assert r.why.strip(), r  # the reason it is not run here


def test_the_extraction_joins_continuations_loops_and_heredocs_and_drops_comments_and_prompts():
    text = {c.text for c in commands()}
    assert ("megatron-sat-plan-layout --search --cluster 2x8xH100 --arch transformer --num-layers 24 --hidden-size "
            "2048 --num-attention-heads 16 --seq-length 4096 --vocab-size 131072 --global-batch-size 256 --json") in text
    assert "python -m megatron_sat.train --help" in text  # its `# every flag` comment dropped
    (loop,) = [t for t in text if t.startswith("for arch in ")]
    assert loop.endswith("\ndone") and "--save runs/cpu_eval/$arch" in loop
    (heredoc,) = [t for t in text if t.startswith("cat > exp.yaml")]
    assert heredoc.splitlines()[-1] == "EOF" and "hidden-size: 96" in heredoc
    assert not [t for t in text if t.startswith(("$ ", "#")) or ": error:" in t]


@pytest.mark.slow  # half a minute to a few (the machine's load): the classification above stays in test-fast
def test_the_cheap_commands_run_as_typed(tmp_path):
    runnable = _runnable()
    shell = [c for c in runnable if not PYTHON_COMMAND.match(c.text)]
    python = [c for c in runnable if PYTHON_COMMAND.match(c.text)]
    assert len(shell) >= 3 and len(python) >= 10, (shell, python)
    start = time.time()
    for c in shell:
        proc = subprocess.run(["bash", "-e", "-c", c.text], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, f"{c}\n{proc.stdout}{proc.stderr}"
    assert (tmp_path / "site.sh").is_file() and "hidden-size: 96" in (tmp_path / "exp.yaml").read_text()
    (tmp_path / "commands.json").write_text(json.dumps([c.text for c in python]))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "doc_batch.py"), "commands.json",
                           "results.json"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    for c, r in zip(python, results):
        assert r["code"] == 0, f"{c}\nexit {r['code']}\n{r['stdout'][-2000:]}{r['stderr'][-3000:]}"
        assert r["stdout"].strip() or ">" in shlex.split(c.text), f"{c}: printed nothing"
        print(f"{r['seconds']:6.1f} s  {c}")
    print(f"{time.time() - start:.0f} s in all")
    by_text = {c.text: r for c, r in zip(python, results)}
    # what each printed is the thing its page promises
    assert "--print-config" in by_text["python -m megatron_sat.train --help"]["stdout"]
    assert all("status OK" in r["stdout"] for t, r in by_text.items() if "dry_run.py" in t or "dry-run --recipe" in t)
    resolved = resolve_args(None, ["--config", str(tmp_path / "run.yaml")])  # --print-config's file is a config file
    assert (resolved.recipe, resolved.data_path, resolved.tokenizer_model) == ("satformer_760M", ["DATA"], "TOK")
    search = json.loads(by_text[next(t for t in by_text if t.endswith("--json"))]["stdout"])
    assert search["cluster"] == "2x8xH100" and search["layouts"]


def test_the_gpt2_conversion_the_trainer_prints_runs_as_typed(tmp_path, capsys):
    """transformers 5's GPT2TokenizerFast(vocab_file, merges_file).save_pretrained saved a one-token tokenizer; the
    printed tokenizers one-liner keeps GPT-2's vocabulary and its <|endoftext|>."""
    trainer = tokenizers.ByteLevelBPETokenizer()  # a GPT-2 format vocab.json + merges.txt, made here (no download)
    text = ["the quick brown fox jumps over the lazy dog, then the dog sleeps; " * 4 + str(i) for i in range(200)]
    trainer.train_from_iterator(text, vocab_size=300, special_tokens=["<|endoftext|>"])
    trainer.save_model(str(tmp_path))
    with pytest.raises(SystemExit) as e:
        parse_args(["--arch", "satformer", "--mock-data", "--vocab-size", "64", "--print-config",
                    "--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    (one_liner,) = re.findall(r"python -c \"[^\"]+\"", err)
    typed = one_liner.replace("'VOCAB'", "'vocab.json'").replace("'MERGES'", "'merges.txt'")
    proc = subprocess.run(["bash", "-c", typed], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--tokenizer-model tokenizer.json" in err
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))  # as the trainer reads --tokenizer-model
    assert tok.vocab_size == len(vocab) > 100 and tok.eod == vocab["<|endoftext|>"]
    sample = "the lazy fox sleeps"
    ids = tok.encode(sample + "<|endoftext|>")
    assert ids[-1] == tok.eod and len(ids) < len(sample) and tok.decode(ids[:-1]) == sample


def test_every_relative_link_resolves_inside_the_repository():
    """The docs' links and figures open in a checkout and on the repository's web view: each relative target exists
    and lies inside the repository (no `../shared` of a development machine)."""
    bad = []
    for page in PAGES:
        for number, line in enumerate(open(os.path.join(ROOT, page)), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if target.startswith(("http://", "https://", "#", "mailto:")):
                    continue
                path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target.split("#")[0]))
                if not os.path.exists(path) or os.path.relpath(path, ROOT).startswith(".."):
                    bad.append(f"{page}:{number}: {target}")
            if "../shared" in line:
                bad.append(f"{page}:{number}: ../shared")
    assert not bad, bad
