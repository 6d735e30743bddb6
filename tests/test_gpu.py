"""GPU-only paths: the local spec in BF16 on CUDA, the Transformer Engine spec (BF16 and FP8), for every
arch; the DenseFormer, MUDDFormer and Hyper-Connections baselines are BF16 only (FP8 must be refused);
and a trainer run with the distributed optimizer on TE/Apex FusedAdam resumed from a checkpoint.

Skipped with a printed reason on machines without CUDA (or without transformer-engine). Run on a
GPU with `bash tools/gpu_check.sh` (a few minutes on one H100/H200), which also runs the 760M
step benchmark.
"""

import pytest
import torch
from dist_utils import init_megatron, run_distributed
from train_cli import metrics, train

from megatron_sat.model.config import make_config
from megatron_sat.model.gpt import build_model
from megatron_sat.model.specs import HAVE_TE

pytestmark = pytest.mark.gpu
ARCHS = ("transformer", "resformer", "satformer", "denseformer", "muddformer", "hyperconnections")
NO_FP8 = ("denseformer", "muddformer", "hyperconnections")  # the config refuses FP8 for the baselines
# TE spec keeps input_layernorm apart (megatron_sat/model/specs.py); SATFormer only with the separate gate
UNFUSED_INPUT_NORM = ("muddformer",)
SIZES = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=512)
VOCAB, SEQ, BATCH = 512, 128, 2


def _te_names(name: str, arch: str) -> str:
    """Local-spec parameter name -> the TE spec's name for the same weight."""
    if name.endswith("pre_mlp_layernorm.weight"):
        return name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
    if name.endswith(".input_layernorm.weight") and arch not in UNFUSED_INPUT_NORM:  # fused into linear_qkv
        return name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
    return name


def _worker():
    init_megatron()
    out = {"have_te": HAVE_TE}
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda")
    pos = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, SEQ)
    for arch in ARCHS:
        torch.manual_seed(0)
        local = build_model(make_config(arch, **SIZES), VOCAB, SEQ, backend="local")[0]
        ref = local(tokens, pos, None).float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = local(tokens, pos, None, labels=tokens).float().mean()
        loss.backward()
        out[f"{arch}/local_bf16_loss"] = loss.item()
        out[f"{arch}/local_grads_finite"] = all(torch.isfinite(p.grad).all().item() for p in local.parameters())
        if not HAVE_TE:
            continue
        te = build_model(make_config(arch, **SIZES), VOCAB, SEQ, backend="te")[0]
        state = {_te_names(k, arch): v for k, v in local.state_dict().items()}
        missing, unexpected = te.load_state_dict(state, strict=False)
        out[f"{arch}/te_missing"] = [k for k in missing if not k.endswith("_extra_state")]
        out[f"{arch}/te_unexpected"] = list(unexpected)
        out[f"{arch}/te_qkv"] = {type(layer.self_attention.linear_qkv).__name__ for layer in te.decoder.layers}
        got = te(tokens, pos, None).float()
        out[f"{arch}/te_vs_local_fp32"] = ((got - ref).abs().max() / ref.abs().max()).item()
        if arch in NO_FP8:
            try:
                make_config(arch, **SIZES, fp8="hybrid", bf16=True, params_dtype=torch.bfloat16)
                out[f"{arch}/fp8_refused"] = None
            except ValueError as e:
                out[f"{arch}/fp8_refused"] = str(e)
            continue
        fp8 = build_model(make_config(arch, **SIZES, fp8="hybrid", bf16=True, params_dtype=torch.bfloat16),
                          VOCAB, SEQ, backend="te")[0]
        fp8.load_state_dict({k: v.bfloat16() for k, v in state.items()}, strict=False)
        loss8 = fp8(tokens, pos, None, labels=tokens).float().mean()
        loss8.backward()
        out[f"{arch}/fp8_loss"] = loss8.item()
        out[f"{arch}/fp8_vs_fp32_loss"] = abs(loss8.item() - local(tokens, pos, None, labels=tokens).float().mean().item())
    return out


@pytest.fixture(scope="module")
def gpu_results():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return run_distributed(_worker, 1, timeout=900)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_local_spec_bf16_on_gpu(gpu_results, arch):
    assert torch.isfinite(torch.tensor(gpu_results[f"{arch}/local_bf16_loss"]))
    assert gpu_results[f"{arch}/local_grads_finite"]


@pytest.mark.parametrize("arch", ARCHS)
def test_te_spec_matches_local_and_runs_fp8(gpu_results, arch):
    if not gpu_results["have_te"]:
        pytest.skip("transformer-engine is not installed")
    assert not gpu_results[f"{arch}/te_missing"] and not gpu_results[f"{arch}/te_unexpected"]
    if arch not in UNFUSED_INPUT_NORM:  # SATFormer (fused gate) keeps TE's fused norm + QKV GEMM like the Transformer
        assert gpu_results[f"{arch}/te_qkv"] == {"TELayerNormColumnParallelLinear"}, gpu_results[f"{arch}/te_qkv"]
    assert gpu_results[f"{arch}/te_vs_local_fp32"] < 1e-3  # TF32 / fused kernels on both sides
    if arch in NO_FP8:
        assert f"FP8 is not supported for the {arch} baseline" in (gpu_results[f"{arch}/fp8_refused"] or "")
    else:
        assert gpu_results[f"{arch}/fp8_vs_fp32_loss"] < 0.05  # FP8 on a 256-wide model: a loose sanity bound


def test_distributed_optimizer_resumes_on_gpu(tmp_path):
    """The GPU's default optimizer (distributed, TE/Apex FusedAdam): 3 steps, save, resume for 3 more
    -> the uninterrupted run's losses (fp32; relative 1e-4 leaves room for GPU kernel nondeterminism)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    run = ["--recipe", "debug_satformer", "--use-distributed-optimizer", "--no-bf16", "--train-iters", "6",
           "--log-interval", "1", "--no-progress-bar"]
    train(*run, "--save", str(tmp_path / "straight"))
    train(*run, "--save", str(tmp_path / "resumed"), "--exit-interval", "3")
    log = train(*run, "--save", str(tmp_path / "resumed"), "--load", str(tmp_path / "resumed"))
    assert "resumed from" in log
    ref, _ = metrics(tmp_path / "straight")
    got, _ = metrics(tmp_path / "resumed")
    assert sorted(got) == list(range(1, 7))
    for step in (4, 5, 6):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-4), step


def test_memory_history_snapshot_on_cuda_oom(tmp_path):
    """--record-memory-history (training/profiler.py): a CUDA out-of-memory error inside the loop writes the
    allocator snapshot (pytorch.org/memory_viz reads it) and the error goes on."""
    import argparse
    import pickle

    from megatron_sat.training.profiler import StepProfiler

    args = argparse.Namespace(save=str(tmp_path), profile=False, profile_ranks=[0], use_pytorch_profiler=False,
                              profile_step_start=1, profile_step_end=1, record_memory_history=True,
                              memory_snapshot_path=None)
    lines = []
    profiler = StepProfiler(args, rank=0, log=lines.append)
    kept = torch.ones(1 << 20, device="cuda")  # an allocation the snapshot must show
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with profiler.oom_snapshot():
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB
    path = tmp_path / "profile" / "memory_snapshot_rank0.pickle"
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"] and any("CUDA out of memory" in line for line in lines)
    profiler.close()
    del kept
