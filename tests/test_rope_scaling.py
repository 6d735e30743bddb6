"""Llama 3.1+ RoPE scaling (rope_type llama3): imported, trained and exported back, equal to transformers' own logits
at positions past the original context; what an import writes and prints; the refusals.

    pytest -q tests/test_rope_scaling.py          # 55 s on 2 busy cores (load 4), 32 s of CPU

One worker process (tests/workers/rope_scaling.py: a tiny Llama whose RoPE is scaled with original context 32,
factor 4, low 1, high 4, through import, the import's printed next step, 2 training steps at 112 positions and
export) and one transformers 4.x process on its export. Real transformers and megatron-core throughout. Tolerance:
logits relative max 1e-5 (fp32); the same weights without the scaling differ by far more.
"""

import os
import re
import subprocess
import sys

import pytest
import torch
from closeness import SAME_LOGITS, rel_max

from megatron_sat.conversion.mapping import spec_from_hf_config
from megatron_sat.model.args import ModelArgs, rope_scaling_errors
from megatron_sat.training.arguments import parse_args

pytestmark = pytest.mark.slow  # an import, a training step and an export in a subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "workers", "rope_scaling.py")
sys.path.insert(0, os.path.join(HERE, "workers"))
from rope_scaling import LLAMA, POSITIONS, REFUSED, SCALING, SEQ, VOCAB  # noqa: E402

TRANSFORMERS4 = os.path.join(sys.prefix, "transformers4")  # make venv: transformers 4.57.1 installed aside


