"""Worker for tests/test_parallel_equivalence.py: train the same tiny model at many layouts.

    torchrun --nproc-per-node 1 tests/workers/equivalence.py --out DIR --reference
    torchrun --nproc-per-node 4 tests/workers/equivalence.py --out DIR

The reference run (one rank) saves each variant's initial weights as a dist checkpoint, then
records every parameter's float64 gradient (below), the loss of every float32 training step and
every parameter after the last step. Layout runs load those initial weights (resharded by
dist-checkpointing), do the same on the same global batches and write, from global rank 0, the
same records gathered to full tensors under global names: results.json lists each comparison.

Gradients are compared in float64. In float32 a layout's gradients differ from one rank's by
rounding that cancellation amplifies, and no float32 bound is both safe and tight. The worst case,
Hyper-Connections' dynamic_alpha_scale (one scalar per sublayer), has the gradient
sum_{t,n,k} tanh(.)[t,n,k] * dL/dalpha[t,n,k], 8*16*4*5 = 2,560 terms of both signs, each itself a
dot product over h = 64 (dL/dalpha[t,n,k] = H[t,n,:] . dL/dmix[t,k,:]). For layer 4's attention
sublayer sum|products| / |sum| is ~400 (~20 for the terms alone), so float32 (u = 6e-8) can be off
by up to u * 400 = 2.4e-5 of the result: one rank's float32 gradient is itself 1.1e-5 from the
float64 value, and TP2's (every matmul reduced in another order) was 2.8e-5 from one rank's, above
the former 1e-5 bound (DP4, which only regroups the sum over tokens: 3e-7). That is float32
arithmetic, not a parallelism error. So each case also builds its model in float64 from the same
initial weights, wraps it in Megatron's DDP reducing in float64 and runs one forward-backward of
step 0's global batch through the same schedules, transports and gradient finalisation, with a
loss linear in the logits (L = sum of R * logits over unmasked tokens / token count, R a fixed
random tensor; Megatron's cross entropy computes in float32 whatever the input dtype, so it would
bring the float32 rounding back). Those gradients agree to ~1e-14 (tests/test_parallel_equivalence.py).
"""

import argparse
import json
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_sat import compat

compat.ensure_cpu_compat()

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module

from megatron_sat.model.config import make_config
from megatron_sat.model.gpt import build_model
from megatron_sat.parallel.grads import finalize_grads
from megatron_sat.parallel.layout import Layout, destroy, initialize, validate
from megatron_sat.parallel.pipeline import forward_backward
from megatron_sat.training.checkpointing import load_model, save_model
from megatron_sat.training.step import build_optimizer, train_step, wrap_ddp

