"""BF16 training state saved and restored whole, the DP gradient reduction dtype, and a bf16 export's dtype.

The trainer through its command line, the small SATFormer of tests/test_train_run.py (TINY) with --bf16:

  A  1 process, --bf16, checkpoints at 3 and 6                         -> the bf16 reference
  B  1 process, --load A --ckpt-step 3, steps 4-6: the same layout     -> A's losses and grad norms exactly, and
     the step-6 checkpoint bit for bit A's: the fp32 main parameters, Adam's moments and the bf16 weights
  G  2 processes DP2 with the distributed optimizer, --accumulate-allreduce-grads-in-fp32, steps 1-3; then
     1 process resumes it (the sharded fp32 main parameters and moments regathered DP2 -> DP1), steps 4-6
                                                                        -> A's losses within 2**-8 (relative)
  R  2 processes DP2 with the distributed optimizer and --grad-reduce-in-bf16, steps 1-3
                                                                        -> G's losses within 2**-8, and a
     different gradient norm at step 1 (the reduction really ran in bf16)
  X  tools/convert_to_hf.py on A (--dtype auto): config.json records bfloat16 and transformers loads bfloat16
  F  1 process, --fp16 with a loss scale forced to overflow (--initial-loss-scale 2**18, --hysteresis 1: the
     per-token loss sum's logit gradients reach the scale, above fp16's 65504), checkpoints at 3, 6 and 8
                                                                        -> steps 1-6 skipped and counted
     (skipped_iters 1, no update, the LR schedule held at its start), the scale halved each time down to 4096,
     then steps 7-8 update
  E  1 process, the same command, --load F --ckpt-step 3, steps 4-8   -> F's losses, loss scales, skips exactly

Tolerance: DP2 and DP1 give every micro-batch the same bf16 forward and backward; only the fp32 sum of the
gradients over ranks changes order (~1e-7 relative), but an fp32 main parameter that moves across a bf16
rounding boundary changes its bf16 weight by one bf16 step (2**-8 relative), so later losses move by a fraction
of 2**-8; the bf16 reduction (R) rounds every summed gradient to 2**-9. 2**-8 is the bf16 equivalence matrix's
loss bound (tests/test_parallel_equivalence.py). Eight trainer launches and one conversion.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from test_train_run import TINY
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from train_cli import ROOT, env, latest, metrics, train

pytestmark = pytest.mark.slow  # real trainer runs, multi-process layouts

BF16_LOSS_RTOL = 2.0**-8  # the module docstring says why


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("precision")
    base = [*TINY, "--embedded-data", str(tmp / "data"), "--bf16"]
    out = {"tmp": tmp}
    out["A_log"] = train(*base, "--save", tmp / "A", "--save-interval", "3", "--exit-interval", "6")
    out["B_log"] = train(*base, "--save", tmp / "B", "--load", tmp / "A", "--ckpt-step", "3", "--exit-interval", "6")
    dist_opt = [*base, "--use-distributed-optimizer"]
    out["G1_log"] = train(*dist_opt, "--save", tmp / "G", "--accumulate-allreduce-grads-in-fp32",
                          "--exit-interval", "3", nproc=2)
    out["G2_log"] = train(*dist_opt, "--save", tmp / "G", "--load", tmp / "G", "--exit-interval", "6")
    out["R_log"] = train(*dist_opt, "--save", tmp / "R", "--grad-reduce-in-bf16", "--exit-interval", "3", nproc=2)
    fp16 = [*TINY, "--embedded-data", str(tmp / "data"), "--fp16", "--initial-loss-scale", str(2**18),
            "--hysteresis", "1", "--exit-interval", "8"]
    out["F_log"] = train(*fp16, "--save", tmp / "F", "--save-interval", "3")
    out["E_log"] = train(*fp16, "--save", tmp / "E", "--load", tmp / "F", "--ckpt-step", "3")
    return out


def _checkpoint(folder, tmp) -> dict:
    """Every tensor of a run's step-6 checkpoint (model and optimizer state), read without a process group."""
    path = tmp / f"{os.path.basename(folder)}.pt"
    dcp_to_torch_save(str(folder / "iter_0000006"), str(path))
    return {k: v for k, v in torch.load(path, weights_only=False).items() if torch.is_tensor(v)}


