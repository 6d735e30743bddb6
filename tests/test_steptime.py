"""The step-time model (megatron_sat/steptime): its pieces against hand-computed cases, the pipeline
simulation against the closed-form bubble, and the docs' published-figure table against the model (so a change to
the model updates docs/step_time.md with it). Unit tests, a few seconds; the model itself loads no torch."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sat import archs
from megatron_sat.archs import ARCHS
from megatron_sat.archs.base import Arch
from megatron_sat.model.args import ModelArgs
from megatron_sat.steptime import (
    STEP_TIME_ERROR,
    Cluster,
    Layout,
    cluster,
    collectives,
    gpu_names,
    load_gpu,
    predict_step,
    roofline,
)
from megatron_sat.steptime.published import compare, format_table
from megatron_sat.steptime.schedule import closed_form_bubble, simulate, stage_order

ROOT = Path(__file__).resolve().parents[1]
H100 = load_gpu("H100")


def test_gpus_json_has_the_required_gpus_with_sources():
    for name in ("H100", "H200", "A100", "B200"):
        hw = load_gpu(name)
        assert hw.peak("bf16") > 0 and hw.hbm_gbps > 0 and hw.intra_node_gbps > hw.inter_node_gbps > 0
        assert hw.sources and set(roofline.BYTES) - {"fp8"} <= set(hw.peak_tflops) | {"fp32"}
        assert all(k in hw.calibration for k in ("gemm_efficiency", "attention_efficiency", "memory_efficiency"))
    assert set(gpu_names()) >= {"H100", "H200", "A100", "B200"}
    assert load_gpu("H100").peak("fp8") == pytest.approx(2 * load_gpu("H100").peak("bf16"), rel=1e-3)
    with pytest.raises(ValueError, match="no fp8 peak"):
        load_gpu("A100").peak("fp8")
    with pytest.raises(ValueError, match="unknown GPU"):
        load_gpu("V100")


def test_cluster_specs():
    assert cluster("4x8xH100").world_size == 32
    c = cluster("16xH100")
    assert (c.nodes, c.gpus_per_node) == (2, 8)
    assert cluster("H200").world_size == 8
    with pytest.raises(ValueError, match="whole nodes"):
        cluster("12xH100")
    with pytest.raises(ValueError):
        cluster("4x8x")


def test_gemm_time_on_the_roofline_by_hand():
    # compute-bound: 8192^3 bf16; 64 x 64 tiles of 128 on 132 SMs = 32 waves, the last one partly filled
    m = n = k = 8192
    eff = H100.cal("gemm_efficiency") * (4096 / (32 * 132)) * (k / (k + roofline.K_FILL))
    hand = 2 * m * n * k / (989.4e12 * eff) + H100.cal("kernel_overhead_us") * 1e-6
    assert roofline.gemm_time(H100, m, n, k) == pytest.approx(hand, rel=1e-12)
    # memory-bound: k = 8 moves the [m, n] output (and tiny inputs) and does almost no arithmetic
    m, n, k = 8192, 8192, 8
    nbytes = (m * k + k * n) * 2 + m * n * 2
    hand = nbytes / (3350e9 * H100.cal("memory_efficiency")) + H100.cal("kernel_overhead_us") * 1e-6
    assert roofline.gemm_time(H100, m, n, k) == pytest.approx(hand, rel=1e-12)
    # FP8 halves the compute-bound time (twice the peak) of the same shape, up to the overhead
    big = roofline.gemm_time(H100, 8192, 8192, 8192) - 4e-6
    assert roofline.gemm_time(H100, 8192, 8192, 8192, "fp8") - 4e-6 == pytest.approx(big / 2, rel=1e-3)


def test_ring_all_reduce_by_hand():
    c = Cluster(gpu=H100, nodes=4, gpus_per_node=8)
    eff = H100.cal("comm_efficiency")
    # within a node (TP8): NVLink, ring bandwidth, tree latency (min(14, 6) steps)
    hand = 2 * 7 / 8 * 1e9 / (eff * 450e9) + 6 * 3e-6
    assert collectives.all_reduce(c, 1e9, 8, 1) == pytest.approx(hand, rel=1e-12)
    # across 4 nodes, one member per node (DP over TP8): one network port, inter-node latency
    hand = 2 * 3 / 4 * 1e9 / (eff * 50e9) + min(6, 4) * 6e-6
    assert collectives.all_reduce(c, 1e9, 4, 8) == pytest.approx(hand, rel=1e-12)
    # 32 ranks, 8 a node: the ring's inter-node hop moves 8 ports' worth, capped at NVLink
    hand = 2 * 31 / 32 * 1e9 / (eff * min(450e9, 8 * 50e9)) + 10 * 6e-6
    assert collectives.all_reduce(c, 1e9, 32, 1) == pytest.approx(hand, rel=1e-12)
    hand = 7 / 8 * 1e9 / (eff * 450e9) + 7 * 3e-6
    assert collectives.reduce_scatter(c, 1e9, 8, 1) == pytest.approx(hand, rel=1e-12)
    assert collectives.all_reduce(c, 1e9, 1) == 0.0
    assert collectives.members_per_node(16, 4, 8) == 2


@pytest.mark.parametrize("p,m,v", [(4, 8, 1), (4, 1, 1), (8, 32, 1), (4, 8, 2), (4, 4, 2), (8, 16, 4), (2, 6, 3)])
def test_simulated_schedule_matches_closed_form_with_equal_passes(p, m, v):
    f, b = 1.0 / v, 2.0 / v
    r = simulate([[f] * v] * p, [[b] * v] * p, m)
    assert r.bubble_fraction == pytest.approx(closed_form_bubble(p, m, v), rel=1e-9)
    assert r.time == pytest.approx((m + (p - 1) / v) * 3.0, rel=1e-9)


def test_simulated_schedule_departs_from_closed_form_with_few_micro_batches():
    # one micro-batch through 4 stages with 0.5 s messages: 4 forwards + 3 messages + 4 backwards + 3 messages
    r = simulate([[1.0]] * 4, [[2.0]] * 4, 1, p2p=0.5)
    assert r.time == pytest.approx(4 * 1.0 + 3 * 0.5 + 4 * 2.0 + 3 * 0.5)
    assert r.bubble_fraction == pytest.approx(4.0) and closed_form_bubble(4, 1) == 3.0
    # unequal stages (the last one carries the output layer and loss): one micro-batch through 2 stages takes
    # 1 + 2 forward and 4 + 2 backward; the busiest stage (6 s) idles 3 s, not the closed form's (p - 1) / m = 1 x 6
    heavy = simulate([[1.0], [2.0]], [[2.0], [4.0]], 1)
    assert heavy.time == pytest.approx(9.0) and heavy.bubble_fraction == pytest.approx(0.5)
    # blocking messages cost every 1F1B step, not only the warm-up: more micro-batches, more message time
    assert simulate([[1.0]] * 4, [[2.0]] * 4, 8, p2p=0.5).time > (8 + 3) * 3.0 + 6 * 0.5


def test_megatron_orders():
    assert stage_order(0, 4, 6)[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 3, 0)]
    assert stage_order(3, 4, 6)[:2] == [("F", 0, 0), ("B", 0, 0)]
    inter = stage_order(0, 2, 4, 2)
    assert inter[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1)]
    assert sorted(inter) == sorted([(k, i, c) for k in "FB" for i in range(4) for c in range(2)])
    with pytest.raises(ValueError, match="multiple"):
        stage_order(0, 4, 6, 2)


GPT = ModelArgs(arch="transformer", num_layers=24, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
                gated_linear_unit=False, qk_layernorm=False)


def test_prediction_is_consistent():
    p = predict_step(GPT, Layout(dp=8, micro_batch_size=2, global_batch_size=64), "1x8xH100", seq_length=4096,
                     vocab_size=131072)
    assert sum(p.breakdown.values()) == pytest.approx(p.step_time_s, rel=1e-9)
    assert p.tokens_per_s == pytest.approx(64 * 4096 / p.step_time_s)
    assert 0.2 < p.mfu < 0.8 and p.num_microbatches == 4 and p.bubble_share == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="does not divide the 16 heads"):
        predict_step(GPT, Layout(tp=3, micro_batch_size=1), "1x3xH100", seq_length=4096, vocab_size=131072)
    with pytest.raises(ValueError, match="uses 16 GPUs"):
        predict_step(GPT, Layout(dp=16), "1x8xH100", seq_length=4096, vocab_size=131072)


def test_pipeline_bubble_and_tp_across_nodes():
    kw = dict(seq_length=4096, vocab_size=131072)
    # PP8 with 8 micro-batches: the closed form's (p - 1) / (m + p - 1) = 0.47 of the step idles on equal stages;
    # the last stage's output layer and loss make it the busiest, which idles less
    p = predict_step(GPT, Layout(pp=8, micro_batch_size=1, global_batch_size=8), "1x8xH100", **kw)
    assert 0.15 < p.bubble_share < 0.47
    many = predict_step(GPT, Layout(pp=8, micro_batch_size=1, global_batch_size=256), "1x8xH100", **kw)
    assert many.bubble_share < 0.1
    # TP8 over two nodes of 4 GPUs pays the network (4 ports, not NVLink) on every layer: slower than TP4 x PP2
    cross = predict_step(GPT, Layout(tp=8, micro_batch_size=1, global_batch_size=16, sequence_parallel=True),
                         "2x4xH100", **kw)
    inside = predict_step(GPT, Layout(tp=4, pp=2, micro_batch_size=1, global_batch_size=16, sequence_parallel=True),
                          "2x4xH100", **kw)
    assert cross.breakdown["tp_comm"] > 2 * inside.breakdown["tp_comm"]
    assert cross.step_time_s > inside.step_time_s
    # overlap hides TP communication only up to the GEMM it pairs with: across nodes some stays exposed
    hidden = predict_step(GPT, Layout(tp=8, micro_batch_size=1, global_batch_size=16, sequence_parallel=True,
                                      tp_comm_overlap=True), "2x4xH100", **kw)
    assert 0 < hidden.breakdown["tp_comm"] < cross.breakdown["tp_comm"]


def test_small_model_at_large_dp_is_bound_by_data_parallel_communication():
    small = ModelArgs(arch="transformer", num_layers=11, hidden_size=768, num_attention_heads=12)
    kw = dict(seq_length=4096, vocab_size=32000)
    node = predict_step(small, Layout(dp=8, micro_batch_size=1, global_batch_size=512), "1x8xH100", **kw)
    wide = predict_step(small, Layout(dp=512, micro_batch_size=1, global_batch_size=512), "64x8xH100", **kw)
    assert node.exposed_comm_share < 0.01 < 0.2 < wide.exposed_comm_share
    assert wide.breakdown["dp_grad_reduce"] > wide.breakdown["optimizer"]


def test_every_arch_has_operators_and_costs_at_least_the_transformer():
    # every arch but the Transformer adds operators through its module's hook (megatron_sat/archs/: step_ops)
    assert [a for a in ARCHS if type(archs.get(a)).step_ops is Arch.step_ops] == [archs.REFERENCE]
    base = dict(num_layers=8, hidden_size=1024, num_attention_heads=16)
    times = {}
    for arch in ARCHS:
        p = predict_step(ModelArgs(arch=arch, **base), Layout(dp=8, micro_batch_size=1, global_batch_size=8),
                         "1x8xH100", seq_length=2048, vocab_size=32000)
        times[arch] = p.step_time_s
    assert all(t >= times["transformer"] * 0.999 for t in times.values())
    assert times["satformer"] < 1.02 * times["transformer"] < times["muddformer"]


def _docs_table() -> str:
    text = (ROOT / "docs" / "step_time.md").read_text()
    m = re.search(r"<!-- published-table -->\n(.*?)\n<!-- /published-table -->", text, re.S)
    assert m, "docs/step_time.md lost its published-table markers"
    return m.group(1).strip()


@pytest.fixture(scope="module")
def published():
    return compare()


def test_docs_published_table_is_what_the_model_predicts(published):
    # regenerate with: python tools/check_steptime.py --update-docs
    assert _docs_table() == format_table(published).strip()


def test_published_goal_holds_and_the_error_band_is_the_check_rows_error(published):
    results = published
    checks = [abs(r["error"]) for r in results if r["role"] == "check"]
    assert STEP_TIME_ERROR == pytest.approx(sum(checks) / len(checks), abs=5e-4)
    errors = [abs(r["error"]) for r in results]
    assert sum(errors) / len(errors) <= 0.10 and max(errors) <= 0.20
    assert not math.isnan(sum(errors))


def test_importing_the_model_loads_no_torch():
    code = ("import sys; import megatron_sat.steptime as s; from megatron_sat.steptime import "
            "published; published.compare(published.H100_WEAK[:1]); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_gpu_check_predictions_run_and_measurement_skips_without_a_gpu(capsys):
    from tools import gpu_steptime_check as check  # the GPU check's tool: its predictions need no GPU

    rows = check.predicted_gemms("H200")
    assert len(rows) == 11 and all(0 < r["predicted_tflops"] < 989.4 for r in rows)
    sizes = {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_query_groups": 4,
             "ffn_hidden_size": 1024}
    assert check.predicted_micro_batch("satformer", sizes, "H200", 512, 1, 32000) > check.predicted_micro_batch(
        "transformer", sizes, "H200", 512, 1, 32000) > 0
    import torch

    if not torch.cuda.is_available():
        assert check.main([]) == 0
        assert "no CUDA device" in capsys.readouterr().out
    assert check.main(["--gpu", "V100"]) == 2


def test_precision_recompute_and_context_parallelism_move_the_step_the_right_way():
    kw = dict(seq_length=8192, vocab_size=32000)
    big = ModelArgs(arch="transformer", num_layers=8, hidden_size=8192, num_attention_heads=64)

    def step(**layout):
        return predict_step(big, Layout(tp=8, micro_batch_size=1, global_batch_size=8, sequence_parallel=True,
                                        **layout), "1x8xH100", **kw)

    none, selective, full = step(), step(recompute="selective"), step(recompute="full")
    assert none.step_time_s < selective.step_time_s < full.step_time_s
    # full recompute re-runs the forward: about a third more compute (forward ~ 1/3 of forward + backward)
    assert 1.2 < full.step_time_s / none.step_time_s < 1.45
    assert step(precision="fp8").step_time_s < 0.8 * none.step_time_s
    # CP2 halves each rank's queries: half the attention a micro-batch, the same model FLOPs a step
    cp = predict_step(big, Layout(tp=4, cp=2, micro_batch_size=1, global_batch_size=8, sequence_parallel=True),
                      "1x8xH100", **kw)
    tp = predict_step(big, Layout(tp=4, dp=2, micro_batch_size=1, global_batch_size=8, sequence_parallel=True),
                      "1x8xH100", **kw)
    per_micro_batch = cp.breakdown["attention"] / cp.num_microbatches, tp.breakdown["attention"] / tp.num_microbatches
    assert 0.45 < per_micro_batch[0] / per_micro_batch[1] < 0.55
    assert cp.tflops_per_gpu * cp.step_time_s == pytest.approx(tp.tflops_per_gpu * tp.step_time_s)
