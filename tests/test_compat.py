"""Tests of megatron_sat.compat (the CPU compatibility layer) against the real megatron-core.

One 2-process gloo launch (``test_megatron_on_cpu_two_ranks``) checks, in turn and re-initializing megatron's
parallel state in between:
  1. initialize_model_parallel + model_parallel_cuda_manual_seed (RNG tracker),
  2. GPTModel (local spec) forward/backward in fp32; activation recompute with dropout (RNG replay),
  3. TP=2 matching TP=1 (losses and gradients), also with sequence_parallel,
  4. megatron DistributedDataParallel with DP=2 + finalize_model_grads (grads = mean over ranks),
  5. get_megatron_optimizer: clip_grad>0 (exact check with SGD), use_distributed_optimizer=True == False (Adam),
  6. dist_checkpointing save/load (torch_dist) of a sharded_state_dict, including TP=2 -> TP=1 resharding,
  7. get_forward_backward_func with PP=2 matching PP=1 (losses and gradients).
On a GPU machine the same test runs with NCCL (the compat layer is then a no-op).

megatron.core is imported inside the functions, not at the top: the ranks import this module before dist_utils
calls compat.ensure_cpu_compat(), and megatron must be imported after it (test_scoped_to_megatron checks what the
layer does to megatron's modules); importing it here would also load megatron into every pytest run of this file.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import DistributedTestError, init_megatron, run_distributed

from megatron_sat import compat

VOCAB, SEQ, MBS, HIDDEN, HEADS, LAYERS = 64, 8, 2, 32, 4, 2


# ---------------------------------------------------------------------------------------------------------------
# single-process checks
# ---------------------------------------------------------------------------------------------------------------
def test_api():
    assert compat.ensure_cpu_compat() is (not torch.cuda.is_available())
    assert compat.ensure_cpu_compat() is (not torch.cuda.is_available())  # idempotent
    if torch.cuda.is_available():
        assert compat.device().type == "cuda" and compat.dist_backend() == "nccl"
    else:
        assert compat.device() == torch.device("cpu") and compat.dist_backend() == "gloo"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_scoped_to_megatron():
    """torch as seen outside megatron.core is unchanged (except Tensor.cuda, which would raise anyway)."""
    compat.ensure_cpu_compat()
    import megatron.core.tensor_parallel.layers as layers

    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    assert layers.torch.cuda.current_device() == torch.device("cpu")
    assert layers.torch.zeros(2, device="cuda").device.type == "cpu"
    assert isinstance(torch.device("cpu"), layers.torch.device)
    assert layers.torch.device("cuda", 0) == torch.device("cpu")
    assert layers.torch.device("meta").type == "meta"
    assert torch.ones(2).cuda().device.type == "cpu"


def test_noop_on_gpu():
    """With CUDA available (simulated in a fresh interpreter), ensure_cpu_compat changes nothing."""
    code = (
        "import torch, sys\n"
        "torch.cuda.is_available = lambda: True\n"
        "orig_cuda = torch.Tensor.cuda\n"
        "n = len(sys.meta_path)\n"
        "from megatron_sat import compat\n"
        "assert compat.ensure_cpu_compat() is False\n"
        "assert torch.Tensor.cuda is orig_cuda and len(sys.meta_path) == n\n"
        "assert compat.dist_backend() == 'nccl'\n"
        "import megatron.core.tensor_parallel.layers as layers\n"
        "assert layers.torch is torch\n"
        "print('ok')\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=repo),
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def _failing_worker(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure in rank {bad_rank}")
    dist.barrier()  # the good rank blocks here until run_distributed kills it
    return dist.get_rank()


def test_run_distributed_reports_child_traceback():
    with pytest.raises(DistributedTestError, match="deliberate failure in rank 1") as err:
        run_distributed(_failing_worker, 2, 1, timeout=120, compat=False)
    assert "ValueError" in str(err.value) and str(err.value).startswith("rank 1 failed")
    # the blocked rank 0 was ended by the failure, not left to the launch timeout
    assert "timed out" not in str(err.value), "a failed rank should end the launch, not the timeout"


# ---------------------------------------------------------------------------------------------------------------
# helpers used inside the ranks
# ---------------------------------------------------------------------------------------------------------------
def _config(**kw):
    from megatron.core.transformer import TransformerConfig

    base = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bias_dropout_fusion=False,
    )
    base.update(kw)
    return TransformerConfig(**base)


def _gpt(config, **kw):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
        max_sequence_length=SEQ, **kw,
    )


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ).contiguous()
    dev = _dev()
    return tokens.to(dev), pos.to(dev), labels.to(dev)


def _dev():
    return compat.device()


def _loss(model, batch):
    tokens, pos, labels = batch
    return model(tokens, pos, None, labels=labels).float().mean()


def _grads(model):
    out = {}
    for n, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        out[n] = None if g is None else g.detach().clone()
    return out


def _full_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v is not None and "_extra_state" not in k}


def _load_tp_slices(model, full, rank, tp):
    """Copy the TP-rank slice of each full (TP=1) parameter into a TP-sharded model."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            src = full[n]
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                src = src.chunk(tp, dim=p.partition_dim)[rank]
            assert src.shape == p.shape, (n, src.shape, p.shape)
            p.copy_(src)