VOCAB, SEQ, GLOBAL_BATCH, STEPS, SEED = 128, 16, 8, 3, 1234
# Every initial weight gets noise of this std before it is saved: the baselines start with exact
# constants (zero W2 and static weights in MUDDFormer, one-hot DWA weights, zero dynamic
# projections), where some gradients are zero in exact arithmetic and pure float32 rounding noise
# (~1e-9) in practice. Adam's first update lr * g / (|g| + eps) turns that noise into +-lr, so with
# MUDDFormer's own init the weights after 3 steps differed by 1.7x between layouts while every
# gradient agreed to 1e-6. Perturbed weights give every parameter a real gradient and exercise
# every connection from the first step. For the same reason Adam's eps is 1e-6 rather than 1e-8:
# TP changes the order of reductions (gradients then agree to ~1e-6 of their max, not ~1e-7), and
# with eps 1e-8 the entries whose gradient is that small moved by +-lr, e.g. DenseFormer's
# linear_proj by 1.1e-2 of its max after 3 steps at TP2 while its losses agreed to 2e-6.
INIT_NOISE = 0.02
ADAM_EPS = 1e-6
SIZES = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128)
VARIANTS = {
    "transformer": dict(arch="transformer"),
    "resformer": dict(arch="resformer"),
    "satformer": dict(arch="satformer"),
    "satformer_last2_sigmoid": dict(arch="satformer", value_residual_last_k=2, value_residual_gate="sigmoid"),
    # a softmax over the KV heads: with the fused gate each TP rank gathers the N_kv logits of a token
    "satformer_softmax_sigmoid": dict(arch="satformer", value_residual_gate="softmax_sigmoid"),
    "denseformer": dict(arch="denseformer"),
    "muddformer": dict(arch="muddformer"),
    "hyperconnections": dict(arch="hyperconnections"),
}
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
SELECTIVE_RECOMPUTE = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
# (layout, config fields, micro-batch size). Every layout with SP, and TP2 x PP2, runs micro-batches of 2:
# at 1, an error that swaps the batch and sequence axes ([s, b] read as [b, s] in V1's pipeline packing
# or the gate's all-to-all) moves no element and is invisible. SEQ 16 (8 per SP shard) != 2 != N_kv/TP 1.
# The others keep micro-batches of 1 (one-rank reference: 1) and the most micro-batches per step.
LAYOUTS = {
    "dp4": (Layout(), {}, 1),
    "tp2": (Layout(tp=2), {}, 1),
    "tp2_sp": (Layout(tp=2, sp=True), {}, 2),
    "pp2": (Layout(pp=2), {}, 1),
    "pp2_vpp2": (Layout(pp=2, vpp=2), {}, 1),
    "tp2_pp2": (Layout(tp=2, pp=2), {}, 2),
    "tp2_sp_pp2_vpp2": (Layout(tp=2, pp=2, vpp=2, sp=True), {}, 2),  # V1 in its sequence-shard layout on the wire
    "pp2_full_recompute": (Layout(pp=2), FULL_RECOMPUTE, 1),
    "tp2_sp_selective_recompute": (Layout(tp=2, sp=True), SELECTIVE_RECOMPUTE, 2),
    # the separate gate (--value-residual-gate-impl separate, still offered): its own GEMM on the sequence shard
    # and an all-to-all from [s/tp, b, N_kv] to [s, b, N_kv/tp] (model/attention.py), which the fused default skips
    "tp2_sp_separate_gate": (Layout(tp=2, sp=True), dict(value_residual_gate_impl="separate"), 2),
    # DP4 with Megatron's distributed optimizer (the fp32 main parameters and Adam's state sharded over DP): bf16 only
    "dp4_distopt": (Layout(), {}, 1),
}
DISTRIBUTED_OPTIMIZER = ("dp4_distopt",)
# DenseFormer and MUDDFormer refuse full recompute (the config says why); selective is covered.
GATE_ONLY = ("tp2_sp_separate_gate",)  # layouts that only the SATFormer variants run
BF16_ONLY = DISTRIBUTED_OPTIMIZER
CASES = [(v, lay) for v in ("transformer", "resformer", "satformer", "hyperconnections") for lay in LAYOUTS
         if (lay not in GATE_ONLY or v == "satformer") and lay not in BF16_ONLY] + [
    (v, lay) for v in ("denseformer", "muddformer") for lay in LAYOUTS
    if lay != "pp2_full_recompute" and lay not in GATE_ONLY + BF16_ONLY
] + [
    ("satformer_last2_sigmoid", "tp2_pp2"),
    ("satformer_last2_sigmoid", "pp2_vpp2"),
    ("satformer_softmax_sigmoid", "tp2_sp"),
    ("satformer_softmax_sigmoid", "tp2_sp_separate_gate"),
]
# BF16 (--bf16 as the trainer runs it: bf16 parameters in Float16Module, Megatron's Float16Optimizer with fp32 main
# parameters, main_grad accumulated and reduced in fp32): variant "<v>_bf16" trains v's initial weights (loaded into
# bf16) at each layout against a one-rank bf16 reference (tests/test_parallel_equivalence.py has the tolerances).
BF16_SUFFIX = "_bf16"
BF16_VARIANTS = ("transformer", "satformer", "hyperconnections")
BF16_LAYOUTS = ("tp2", "tp2_sp", "pp2", "pp2_vpp2", "dp4_distopt", "pp2_full_recompute")
BF16_CASES = [(v + BF16_SUFFIX, lay) for v in BF16_VARIANTS for lay in BF16_LAYOUTS]
# A deliberate bug that the bf16 tolerances must see: under TP2 + SP the norms' weights lose their
# `sequence_parallel` flag, so Megatron's finalize_model_grads no longer sums their gradients over the TP group
# (each TP rank keeps the gradient of its own half of the sequence): the classic SP bug.
MUTANTS = {"tp2_sp_unreduced_norm_grads": "tp2_sp"}
MUTANT_CASES = [("satformer" + BF16_SUFFIX, "tp2_sp_unreduced_norm_grads")]
CASES += BF16_CASES + MUTANT_CASES
# The one-rank reference computes SATFormer's gate as its own GEMM (value_residual_gate_impl 'separate'); the
# layouts use the default, W_alpha's rows inside linear_qkv. So each layout also checks that the fused gate
# computes the separate one's function, gradients and updates, and loads the separate impl's checkpoint
# (the saved initial weights) resharded to its layout.
REFERENCE_EXTRA = dict(value_residual_gate_impl="separate")
# what each arch adds to the Transformer: checked to be among the compared gradients
ARCH_PARAMS = ("value_residual", "dwa_weights", "depth_aggregate", "key_input_layernorm", "attention_hc", "mlp_hc")