def test_bf16_resume_at_the_same_layout_is_bit_for_bit(runs):
    tmp = runs["tmp"]
    ref, _ = metrics(tmp / "A")
    got, _ = metrics(tmp / "B")
    assert sorted(got) == [4, 5, 6] and latest(tmp / "B") == 6
    for step in got:
        assert got[step]["loss"] == ref[step]["loss"] and got[step]["grad_norm"] == ref[step]["grad_norm"], step
    a, b = _checkpoint(tmp / "A", tmp), _checkpoint(tmp / "B", tmp)
    assert sorted(a) == sorted(b)
    main = [k for k in a if k.startswith("optimizer.state.fp32_param.")]
    assert main and all(a[k].dtype == torch.float32 for k in main), "no fp32 main parameters in the checkpoint"
    assert {a[k].dtype for k in a if k.startswith("decoder.")} == {torch.bfloat16}
    assert [k for k in a if not torch.equal(a[k], b[k])] == []  # main parameters, moments, bf16 weights: all


def test_bf16_distributed_optimizer_resumes_from_dp2_to_dp1(runs):
    tmp = runs["tmp"]
    ref, _ = metrics(tmp / "A")
    got, _ = metrics(tmp / "G")
    assert "DP2" in runs["G1_log"] and f"resumed from {tmp / 'G' / 'iter_0000003'}" in runs["G2_log"]
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for s in got:
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=BF16_LOSS_RTOL), s
    # before any update: the same bf16 forward; only the order of the loss sum over the ranks differs
    assert got[1]["loss"] == pytest.approx(ref[1]["loss"], rel=1e-6)


def test_grad_reduce_in_bf16_against_fp32_at_dp2(runs):
    tmp = runs["tmp"]
    fp32, _ = metrics(tmp / "G")
    bf16, _ = metrics(tmp / "R")
    assert sorted(bf16) == [1, 2, 3]
    assert bf16[1]["loss"] == fp32[1]["loss"]
    assert bf16[1]["grad_norm"] != fp32[1]["grad_norm"], "--grad-reduce-in-bf16 changed nothing"
    assert bf16[1]["grad_norm"] == pytest.approx(fp32[1]["grad_norm"], rel=BF16_LOSS_RTOL)
    for s in bf16:
        assert bf16[s]["loss"] == pytest.approx(fp32[s]["loss"], rel=BF16_LOSS_RTOL), s


def test_fp16_overflow_skips_counts_and_resumes_with_the_same_scale(runs):
    tmp = runs["tmp"]
    ref, _ = metrics(tmp / "F")
    assert sorted(ref) == list(range(1, 9)) and "fp16 on 1 x cpu" in runs["F_log"]
    assert [ref[s]["skipped_iters"] for s in ref] == [1, 1, 1, 1, 1, 1, 0, 0]
    assert [ref[s]["loss_scale"] for s in ref] == [2.0**17, 2.0**16, 2.0**15, 2.0**14, 2.0**13, 2.0**12, 2.0**12,
                                                   2.0**12]
    assert all(ref[s]["grad_norm"] is None and ref[s]["lr"] == 0.0 for s in range(1, 7))  # no update, schedule held
    assert ref[7]["grad_norm"] > 0 and ref[8]["lr"] > 0
    assert "loss scale 131072 | skipped 1" in runs["F_log"] and "loss scale 4096 | skipped 0" in runs["F_log"]
    got, _ = metrics(tmp / "E")
    assert sorted(got) == [4, 5, 6, 7, 8] and f"resumed from {tmp / 'F' / 'iter_0000003'}" in runs["E_log"]
    for s in got:
        for key in ("loss", "loss_scale", "skipped_iters", "grad_norm", "lr"):
            assert got[s][key] == ref[s][key], (s, key)


def test_grad_reduce_flags_refused_when_they_contradict(tmp_path):
    base = [*TINY, "--embedded-data", str(tmp_path / "data"), "--save", tmp_path / "run"]
    log = train(*base, "--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32", expect=2)
    assert "contradict" in log
    log = train(*base, "--no-bf16", "--grad-reduce-in-bf16", expect=2)
    assert "--grad-reduce-in-bf16 needs --bf16" in log
    log = train(*base, "--bf16", "--fp16", expect=2)
    assert "--fp16 and --bf16 contradict" in log
    assert not os.path.exists(tmp_path / "run")


def test_hf_export_of_a_bf16_run_records_and_loads_bfloat16(runs):
    transformers = pytest.importorskip("transformers", reason="the hf extra (pip install .[hf]) is not installed")
    tmp = runs["tmp"]
    hf = tmp / "hf"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_to_hf.py"), "--load",
                           str(tmp / "A"), "--output", str(hf)], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.load(open(hf / "config.json"))["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
