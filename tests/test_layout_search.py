"""The layout search (megatron_sat/training/layout_search.py, plan-layout --search) and GPU hours from the step-time
model (planner, plan-layout --all, submit-grid): rankings whose answer is known by construction, held flags, the
memory plan's refusals, --json's shape, bad input.

    .venv/bin/python -m pytest -q tests/test_layout_search.py        # about half a minute on 2 cores
"""

import json
import os
import subprocess
import sys

import pytest

from megatron_sat.training import layout_search, planner
from megatron_sat.training.arguments import parse_args
from megatron_sat.training.planner import plan_recipe, resolve_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a 1.3B-class model small enough to search fast: 2 nodes of 4 H100s
MODEL = ["--arch", "transformer", "--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16",
         "--seq-length", "2048", "--vocab-size", "32000", "--global-batch-size", "64", "--train-iters", "10"]


def _search(overrides, cluster="2x4xH100"):
    return layout_search.search(resolve_args(None, MODEL + overrides), cluster, MODEL + overrides)


def _find(result, **kw):
    return [r for r in result.ranked if all(getattr(r.candidate, k) == v for k, v in kw.items())]


def test_tp_stays_inside_the_node_when_the_network_is_slower():
    """TP8 on 2 nodes of 4 puts every layer's all-reduce on the network; TP4 x PP2 keeps it on NVLink and the
    pipeline's one message per micro-batch crosses the network instead: TP4 x PP2 is faster, and the best layout
    keeps TP within a node."""
    result = _search(["--micro-batch-size", "1", "--recompute-granularity", "selective"])
    assert result.ranked and result.ranked[0].candidate.tp <= 4
    same = dict(micro_batch_size=1, vpp=None, cp=1, sp=True, distributed_optimizer=True)
    tp8 = _find(result, tp=8, pp=1, **same)
    tp4 = _find(result, tp=4, pp=2, **same)
    assert tp8 and tp4
    assert tp4[0].prediction.step_time_s < tp8[0].prediction.step_time_s
    assert tp8[0].prediction.exposed_comm_share > tp4[0].prediction.exposed_comm_share
    times = [r.prediction.step_time_s for r in result.ranked]
    assert times == sorted(times)  # best first


def test_given_flags_are_held_and_the_rest_searched():
    result = _search(["--tensor-model-parallel-size", "2", "--recompute-granularity", "full"])
    assert result.fixed == {"tensor_model_parallel_size": 2, "recompute_granularity": "full"}
    assert result.ranked
    assert {r.candidate.tp for r in result.ranked} == {2}
    assert {r.candidate.recompute for r in result.ranked} == {"full"}
    assert len({(r.candidate.pp, r.candidate.micro_batch_size) for r in result.ranked}) > 1  # the rest varies
    free = _search([])
    assert len({r.candidate.tp for r in free.ranked}) > 1 and len(free.ranked) > len(result.ranked)