def batches(step: int, dp_rank: int, dp_size: int, mbs: int):
    """This DP rank's micro-batches of the step's global batch (the same global batch everywhere),
    with R [b, s, VOCAB] for the float64 gradient pass's linear loss."""
    g = torch.Generator().manual_seed(SEED + step)
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    cotangent = torch.randn(GLOBAL_BATCH, SEQ, VOCAB, generator=g, dtype=torch.float64)
    mask = torch.ones(GLOBAL_BATCH, SEQ)
    mask[:, :3] = 0  # a partial loss mask, so token counts matter
    mask[1, 5:] = 0
    per_rank = GLOBAL_BATCH // dp_size
    for i in range(dp_rank * per_rank, (dp_rank + 1) * per_rank, mbs):
        yield dict(
            tokens=data[i : i + mbs, :-1],
            labels=data[i : i + mbs, 1:],
            loss_mask=mask[i : i + mbs],
            position_ids=torch.arange(SEQ).unsqueeze(0).expand(mbs, SEQ),
            cotangent=cotangent[i : i + mbs],
        )


def _linear_loss(loss_mask, cotangent, logits):
    """Megatron loss_func: (sum of R * logits over unmasked tokens, token count, report). Under TP
    each rank holds a vocabulary shard of the logits and takes the same shard of R; the TP ranks'
    partial losses add up, as Megatron's backward of the vocab-parallel output layer assumes."""
    shard = logits.shape[-1]
    rank = parallel_state.get_tensor_model_parallel_rank()
    total = ((logits * cotangent[..., rank * shard:(rank + 1) * shard]).sum(-1) * loss_mask).sum()
    count = loss_mask.sum().to(torch.int)
    return total, count, {"linear loss": total.detach()}


def linear_forward_step(data_iterator, model):
    """forward_step_func of the float64 pass: logits [b, s, V/tp] on the last stage, no cross entropy."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None)
    return output, partial(_linear_loss, batch["loss_mask"].to(torch.float64), batch["cotangent"])


def _drop_sp_flags(chunks) -> None:
    """The deliberate bug of MUTANTS: the norms' gradients are no longer summed over the TP group under SP."""
    for c in chunks:
        for p in c.parameters():
            if getattr(p, "sequence_parallel", False):
                p.sequence_parallel = False


