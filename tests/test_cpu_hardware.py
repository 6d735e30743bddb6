"""This machine as the step-time model's hardware (megatron_sat/profiling/cpu_hardware.py): the description
reproduces the rates it was measured from, through the model's own roofline. The predicted-against-measured runs
are a script (tools/check_steptime_cpu.py, docs/step_time.md), not a test.

    .venv/bin/python -m pytest -q tests/test_cpu_hardware.py        # a few seconds
"""

import pytest

from megatron_sat.profiling.cpu_hardware import Measured, cpu_hardware, gemm_rates, model_shapes
from megatron_sat.steptime import roofline


def _measured():
    return Measured(threads=1, gemm_flops=40e9,
                    gemm_by_shape={"512x256x768": 30e9, "512x256x2048": 40e9, "512x1024x256": 50e9},
                    mem_bw=10e9, link_latency_s=200e-6, link_bw=1e9, op_overhead_s=5e-6, attention_flops=15e9,
                    attention_shape=(2, 4, 256, 64))


def test_the_description_reproduces_the_measured_rates():
    m = _measured()
    hw = cpu_hardware(m, ranks=2)
    overhead = hw.cal("kernel_overhead_us") * 1e-6
    assert overhead == pytest.approx(5e-6) and hw.gpus_per_node == 2
    # one shape's rate exactly (the peak is the median over shapes of rate / the model's shape factor there)
    rates = {}
    for shape in m.gemm_by_shape:
        mm, k, n = (int(x) for x in shape.split("x"))
        rates[shape] = 2 * mm * k * n / (roofline.gemm_time(hw, mm, n, k, "fp32") - overhead)
    assert any(abs(rates[s] / m.gemm_by_shape[s] - 1) < 1e-9 for s in rates)
    assert all(abs(rates[s] / m.gemm_by_shape[s] - 1) < 0.5 for s in rates)  # the others within the curve's reach
    b, a, s, d = m.attention_shape
    op = roofline.attention("attn", b, a, s, s, d)
    assert op.flops / (roofline.op_time(hw, op, "fp32") - overhead) == pytest.approx(15e9, rel=1e-9)
    # memory-bound work at the measured bandwidth; collectives on the measured link
    assert roofline.memory_time(hw, 1e9) == pytest.approx(0.1 + overhead)
    assert hw.intra_node_gbps == pytest.approx(1.0) and hw.intra_node_latency_us == pytest.approx(200)


def test_gemm_rates_are_measured_at_the_model_shapes():
    shapes = model_shapes(hidden=64, ffn=256, heads=4, groups=2, tokens=32, vocab=512, tp=2)
    assert shapes[0] == (32, 64, (4 + 2 * 2) * 16 // 2)  # QKV, TP-sharded
    rates = gemm_rates(shapes[:1])
    assert list(rates) == ["32x64x64"] and rates["32x64x64"] > 1e6