def test_the_search_costs_each_layer_once_per_cost_key_and_predicts_as_without_its_memo():
    """The search's memo (steptime.predict_step's memo): a layer is costed once per set of the fields its cost
    depends on (layer_costs.cost_key), not once per layout, and a layout predicted alone gives the same numbers."""
    from megatron_sat import steptime
    from megatron_sat.model.args import model_args

    args = resolve_args(None, MODEL)
    result = layout_search.search(args, "2x4xH100", MODEL)
    keys = {(c.tp, c.cp, c.micro_batch_size, c.sp, c.recompute) for c in (r.candidate for r in result.ranked)}
    assert result.layer_costs == 8 * len(keys)  # 8 layers, each once per key
    assert 4 * result.layer_costs < 8 * len(result.ranked)  # against once per layer and layout
    model = model_args(args)
    for r in result.ranked[:: max(1, len(result.ranked) // 6)]:
        vocab = planner.padded_vocab_size(32000, args, r.candidate.tp)
        alone = steptime.predict_step(model, r.prediction.layout, result.cluster, seq_length=2048, vocab_size=vocab)
        assert r.as_dict() == layout_search.Ranked(r.candidate, alone, r.memory).as_dict()
        assert alone.breakdown == r.prediction.breakdown


def test_layouts_the_memory_plan_refuses_are_absent():
    """On 1 H100 the 8-layer 2048-wide model at sequence 8192 and micro-batch 16 keeps more than 80 GB of
    activations without recompute, and as much with selective recompute (bf16 flash attention keeps no scores for it
    to drop): the plan refuses both and the search drops them; with full recompute it fits."""
    long = ["--seq-length", "8192"]
    result = _search(long, cluster="1x1xH100")
    assert result.refused_memory > 0
    cap = planner.USABLE_FRACTION * result.capacity_gib
    assert all(r.memory["total"] <= cap for r in result.ranked)
    assert not _find(result, micro_batch_size=16, recompute=None)
    assert not _find(result, micro_batch_size=16, recompute="selective")
    assert _find(result, micro_batch_size=16, recompute="full")
    assert _find(result, micro_batch_size=1, recompute=None)  # a lighter recompute that fits is the one ranked
    assert not _find(result, micro_batch_size=1, recompute="selective") and result.dominated > 0
    # the refused one is refused by the planner itself, not by the search's own arithmetic
    args = resolve_args(None, MODEL + long + ["--micro-batch-size", "16", "--use-distributed-optimizer"])
    plan = planner.make_plan(args, recipe="none", nodes=1, gpus_per_node=1, gpu="H100")
    assert not plan.ok and "exceeds 90%" in " ".join(plan.errors)


def test_the_attention_kernel_keeps_what_its_path_keeps():
    """Without recompute a layer keeps the attention kernel's own tensors on top of selective recompute's:
    Transformer Engine in bf16 (flash or cuDNN fused attention) its fp32 softmax statistics, 4sba/t bytes; TE in
    fp32 (its unfused path) the 5as^2b scores at 2 bytes a value, doubled; the CPU's SDPA its statistics and a copy
    of its output. One stage, one micro-batch in flight: the difference is num_layers x that."""
    from megatron_sat.model.args import model_args
    from megatron_sat.parallel.layout import Layout

    cfg = model_args(resolve_args(None, MODEL))
    s, b, a, d, L = 2048, 2, 16, 128, 8

    def kept(backend, bf16, t):
        plans = [planner.stage_estimates(cfg, Layout(tp=t), dp=1, micro_batch_size=b, num_microbatches=1,
                                         seq_length=s, vocab_size=32000, bf16=bf16, recompute=r,
                                         backend=backend)[0]["per_micro_batch"] for r in (None, "selective")]
        return (plans[0] - plans[1]) / L

    for t in (1, 2):
        assert kept("te", True, t) == 4 * s * b * a / t
        assert kept("te", False, t) == 2.5 * 4 * a * s * s * b / t
        assert kept("local", False, t) == 4 * s * b * a * d / t + 4 * s * b * a / t


def _tool(*args, expect=0):
    proc = subprocess.run([sys.executable, "tools/plan_layout.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_search_cli_json_and_text():
    out = _tool("--search", "--cluster", "2x4xH100", *MODEL, "--json").stdout
    data = json.loads(out)
    assert data["cluster"] == "2x4xH100" and data["layouts"]
    for row in data["layouts"]:
        assert {"step_time_s", "tflops_per_gpu", "mfu", "memory_gib", "tokens_per_s", "bubble_share",
                "exposed_comm_share", "flags"} <= set(row)
        assert 0 < row["mfu"] < 1 and row["memory_gib"] > 0
    times = [r["step_time_s"] for r in data["layouts"]]
    assert times == sorted(times)
    text = _tool("--search", "--cluster", "2x4xH100", *MODEL, "--top", "3").stdout
    assert "best:" in text and "x the step time" in text and "exposed comm" in text


def test_bad_input_is_one_line_and_exit_2():
    for argv in (["--search", "--cluster", "2x4xFOO", *MODEL], ["--search", "--cluster", "2x4xH100", "--arch",
                                                                 "transformer", "--num-layers", "8"],
                 ["--recipe", "satformer_760M", "--mfu", "4"]):
        err = _tool(*argv, expect=2).stderr.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error:"), err



def test_the_search_and_the_trainer_refuse_the_same_model_sizes(capsys):
    """shape_errors: sizes >= 1, whole query groups, a head dim the hidden size gives; the search ran a zero depth
    into a division by zero and ranked layouts of models the trainer cannot build."""
    for extra, message in ((["--num-layers", "0"], "--num-layers 0: the model's sizes must be >= 1"),
                           (["--num-query-groups", "5"], "--num-attention-heads 16 is not divisible by "
                                                         "--num-query-groups 5"),
                           (["--hidden-size", "2050"], "--hidden-size 2050 is not divisible by "
                                                       "--num-attention-heads 16")):
        with pytest.raises(ValueError, match=message):
            _search(extra)
        with pytest.raises(SystemExit) as e:
            parse_args(MODEL + ["--mock-data", "--print-config"] + extra)
        assert e.value.code == 2 and message in capsys.readouterr().err
    # a head dim given as --kv-channels is a model the trainer builds (Megatron-Core's kv_channels)
    assert _search(["--hidden-size", "2050", "--kv-channels", "128"]).ranked

def test_gpu_hours_come_from_the_model():
    h100 = plan_recipe("satformer_760M", gpu="H100")
    a100 = plan_recipe("satformer_760M", gpu="A100")
    assert h100.ok and a100.ok and not h100.mfu_given
    # the step-time model's hours: steps x predicted step x GPUs, and another GPU changes them
    assert abs(h100.gpu_hours - h100.step_time_s * h100.train_iters * h100.world_size / 3600) < 1e-6 * h100.gpu_hours
    assert a100.gpu_hours > 2 * h100.gpu_hours
    lo, hi = h100.gpu_hours_band
    assert lo < h100.gpu_hours < hi
    assert abs(hi / h100.gpu_hours - 1 - planner.step_time_error()) < 1e-9
    # a layout with a pipeline bubble costs more GPU hours than pure DP at the same model (the 0.40 MFU made them
    # equal)
    dp = plan_recipe("satformer_1.3B", gpu="H100")
    pp = plan_recipe("satformer_1.3B", ["--pipeline-model-parallel-size", "4", "--micro-batch-size", "1"], gpu="H100")
    assert dp.ok and pp.ok and pp.gpu_hours > dp.gpu_hours
    # --mfu: an explicit override, the FLOPs formula
    given = plan_recipe("satformer_760M", gpu="H100", mfu=0.4)
    assert given.mfu_given and given.gpu_hours == given.flops_per_token * given.tokens / (989e12 * 0.4) / 3600
