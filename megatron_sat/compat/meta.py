"""The meta device for the dry run (megatron_sat/profiling/dry_run.py): patches P9, P11 and P12 of the CPU
compatibility layer (compat/cpu.py's docstring lists them all), active only inside :func:`meta_device`."""

from __future__ import annotations

import contextlib
import functools

import torch

from megatron_sat.compat.cpu import _LOCK, _META, _TARGET, ensure_cpu_compat


# ---------------------------------------------------------------------------------------------------------------
# P9: the meta device, for the dry run (megatron_sat/profiling/dry_run.py)
# ---------------------------------------------------------------------------------------------------------------
def _meta_zero(dtype):
    return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0


def _scalar_patch(name, convert):
    orig = getattr(torch.Tensor, name)

    def patched(self, *args, **kwargs):
        if self.device.type != "meta":
            return orig(self, *args, **kwargs)
        return convert(self)

    return name, orig, patched


def _meta_type_patch():
    orig = torch.Tensor.type

    def patched(self, dtype=None, non_blocking=False, **kwargs):
        out = orig(self, dtype, non_blocking, **kwargs)
        if dtype is None and isinstance(out, str):
            return out.replace("torch.meta.", "torch.")  # megatron's type-string checks (P4) see a CPU tensor
        return out

    return "type", orig, patched


_ORIG_SDPA = torch.nn.functional.scaled_dot_product_attention


def _meta_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """P12: scaled_dot_product_attention picks its kernel per device, and on meta tensors always the math one (it
    keeps the [b, heads, s, s] scores for backward). Run the kernel the CPU would pick for the same shapes instead
    (its flash kernel keeps q, k, v, the output and the log-sum-exp), so that the bytes a dry run saves are a CPU
    run's (tests/test_dry_run.py compares them)."""
    if not query.is_meta:
        return _ORIG_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa)

    def cpu(t):  # an uninitialised CPU stand-in: the choice reads shapes, strides and dtypes only
        return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)

    choice = torch._fused_sdp_choice(cpu(query), cpu(key), cpu(value), cpu(attn_mask), dropout_p, is_causal,
                                     scale=scale, enable_gqa=enable_gqa)
    if choice != torch.nn.attention.SDPBackend.FLASH_ATTENTION.value:
        return _ORIG_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                                       attn_mask=attn_mask, scale=scale)[0]


# (name, original, meta-aware) Tensor methods swapped in by meta_device()
_META_TENSOR_PATCHES = [
    _scalar_patch("item", lambda t: _meta_zero(t.dtype)),
    _scalar_patch("tolist", lambda t: torch.zeros(t.shape, dtype=t.dtype).tolist()),
    _scalar_patch("__float__", lambda t: 0.0),
    _scalar_patch("__int__", lambda t: 0),
    _scalar_patch("__bool__", lambda t: False),
    _meta_type_patch(),
]


_COALESCED_OPS = ("reduce_scatter_tensor_coalesced_", "allgather_into_tensor_coalesced_", "allreduce_coalesced_",
                  "allgather_coalesced_")
_META_LIBRARY = []


def _register_meta_collectives() -> None:
    """P11: torch 2.13 has Meta kernels for every c10d collective but the coalesced ones, which megatron's DDP uses
    for its gradient reduce-scatter / all-reduce and parameter all-gather. Their Meta kernel here redispatches to
    the CPU kernel, which hands the call to the process group's backend: under the fake backend that touches no
    data, so meta tensors pass through (a real backend would fail on them, as it fails without this)."""
    if _META_LIBRARY:
        return
    lib = torch.library.Library("c10d", "IMPL")
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    for name in _COALESCED_OPS:
        op = getattr(torch.ops.c10d, name).default
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"):
            continue  # a newer torch has its own
        lib.impl(name, functools.partial(lambda op, *args: op.redispatch(cpu, *args), op), "Meta")
    _META_LIBRARY.append(lib)


@contextlib.contextmanager
def meta_device():
    """Build and run megatron on the meta device: shapes and dtypes, no memory, no arithmetic (the dry run).

    Inside: megatron's ``torch.cuda.current_device()`` and every CUDA device argument (P1, P2) and :func:`device`
    give ``meta`` (tensors made without a device stay on the CPU: megatron keeps a few small values there, e.g.
    the attention mask type of a recomputed attention); and
    ``Tensor.item()`` / ``.tolist()`` of a meta tensor give zeros instead of raising (a meta tensor holds no
    value; megatron reads a few scalars in a step: the loss sums of the schedule, the gradient norm, the
    optimizer's found-inf flag); scaled_dot_product_attention runs the kernel the CPU would (P12). Nothing changes
    for CPU tensors. Not thread-safe; CPU mode only."""
    if not ensure_cpu_compat():
        raise RuntimeError("meta_device() is for CPU mode (no GPU visible)")
    with _LOCK:
        _register_meta_collectives()
        previous = _TARGET[0]
        _TARGET[0] = _META
        for name, _, patched in _META_TENSOR_PATCHES:
            setattr(torch.Tensor, name, patched)
        torch.nn.functional.scaled_dot_product_attention = _meta_sdpa
        try:
            yield
        finally:
            _TARGET[0] = previous
            for name, orig, _ in _META_TENSOR_PATCHES:
                setattr(torch.Tensor, name, orig)
            torch.nn.functional.scaled_dot_product_attention = _ORIG_SDPA