def _env():
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """The worker's results; beside it, the transformers 4.x process (its imports overlap the worker's run; it
    measures the export once the worker has written result.pt)."""
    root = str(tmp_path_factory.mktemp("rope"))
    t4 = None
    if os.path.isdir(TRANSFORMERS4):
        t4 = subprocess.Popen([sys.executable, WORKER, "t4", TRANSFORMERS4, os.path.join(root, "t4.pt"),
                               os.path.join(root, "hf_run")], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        proc = subprocess.run([sys.executable, WORKER, "run", root], env=_env(), capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        out = dict(root=root, **torch.load(os.path.join(root, "result.pt"), weights_only=False))
        if t4 is not None:
            log = t4.communicate(timeout=300)[0]
            assert t4.returncode == 0, log[-4000:]
            out["t4"] = torch.load(os.path.join(root, "t4.pt"), weights_only=False)
        return out
    finally:
        if t4 is not None and t4.poll() is None:
            t4.kill()


def test_import_train_export_match_transformers_past_the_original_context(done):
    """Megatron's import (and the SATFormer started from it, zero gate) computes transformers' logits at 3.5x the
    original context; after 2 steps the export computes the trained Megatron model's; both configs say so."""
    reference = done["reference"]
    assert reference.shape[1] == SEQ > 3 * SCALING["original_max_position_embeddings"]
    assert rel_max(done["unscaled"], reference) > 1e-2, "the scaling does not change the logits: the test sees nothing"
    assert rel_max(done["imported"], reference) <= SAME_LOGITS
    assert rel_max(done["satformer"], reference) <= SAME_LOGITS
    assert rel_max(done["exported"], done["trained"]) <= SAME_LOGITS
    assert rel_max(done["trained"], reference) > 1e-4, "2 training steps changed nothing"
    model = done["import_config"]["model"]
    assert (model["use_rope_scaling"], model["rope_scaling_factor"], model["rope_scaling_low_freq_factor"],
            model["rope_scaling_high_freq_factor"], model["rope_scaling_original_max_position_embeddings"]) == (
        True, 4.0, 1.0, 4.0, 32)
    cfg = done["export_config"]
    assert cfg["model_type"] == "llama" and cfg["max_position_embeddings"] == POSITIONS
    assert cfg["rope_scaling"] == SCALING  # transformers 4.x
    assert cfg["rope_parameters"] == dict(SCALING, rope_theta=LLAMA["rope_theta"])  # transformers 5.x
    assert "RoPE scaling (llama3) exports only as the Transformer" in done["sat_export"]


def test_frequencies_equal_transformers_at_llama_3_2s_values(done):
    """The scaled frequencies are transformers' own, bit for bit, with all four values away from Megatron-Core's fixed
    ones (factor 32, low 2, high 8, as Llama 3.2's factor); each band is there: kept, divided by 32, between."""
    f = done["llama32"]
    assert f["attention_factor"] == 1.0 and torch.equal(f["ours"], f["theirs"])
    kept, divided = f["ours"] == f["plain"], torch.isclose(f["ours"], f["plain"] / 32, rtol=1e-6, atol=0)
    assert kept.sum() and divided.sum() and (~kept & ~divided).sum(), (kept.sum(), divided.sum())


def test_export_under_transformers4(done):
    """The export read by transformers 4.x (its rope_scaling key) computes the same logits."""
    if not os.path.isdir(TRANSFORMERS4):
        if os.environ.get("CI") == "true":
            pytest.fail(f"{TRANSFORMERS4} is missing: make venv installs transformers 4.x there")
        pytest.skip(f"{TRANSFORMERS4} is missing (make venv)")
    got = done["t4"]
    assert got["version"].startswith("4.")
    assert rel_max(got["logits"], done["trained"]) <= SAME_LOGITS


def test_import_writes_placeholders_and_prints_the_next_step(done, tmp_path, capsys):
    """Without training flags, lr, train-iters and seq-length are placeholders (no value in config.json, a
    "placeholders" entry saying what to choose); the printed next step continues from the weights with a fresh
    optimizer, and a run on the config is refused until its command line gives them."""
    save = os.path.join(done["root"], "import")
    cfg = done["import_config"]
    assert set(cfg["placeholders"]) == {"lr", "train_iters", "seq_length"}
    assert not {"lr", "train_iters", "seq_length"} & set(cfg)
    assert cfg["max_position_embeddings"] == POSITIONS
    assert done["next"] == (f"python -m megatron_sat.train --config {save}/config.json --pretrained-checkpoint {save} "
                            "--save RUN --data-path DATA --lr LR --train-iters TRAIN_ITERS --seq-length SEQ_LENGTH")
    assert done["next"] in "\n".join(done["import_log"])
    assert "--load" not in "\n".join(done["import_log"])
    base = ["--config", f"{save}/config.json", "--pretrained-checkpoint", save, "--save", str(tmp_path / "r"),
            "--mock-data", "--vocab-size", str(VOCAB)]
    with pytest.raises(SystemExit) as e:
        parse_args([*base, "--lr", "1e-4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "training settings are placeholders: give" in err and "--train-iters (" in err and "--seq-length (" in err
    assert "--lr (" not in err
    with pytest.raises(SystemExit):
        parse_args([*base, "--lr", "1e-4", "--train-iters", "2", "--seq-length", str(POSITIONS + 1)])
    assert f"--max-position-embeddings {POSITIONS} is below --seq-length" in capsys.readouterr().err
    # given to the import, they are the user's
    sat = done["sat_config"]
    assert (sat["placeholders"], sat["lr"], sat["train_iters"], sat["seq_length"]) == ({}, 3e-5, 5, SEQ)
    assert sat["arch"] == "satformer" and sat["use_rope_scaling"]


def test_rope_types_both_transformers_spellings_and_refusals(done):
    """transformers 4.x (rope_scaling) and 5.x (rope_parameters) spellings give one model; yarn, dynamic and linear
    scaling, a llama3 entry without its numbers and bad numbers are refused in one line (the worker's import_hf, on
    folders that hold only config.json), and the tool exits 2 with nothing written."""
    four = spec_from_hf_config(dict(LLAMA, model_type="llama", rope_scaling=SCALING))
    five = spec_from_hf_config(dict(LLAMA, model_type="llama", rope_parameters=dict(SCALING, rope_theta=5e5)))
    assert four.use_rope_scaling and four.rope_scaling_original_max_position_embeddings == 32
    assert four.to_dict() == dict(five.to_dict(), rotary_base=10000.0)
    assert not spec_from_hf_config(dict(LLAMA, model_type="llama")).use_rope_scaling
    expected = {
        "yarn": r"rope_type 'yarn' \(supported: 'default' and 'llama3'",
        "dynamic": "rope_type 'dynamic'",
        "linear": "rope_type 'linear'",
        "llama3 without its numbers": "rope_type 'llama3' without low_freq_factor, high_freq_factor, original_max",
        "factor below 1": r"--rope-scaling-factor must be >= 1 \(got 0.5\)",
        "low not below high": r"need 0 < --rope-scaling-low-freq-factor \(4.0\) < --rope-scaling-high-freq-factor "
                              r"\(4.0\)",
        "no original context": r"--rope-scaling-original-max-position-embeddings must be > 0 \(got 0\)",
    }
    refused = done["refused"]
    assert set(expected) == set(REFUSED) and set(expected) <= set(refused), refused
    for case, pattern in expected.items():
        assert re.search(pattern, refused[case]) and "\n" not in refused[case], (case, refused[case])
    assert (refused["tool exit"], refused["written"]) == (2, False)


def test_trainer_flags_and_their_checks(tmp_path, capsys):
    """The five ModelArgs fields are the trainer's flags (Llama 3.1's values by default); bad values exit 2, one
    line each in one refusal."""
    assert (ModelArgs().use_rope_scaling, ModelArgs().rope_scaling_factor) == (False, 8.0)
    assert rope_scaling_errors(ModelArgs()) == []
    base = ["--arch", "transformer", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--train-iters", "1", "--mock-data", "--vocab-size", "64", "--save", str(tmp_path / "r")]
    args = parse_args([*base, "--use-rope-scaling", "--rope-scaling-factor", "32"])
    assert (args.use_rope_scaling, args.rope_scaling_factor, args.rope_scaling_original_max_position_embeddings) == (
        True, 32.0, 8192)
    with pytest.raises(SystemExit) as e:
        parse_args([*base, "--use-rope-scaling", "--rope-scaling-factor", "0.5",
                    "--rope-scaling-low-freq-factor", "4", "--rope-scaling-high-freq-factor", "2",
                    "--rope-scaling-original-max-position-embeddings", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    for part in ("--rope-scaling-factor must be >= 1 (got 0.5)", "need 0 < --rope-scaling-low-freq-factor (4.0) < "
                 "--rope-scaling-high-freq-factor (2.0)", "--rope-scaling-original-max-position-embeddings must be > 0"):
        assert part in err, err
