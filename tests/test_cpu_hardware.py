"""This machine as the step-time model's hardware (megatron_sat/profiling/cpu_hardware.py): the description
reproduces the rates it was measured from, through the model's own roofline, for the forward and both backward
GEMMs, and a 2-rank run gets the rates measured with two ranks busy. The predicted-against-measured runs are a
script (tools/check_steptime_cpu.py, docs/step_time.md), not a test.

    .venv/bin/python -m pytest -q tests/test_cpu_hardware.py        # a few seconds
"""

import pytest

from megatron_sat.profiling.cpu_hardware import Measured, Rates, cpu_hardware, gemm_rates, model_shapes
from megatron_sat.steptime import roofline


def _rates(scale=1.0):
    return Rates(gemm_by_shape={"fwd 512x256x768": 30e9 * scale, "dgrad 512x256x768": 24e9 * scale,
                                "wgrad 512x256x768": 27e9 * scale, "fwd 512x1024x256": 50e9 * scale,
                                "wgrad 512x1024x256": 40e9 * scale},  # an odd count: the median is one of them
                 mem_bw=10e9 * scale, op_overhead_s=5e-6 / scale, attention_flops=15e9 * scale)


def _measured():
    return Measured(threads=1, alone=_rates(), link_latency_s=200e-6, link_bw=1e9, busy={2: _rates(0.5)},
                    attention_shape=(2, 4, 256, 64))


def _roofline_rate(hw, key, overhead):
    """The rate the model's roofline gives the GEMM a measured key names, called as that pass calls it."""
    name, shape = key.split()
    m, k, n = (int(x) for x in shape.split("x"))
    op = roofline.gemm("g", m, n, k)
    flops = 2 * m * k * n
    if name == "fwd":
        return flops / (roofline.op_time(hw, op, "fp32") - overhead)
    dgrad = roofline.gemm_time(hw, m, k, n, "fp32") - overhead  # the two halves of op_time(backward=True)
    wgrad = roofline.gemm_time(hw, k, n, m, "fp32") - overhead
    assert roofline.op_time(hw, op, "fp32", backward=True) == pytest.approx(dgrad + wgrad + 2 * overhead)
    return flops / (dgrad if name == "dgrad" else wgrad)


def test_the_description_reproduces_the_measured_rates():
    m = _measured()
    hw = cpu_hardware(m, ranks=1)
    overhead = hw.cal("kernel_overhead_us") * 1e-6
    assert overhead == pytest.approx(5e-6) and hw.gpus_per_node == 1
    # one GEMM's rate exactly (the peak is the median over shapes and passes of rate / the shape factor there)
    rates = {key: _roofline_rate(hw, key, overhead) for key in m.alone.gemm_by_shape}
    ratios = sorted(rates[k] / m.alone.gemm_by_shape[k] for k in rates)
    assert any(abs(r - 1) < 1e-9 for r in ratios)
    assert all(abs(r - 1) < 0.5 for r in ratios)  # the others within the curve's reach
    # backward passes measured slower than the forward lower the peak: it is not the forward's alone
    forward = {k: v for k, v in m.alone.gemm_by_shape.items() if k.startswith("fwd")}
    forward_only = Measured(threads=1, alone=Rates(forward, 10e9, 5e-6, 15e9), link_latency_s=0, link_bw=1e9)
    assert hw.peak("fp32") < 0.9 * cpu_hardware(forward_only, ranks=1).peak("fp32")
    b, a, s, d = m.attention_shape
    op = roofline.attention("attn", b, a, s, s, d)
    both = roofline.op_time(hw, op, "fp32") + roofline.op_time(hw, op, "fp32", backward=True) - 2 * overhead
    assert op.flops * (1 + roofline.ATTN_BWD_FACTOR) / both == pytest.approx(15e9, rel=1e-9)
    # memory-bound work at the measured bandwidth; collectives on the measured link
    assert roofline.memory_time(hw, 1e9) == pytest.approx(0.1 + overhead)
    assert hw.intra_node_gbps == pytest.approx(1.0) and hw.intra_node_latency_us == pytest.approx(200)


def test_a_two_rank_run_gets_the_rates_measured_with_two_ranks_busy():
    m = _measured()
    alone, busy = cpu_hardware(m, ranks=1), cpu_hardware(m, ranks=2)
    assert busy.gpus_per_node == 2
    assert busy.peak("fp32") == pytest.approx(0.5 * alone.peak("fp32"), rel=1e-9)
    assert busy.hbm_gbps == pytest.approx(0.5 * alone.hbm_gbps)
    assert busy.cal("kernel_overhead_us") == pytest.approx(2 * alone.cal("kernel_overhead_us"))
    with pytest.raises(ValueError, match="not 4"):
        cpu_hardware(m, ranks=4)


def test_a_recorded_step_overhead_is_the_runs_own_and_adds_to_every_step():
    """The trainer's step besides its operators, recorded per rank count (tools/check_steptime_cpu.py measures it
    on a tiny model): a 2-rank description gets the 2-rank figure, a 1-rank one the 1-rank figure, and the model's
    step is longer by exactly it; unrecorded is 0, and a negative residual is clipped to 0."""
    from megatron_sat import steptime
    from megatron_sat.model.args import model_args
    from megatron_sat.training.planner import resolve_args

    m = _measured()
    assert cpu_hardware(m, ranks=2).cal("step_overhead_s") == 0.0
    rec = m.with_step_overhead(1, 0.05).with_step_overhead(2, 0.12)
    assert m.step_overhead_s == {}  # a copy
    assert cpu_hardware(rec, ranks=1).cal("step_overhead_s") == 0.05
    assert cpu_hardware(rec, ranks=2).cal("step_overhead_s") == 0.12
    assert m.with_step_overhead(2, -0.01).step_overhead_s == {2: 0.0}
    assert "2 rank(s) 120 ms" in str(rec)
    args = resolve_args(None, ["--recipe", "debug_transformer", "--no-bf16", "--train-iters", "1"])
    layout = steptime.layout_from_args(args, 2)

    def step(meas):
        cluster = steptime.Cluster(gpu=cpu_hardware(meas, ranks=2), nodes=1, gpus_per_node=2)
        return steptime.predict_step(model_args(args), layout, cluster, seq_length=args.seq_length,
                                     vocab_size=4096).step_time_s

    assert step(rec) - step(m) == pytest.approx(0.12, rel=1e-9)


def test_gemm_rates_are_measured_at_the_model_shapes_in_every_pass():
    shapes = model_shapes(hidden=64, ffn=256, heads=4, groups=2, tokens=32, vocab=512, tp=2)
    assert shapes[0] == (32, 64, (4 + 2 * 2) * 16 // 2)  # QKV, TP-sharded
    rates = gemm_rates(shapes[:1])
    assert list(rates) == ["fwd 32x64x64", "dgrad 32x64x64", "wgrad 32x64x64"]
    assert all(r > 1e6 for r in rates.values())