def _assert_close(a, b, what, atol=1e-5, rtol=1e-4):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    if not torch.allclose(a, b, atol=atol, rtol=rtol):
        raise AssertionError(f"{what}: max abs diff {(a - b).abs().max().item():.3e}")


# ---------------------------------------------------------------------------------------------------------------
# the 2-rank worker: one function per stage, each re-initializing megatron's parallel state for its layout
# ---------------------------------------------------------------------------------------------------------------
def _stage_gpt_and_recompute(report):
    """1 + 2: parallel state, RNG tracker, GPTModel forward/backward (TP=1, DP=2); activation recomputation with
    dropout replays the same (CPU-held) RNG streams. Returns the TP=1 reference (state, batch, loss, grads)."""
    from megatron.core import tensor_parallel

    init_megatron(tp=1, seed=1234)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork():
        a = torch.rand(4)
    with tracker.fork():
        b = torch.rand(4)
    assert not torch.equal(a, b), "forked RNG stream did not advance"
    ref = _gpt(_config())
    ref_state = _full_state(ref)
    batch = _batch(100)  # the same batch on every rank
    loss = _loss(ref, batch)
    loss.backward()
    ref_loss, ref_grads = loss.detach(), _grads(ref)
    assert torch.isfinite(ref_loss) and all(g is not None for g in ref_grads.values())
    report["loss_tp1"] = ref_loss

    recompute_results = []  # identical grads with and without recomputation
    for recompute in (False, True):
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        m = _gpt(_config(hidden_dropout=0.2, attention_dropout=0.2, **(extra if recompute else {})))
        _load_tp_slices(m, ref_state, 0, 1)
        torch.manual_seed(5)
        tensor_parallel.model_parallel_cuda_manual_seed(5, force_reset_rng=True)
        loss = _loss(m, batch)
        loss.backward()
        recompute_results.append((loss.detach(), _grads(m)))
    _assert_close(recompute_results[1][0], recompute_results[0][0], "recompute loss", atol=0, rtol=0)
    assert not torch.allclose(recompute_results[0][0], ref_loss), "dropout had no effect"
    for n, g in recompute_results[0][1].items():
        _assert_close(recompute_results[1][1][n], g, f"recompute grad {n}", atol=1e-6)
    init_megatron(tp=1, seed=1234)
    return ref_state, batch, ref_loss, ref_grads


def _stage_tensor_parallel(sp, ref_state, batch, ref_loss, ref_grads):
    """3: TP=2 (plain or sequence-parallel) matches TP=1, loss and every gradient."""
    ps = init_megatron(tp=2, seed=1234)
    tp_rank = ps.get_tensor_model_parallel_rank()
    model = _gpt(_config(tensor_model_parallel_size=2, sequence_parallel=sp))
    _load_tp_slices(model, ref_state, tp_rank, 2)
    loss = _loss(model, batch)
    loss.backward()
    _assert_close(loss.detach(), ref_loss, f"TP=2 sp={sp} loss")
    for n, p in model.named_parameters():
        g = p.grad
        if sp and getattr(p, "sequence_parallel", False):
            g = g.clone()
            dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
        full = ref_grads[n]
        if getattr(p, "tensor_model_parallel", False):
            full = full.chunk(2, dim=p.partition_dim)[tp_rank]
        _assert_close(g, full, f"TP=2 sp={sp} grad {n}")


