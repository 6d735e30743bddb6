"""Bad configurations and layouts are refused with a message that names the problem."""

import pytest

from megatron_sat.model.config import make_config
from megatron_sat.parallel.layout import Layout, validate

SIZES = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128)


def _config(**overrides):
    return make_config(**{"arch": "satformer", **SIZES, **overrides})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(arch="mamba"), "unknown arch 'mamba'"),
        (dict(value_residual_gate="gelu"), "unknown value_residual_gate 'gelu'"),
        (dict(value_residual_last_k=0), r"value_residual_last_k must be in \[1, num_layers - 1\] = \[1, 3\]"),
        (dict(value_residual_last_k=4), r"value_residual_last_k must be in \[1, num_layers - 1\]"),
        (dict(num_layers=1), "needs num_layers >= 2"),
        (dict(arch="resformer", num_layers=1), "needs num_layers >= 2"),
        (dict(resformer_lambdas="frozen"), "unknown resformer_lambdas 'frozen'"),
        (dict(arch="denseformer", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
         "arch 'denseformer' carries every earlier layer's output.*use recompute_granularity='selective'"),
        (dict(arch="muddformer", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
         "arch 'muddformer' carries every earlier layer's output"),
        (dict(arch="hyperconnections", fp8="hybrid"), "FP8 is not supported for the hyperconnections baseline"),
        (dict(arch="hyperconnections", hc_expansion_rate=0), r"hc_expansion_rate must be >= 1 \(got 0\)"),
        (dict(qk_norm_eps=0.0), r"qk_norm_eps must be > 0 \(got 0.0\)"),
        (dict(local_attention="flash"), "unknown local_attention 'flash'"),
        (dict(value_residual_gate_impl="triton"), "value_residual_gate_impl"),
    ],
)
def test_bad_model_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_one_layer_transformer_is_fine():
    assert _config(arch="transformer", num_layers=1).mixing_layers == []


def test_mixing_layers():
    assert _config().mixing_layers == [2, 3, 4]
    assert _config(value_residual_last_k=2).mixing_layers == [3, 4]
    assert _config(arch="transformer").mixing_layers == []


@pytest.mark.parametrize(
    "layout, world, kwargs, message",
    [
        (Layout(tp=8), 8, {}, "num_attention_heads=4 is not divisible by TP=8"),
        (Layout(tp=4), 4, {}, r"KV heads \(num_query_groups=2\) are not divisible by TP=4"),
        (Layout(pp=3), 3, {}, "num_layers=4 is not divisible by PP = 3"),
        (Layout(pp=2, vpp=4), 2, {}, r"num_layers=4 is not divisible by PP x VPP = 2 x 4"),
        (Layout(pp=2, vpp=2), 2, dict(num_microbatches=3), "multiple of PP=2"),
        (Layout(pp=2), 2, dict(num_microbatches=1), "cannot fill a 2-stage pipeline"),
        (Layout(tp=2), 3, {}, "world size 3 is not divisible by TP\\*PP\\*CP = 2"),
        (Layout(sp=True), 1, {}, "sequence parallelism needs TP > 1"),
        (Layout(tp=2, sp=True), 2, dict(seq_length=15), "seq_length=15 is not divisible by TP=2"),
        (Layout(cp=2), 2, dict(seq_length=16), "context parallelism needs Transformer Engine"),
    ],
)
def test_bad_layout(layout, world, kwargs, message):
    with pytest.raises(ValueError, match=message):
        validate(layout, _config(), world, **kwargs)


def test_layout_reports_every_problem_at_once():
    with pytest.raises(ValueError) as err:
        validate(Layout(tp=8, pp=3), _config(), 24)
    text = str(err.value)
    assert "num_attention_heads=4" in text and "num_layers=4" in text and "TP8xPP3xDP1" in text


def test_good_layouts_pass():
    for layout, world in [(Layout(), 1), (Layout(tp=2, sp=True), 4), (Layout(pp=2, vpp=2), 2), (Layout(tp=2, pp=2), 4)]:
        validate(layout, _config(), world, seq_length=16, num_microbatches=4)
