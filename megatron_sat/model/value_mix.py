"""SATFormer's mix V' = V + alpha * V1 as one fused kernel on GPU (torch only, no Megatron).

    v [s, b, ng, hn], alpha [s, b, ng], v1 [s, b, ng, hn] -> v' [s, b, ng, hn]
    backward: dV = dV', dV1 = alpha * dV', dalpha = sum_hn(dV' * V1)

Eager, the forward is two passes over [s, b, ng, hn] (product, sum) and the backward three. On CUDA
the fused impl hands the same formula to torch.compile, whose Inductor backend emits one Triton kernel
for the forward and one for the backward (the reduction over hn included). CPU tensors always take
the eager formula (torch.compile is never invoked there).
"""

import torch


def mix_eager(value: torch.Tensor, alpha: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    return value + alpha.unsqueeze(-1) * v1  # [s, b, ng, hn]


_compiled = None


def mix_fused(value: torch.Tensor, alpha: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    """mix_eager, compiled into one kernel forward and one backward on CUDA; eager elsewhere."""
    global _compiled
    if not value.is_cuda:
        return mix_eager(value, alpha, v1)
    if _compiled is None:
        _compiled = torch.compile(mix_eager, fullgraph=True, dynamic=False)
    return _compiled(value, alpha, v1)