def _stage_ddp_and_optimizer(ref_state):
    """4: DDP with DP=2 + finalize_model_grads (grads = mean over ranks); 5: get_megatron_optimizer with clip_grad
    (exact with SGD), the distributed optimizer equal to the plain one (Adam). Returns the local TP=1 model whose
    gradient is the mean over both ranks' batches (at the reference weights: the PP stage compares against it)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    rank = dist.get_rank()
    init_megatron(tp=1, seed=1234)
    batches = [_batch(200), _batch(201)]
    # reference: mean over the two ranks' batches, computed locally
    local = _gpt(_config())
    _load_tp_slices(local, ref_state, 0, 1)
    (0.5 * (_loss(local, batches[0]) + _loss(local, batches[1]))).backward()
    mean_grads = _grads(local)
    finals = {}
    for opt_name, dist_opt in (("sgd", False), ("adam", False), ("adam", True)):
        cfg = _config()
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=dist_opt,
            bucket_size=None if not dist_opt else 4000,
        )
        model = DistributedDataParallel(cfg, ddp_cfg, _gpt(cfg))
        _load_tp_slices(model.module, ref_state, 0, 1)
        model.broadcast_params()
        clip = 0.05
        opt_cfg = OptimizerConfig(
            optimizer=opt_name, lr=0.1, weight_decay=0.0, clip_grad=clip, bf16=False, fp16=False,
            params_dtype=torch.float32, use_distributed_optimizer=dist_opt, sgd_momentum=0.0,
        )
        opt = get_megatron_optimizer(opt_cfg, [model])
        for step in range(2):
            model.zero_grad_buffer()
            opt.zero_grad()
            _loss(model, batches[rank]).backward()
            finalize_model_grads([model])
            if step == 0 and not dist_opt:  # (the distributed optimizer reduce-scatters: only a shard is valid)
                for n, p in model.module.named_parameters():
                    _assert_close(p.main_grad, mean_grads[n], f"DDP dist_opt={dist_opt} grad {n}")
            if step == 0:
                norm = torch.sqrt(sum((g.double() ** 2).sum() for g in mean_grads.values())).item()
                before = {n: p.detach().clone() for n, p in model.module.named_parameters()}
            ok, grad_norm, _ = opt.step()
            assert ok, "optimizer step skipped"
            if step == 0:
                assert abs(grad_norm - norm) < 1e-4 * max(1.0, norm), (grad_norm, norm)
                if opt_name == "sgd":
                    assert norm > clip, "test needs a gradient norm above clip_grad"
                    coeff = clip / (norm + 1e-6)
                    for n, p in model.module.named_parameters():
                        _assert_close(p.detach(), before[n] - 0.1 * coeff * mean_grads[n], f"clipped SGD {n}")
        finals[(opt_name, dist_opt)] = _full_state(model.module)
    for k, v in finals[("adam", False)].items():
        # lr=0.1: Adam's normalized update magnifies reduce-scatter vs all-reduce rounding in tiny gradients
        _assert_close(finals[("adam", True)][k], v, f"distributed optimizer vs plain: {k}", atol=1e-4)
        assert not torch.allclose(v, ref_state[k]), f"Adam did not change {k}"
    return local


def _stage_dist_checkpoint(ref_state, ckpt_dir):
    """6: dist_checkpointing save (TP=2) and load (TP=2 round trip, and TP=1 resharding)."""
    from megatron.core import dist_checkpointing

    ps = init_megatron(tp=2, seed=1234)
    tp_rank = ps.get_tensor_model_parallel_rank()
    model = _gpt(_config(tensor_model_parallel_size=2))
    _load_tp_slices(model, ref_state, tp_rank, 2)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    init_megatron(tp=2, seed=99)
    fresh = _gpt(_config(tensor_model_parallel_size=2))
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt_dir))
    for n, p in fresh.named_parameters():
        want = ref_state[n]
        if getattr(p, "tensor_model_parallel", False):
            want = want.chunk(2, dim=p.partition_dim)[tp_rank]
        assert torch.equal(p.detach(), want), f"dist ckpt TP=2 round trip {n}"
    init_megatron(tp=1, seed=7)
    fresh = _gpt(_config())
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt_dir))
    for n, p in fresh.named_parameters():
        assert torch.equal(p.detach(), ref_state[n]), f"dist ckpt TP=2 -> TP=1 {n}"


def _pp_forward_step(data_iterator, model):
    tokens, pos, labels = next(data_iterator)
    out = model(tokens, pos, None, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place

    return out, loss_func


def _stage_pipeline(ref_state, local):
    """7: get_forward_backward_func with PP=2 matches PP=1 (`local`, a TP=1 model at the reference weights built
    before the PP=2 state): losses and gradients. Returns the parallel state module (to destroy)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mbs = [_batch(300), _batch(301)]
    ps = init_megatron(tp=1, pp=2, seed=1234)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    cfg = _config(pipeline_model_parallel_size=2)
    model = _gpt(cfg, pre_process=pp_rank == 0, post_process=pp_rank == 1)
    per_stage = LAYERS // 2

    def global_name(n):  # this stage's local layer index -> the PP=1 model's
        if not n.startswith("decoder.layers."):
            return n
        parts = n.split(".")
        parts[2] = str(int(parts[2]) + pp_rank * per_stage)
        return ".".join(parts)

    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(ref_state[global_name(n)])
    losses = get_forward_backward_func()(
        forward_step_func=_pp_forward_step, data_iterator=iter(mbs), model=[model], num_microbatches=len(mbs),
        seq_length=SEQ, micro_batch_size=MBS, forward_only=False,
    )
    # PP=1 reference on the same weights
    local.zero_grad(set_to_none=True)
    ref_losses = []
    for mb in mbs:
        loss = _loss(local, mb)
        (loss / len(mbs)).backward()
        ref_losses.append(loss.detach())
    local_grads = _grads(local)
    if pp_rank == 1:
        assert len(losses) == len(mbs)
        for got, want in zip(losses, ref_losses):
            _assert_close(got["loss"], want, "PP=2 loss")
    for n, p in model.named_parameters():
        _assert_close(p.grad, local_grads[global_name(n)], f"PP=2 grad {n}")
    return ps


