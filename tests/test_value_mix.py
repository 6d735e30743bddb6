"""SATFormer's mix V' = V + alpha * V1 (megatron_sat/model/value_mix.py): the formula and its backward
(dV = dV', dV1 = alpha * dV', dalpha = sum over the head dim of dV' * V1), the CPU path staying eager,
and on CUDA the torch.compile'd kernel against the eager formula (skipped without a GPU)."""

import pytest
import torch

from megatron_sat.model import value_mix

SHAPE = (16, 3, 4, 32)  # [s, b, ng, hn]


def _inputs(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    v, v1, dout = (torch.randn(SHAPE, generator=g, dtype=torch.float64) for _ in range(3))
    alpha = torch.relu(torch.randn(SHAPE[:-1], generator=g, dtype=torch.float64))
    return [t.to(device=device, dtype=dtype).requires_grad_(i < 3) for i, t in enumerate((v, alpha, v1, dout))]


def _run(fn, v, alpha, v1, dout):
    out = fn(v, alpha, v1)
    grads = torch.autograd.grad(out, (v, alpha, v1), dout)
    return [out.detach(), *grads]


def test_mix_and_its_backward_are_the_formulas_on_cpu():
    v, alpha, v1, dout = _inputs(torch.float64, "cpu")
    out, dv, dalpha, dv1 = _run(value_mix.mix_fused, v, alpha, v1, dout)
    assert value_mix._compiled is None  # CPU tensors never reach torch.compile
    assert torch.equal(out, v.detach() + alpha.detach()[..., None] * v1.detach())
    assert torch.equal(dv, dout)
    assert torch.equal(dv1, alpha.detach()[..., None] * dout)
    assert torch.allclose(dalpha, (dout * v1.detach()).sum(-1), rtol=1e-15, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-6), (torch.bfloat16, 1.6e-2)])
def test_compiled_mix_equals_eager_on_cuda(dtype, rtol):
    """One compiled kernel forward and backward: the eager formula's values within the dtype's rounding
    (bf16: 2 ulp of 2^-8 on the sum over hn = 32 of dalpha)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    inputs = _inputs(dtype, "cuda")
    got = _run(value_mix.mix_fused, *inputs)
    want = _run(value_mix.mix_eager, *inputs)
    assert value_mix._compiled is not None
    for name, a, b in zip(("out", "dV", "dalpha", "dV1"), got, want, strict=True):
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        assert err <= rtol, f"{dtype} {name}: compiled differs from eager by {err:.2e} of its max"