def pass_gradients(chunks_now, variant: str, layout, extra: dict, dp_rank: int, dp: int, mbs: int,
                   dtype=torch.float64, mutant: bool = False):
    """Step 0's gradients of the linear loss from chunks_now's current weights: in float64 (float32 cases), or in
    bf16 as --bf16 trains (bf16 weights and activations in Float16Module, main_grad accumulated and reduced in
    fp32) for the bf16 cases."""
    bf16 = dtype == torch.bfloat16
    precision = dict(bf16=True) if bf16 else {}
    config = make_config(**VARIANTS[variant.removesuffix(BF16_SUFFIX)], **SIZES, **layout.config_fields(dtype),
                         **extra, params_dtype=dtype, **precision)
    # .to(dtype): Megatron's local norms make their weights in float32 whatever params_dtype says
    chunks = [c.to(dtype) for c in build_model(config, vocab_size=VOCAB, max_sequence_length=SEQ)]
    with torch.no_grad():
        for c_new, c_now in zip(chunks, chunks_now, strict=True):
            weights = dict(c_now.named_parameters())
            for name, p in c_new.named_parameters():
                p.copy_(weights.pop(name))
            assert not weights, f"parameters missing in {dtype}: {sorted(weights)}"
    if bf16:
        chunks = [Float16Module(config, c) for c in chunks]
    if mutant:
        _drop_sp_flags(chunks)
    # what megatron_sat.training.step.wrap_ddp sets up; float64 gradients are kept and reduced in float64
    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = finalize_grads
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=bf16)
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
              for i, c in enumerate(chunks)]
    for chunk in chunks:
        chunk.zero_grad_buffer()
    forward_backward(chunks, config, forward_step_func=linear_forward_step, data_iterator=batches(0, dp_rank, dp, mbs),
                     num_microbatches=GLOBAL_BATCH // (mbs * dp), seq_length=SEQ, micro_batch_size=mbs)
    return collect(chunks, "grad")


def full_tensors(chunks, source: str) -> dict:
    """{global name: full tensor} of this rank's parameters ('param' or 'grad'), TP shards gathered.
    A fused SATFormer linear_qkv.weight comes out as the separate impl's linear_qkv.weight and
    value_residual_gate.weight (megatron_sat.model.fused_gate), so both impls compare name by name."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    out = {}

    def gather(piece, dim):
        parts = [torch.empty_like(piece) for _ in range(tp_group.size())]
        torch.distributed.all_gather(parts, piece.contiguous(), group=tp_group)
        return torch.cat(parts, dim)

    for chunk in chunks:
        model = chunk.module
        if isinstance(model, Float16Module):
            model = model.module
        renames = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}."
                   for i, layer in enumerate(model.decoder.layers)}
        fused = {f"{n}.linear_qkv.weight": m.fused_gate_layout for n, m in model.named_modules()
                 if getattr(m, "fused_gate_layout", None) is not None}
        for name, p in model.named_parameters():
            if getattr(p, "shared", False):
                continue  # replicas (tied output layer, ResFormer lambdas) equal their primary
            t = (p.main_grad if source == "grad" else p).detach().clone()  # in its own dtype
            tensors = {name: t}
            if name in fused:  # this rank's KV groups' [q k v alpha] rows + padding -> qkv, gate
                qkv, gate = fused[name].split_weight(t)
                tensors = {name: qkv, name.replace("linear_qkv.weight", "value_residual_gate.weight"): gate}
            if getattr(p, "tensor_model_parallel", False) and tp_group.size() > 1:
                dim = p.partition_dim
                for key, t in tensors.items():
                    pieces = t.chunk(2, dim) if key.endswith("linear_fc1.weight") else (t,)  # SwiGLU [gate; up]
                    tensors[key] = torch.cat([gather(piece, dim) for piece in pieces], dim)
            for key, t in tensors.items():
                for local, glob in renames.items():
                    if key.startswith(local):
                        key = glob + key[len(local):]
                        break
                out[key] = t
    return out


def collect(chunks, source: str):
    """Gather every stage's full tensors on global rank 0 (None elsewhere)."""
    mine = full_tensors(chunks, source)
    if parallel_state.get_tensor_model_parallel_rank() or parallel_state.get_data_parallel_rank():
        mine = {}
    everything = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(mine, everything, dst=0)
    if everything is None:
        return None
    merged = {}
    for d in everything:
        merged.update(d)
    return merged


def run_case(variant: str, layout_name: str, out: str, reference: bool) -> dict:
    layout, extra, mbs = (Layout(), dict(REFERENCE_EXTRA), 1) if reference else LAYOUTS[MUTANTS.get(layout_name, layout_name)]
    bf16 = variant.endswith(BF16_SUFFIX)
    base = variant.removesuffix(BF16_SUFFIX)
    dtype = torch.bfloat16 if bf16 else torch.float32
    precision = dict(bf16=True, params_dtype=torch.bfloat16) if bf16 else {}
    world = torch.distributed.get_world_size()
    config = make_config(**VARIANTS[base], **SIZES, **layout.config_fields(dtype), **extra, **precision)
    dp = layout.dp(world)
    num_micro = GLOBAL_BATCH // (mbs * dp)
    validate(layout, config, world, seq_length=SEQ, num_microbatches=num_micro)
    initialize(layout, seed=SEED)
    chunks = build_model(config, vocab_size=VOCAB, max_sequence_length=SEQ)
    init_dir = os.path.join(out, f"init_{base}")
    if reference and not bf16:
        g = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for _, p in sorted(chunks[0].named_parameters()):
                p.add_(INIT_NOISE * torch.randn(p.shape, generator=g, dtype=p.dtype))
        save_model(chunks, init_dir)
    else:
        load_model(chunks, init_dir)
    dp_rank = parallel_state.get_data_parallel_rank()
    mutant = layout_name in MUTANTS
    grads = pass_gradients(chunks, variant, layout, extra, dp_rank, dp, mbs, torch.bfloat16 if bf16 else torch.float64,
                           mutant)
    if bf16:
        chunks = [Float16Module(config, c) for c in chunks]
    if mutant:
        _drop_sp_flags(chunks)
    dist_opt = layout_name in DISTRIBUTED_OPTIMIZER
    chunks = wrap_ddp(chunks, config, use_distributed_optimizer=dist_opt)
    optimizer = build_optimizer(chunks, lr=1e-2, weight_decay=0.1, clip_grad=1.0, eps=ADAM_EPS, bf16=bf16,
                                use_distributed_optimizer=dist_opt)
    losses = []
    for step in range(STEPS):
        result = train_step(
            chunks, optimizer, config, batches(step, dp_rank, dp, mbs),
            num_microbatches=num_micro, seq_length=SEQ, micro_batch_size=mbs,
        )
        assert result.success, "optimizer step skipped"
        losses.append(result.loss)
    params = collect(chunks, "param")  # (every rank has each step's loss: train_step all-reduces it)
    record = dict(losses=losses, grads=grads, params=params)
    if torch.distributed.get_rank() == 0 and reference:
        torch.save(record, os.path.join(out, f"ref_{variant}.pt"))
    return record if torch.distributed.get_rank() == 0 else None


def compare(ref: dict, got: dict) -> dict:
    def rel(a, b):
        a, b = a.double(), b.double()  # bf16 parameters compared exactly as they are
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()

    missing = sorted(set(ref["grads"]) ^ set(got["grads"]))
    grad_err = {k: rel(got["grads"][k], ref["grads"][k]) for k in ref["grads"] if k in got["grads"]}
    param_err = {k: rel(got["params"][k], ref["params"][k]) for k in ref["params"] if k in got["params"]}
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    return dict(
        losses=got["losses"], ref_losses=ref["losses"], loss_rel_err=loss_err, missing=missing,
        num_params=len(param_err),
        worst_grad=max(grad_err.items(), key=lambda kv: kv[1]),
        worst_param=max(param_err.items(), key=lambda kv: kv[1]),
        arch_grads={k: v for k, v in grad_err.items() if any(tag in k for tag in ARCH_PARAMS)},
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--only", nargs="*", help="variants to run (default: all)")
    args = parser.parse_args()
    keep = lambda variant: not args.only or variant in args.only  # noqa: E731
    torch.distributed.init_process_group(backend=compat.dist_backend())
    results = {}
    if args.reference:
        # the float32 variants first: they save the initial weights that the bf16 variants load
        for variant in filter(keep, [*VARIANTS, *(v + BF16_SUFFIX for v in BF16_VARIANTS)]):
            run_case(variant, "reference", args.out, reference=True)
    else:
        refs = {}
        for variant, layout_name in CASES:
            if not keep(variant):
                continue
            wall, cpu = time.perf_counter(), time.process_time()
            record = run_case(variant, layout_name, args.out, reference=False)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if record is not None:
                ref = refs.setdefault(variant, None) or torch.load(os.path.join(args.out, f"ref_{variant}.pt"))
                refs[variant] = ref
                results[f"{variant}/{layout_name}"] = compare(ref, record)
                r = results[f"{variant}/{layout_name}"]
                print(f"{variant:>24} {layout_name:<28} loss rel err {r['loss_rel_err']:.1e}  "
                      f"worst grad {r['worst_grad'][1]:.1e}  worst param {r['worst_param'][1]:.1e}  "
                      f"({wall:.1f} s, rank 0 CPU {cpu:.1f} s)", flush=True)
        if torch.distributed.get_rank() == 0:
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
    destroy()
    # destroy() must release every group of every layout (forgotten gloo groups kept their threads running
    # and slowed each case more than the last: megatron_sat.parallel.layout.destroy)
    left = [g for g in torch.distributed.distributed_c10d._world.pg_map if g is not torch.distributed.group.WORLD]
    assert not left, f"{len(left)} process groups outlived megatron_sat.parallel.layout.destroy()"
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
