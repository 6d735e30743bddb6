"""Device compatibility for megatron-sat.

All CPU (gloo, no GPU) workarounds for megatron-core live in :mod:`megatron_sat.compat.cpu` (its docstring lists
the patches) and, for the dry run's meta device, :mod:`megatron_sat.compat.meta`; nothing outside this package
knows about them.  Typical use, before building any megatron object::

    from megatron_sat import compat
    compat.ensure_cpu_compat()          # no-op on a GPU machine
    torch.distributed.init_process_group(backend=compat.dist_backend())
    x = torch.zeros(4, device=compat.device())
"""

from megatron_sat.compat.cpu import (
    FAKE_BACKEND,
    device,
    dist_backend,
    ensure_cpu_compat,
    forget_cached_torch_attributes,
    is_cpu_mode,
)
from megatron_sat.compat.meta import meta_device

__all__ = ["ensure_cpu_compat", "device", "dist_backend", "is_cpu_mode", "meta_device", "FAKE_BACKEND",
           "forget_cached_torch_attributes"]