def _worker(ckpt_dir):
    """The stages in turn (module docstring), with each one's seconds in report["seconds"]."""
    report = {"seconds": {}}
    t0 = [time.perf_counter()]

    def lap(name):
        now = time.perf_counter()
        report["seconds"][name] = round(now - t0[0], 2)
        t0[0] = now

    ref_state, batch, ref_loss, ref_grads = _stage_gpt_and_recompute(report)
    lap("1-2 init+gpt+recompute")
    for sp in (False, True):
        _stage_tensor_parallel(sp, ref_state, batch, ref_loss, ref_grads)
        report[f"tp2_sp{int(sp)}_ok"] = True
        lap(f"3 tp2 sp={sp}")
    local = _stage_ddp_and_optimizer(ref_state)
    report["ddp_opt_ok"] = True
    lap("4-5 ddp+optimizer")
    _stage_dist_checkpoint(ref_state, ckpt_dir)
    report["dist_ckpt_ok"] = True
    lap("6 dist ckpt")
    ps = _stage_pipeline(ref_state, local)
    report["pp2_ok"] = True
    lap("7 pp2")
    ps.destroy_model_parallel()
    return report


@pytest.mark.slow  # the 2-rank gloo launch
def test_megatron_on_cpu_two_ranks(tmp_path):
    (tmp_path / "ckpt").mkdir()
    results = run_distributed(_worker, 2, str(tmp_path / "ckpt"), timeout=900)
    for r in results:
        assert r == {**r, "tp2_sp0_ok": True, "tp2_sp1_ok": True, "ddp_opt_ok": True, "dist_ckpt_ok": True,
                     "pp2_ok": True}
    torch.testing.assert_close(results[0]["loss_tp1"], results[1]["loss_tp1"])
    print("rank 0 seconds per section:", results[0]["seconds"])
