"""Gate telemetry for SATFormer: per layer, the mean gate value and the fraction of gates exactly 0.

Every ValueResidualSelfAttention keeps `last_alpha`, the detached gate of its last forward,
alpha [s, b, ng/tp] (this rank's KV heads; the whole sequence, also with sequence parallelism).
A forward hook on each mixing attention adds, on the device and without host syncs,
    sum(alpha), count(alpha == 0), numel(alpha)
into one [L, 3] accumulator (L = global layers). `collect()` (every log interval) all-reduces it
over the whole world: TP ranks hold different heads, PP ranks different layers, DP ranks different
data, so the sum is exactly the total over heads, layers and tokens. That is one small collective
and one host copy per log interval.

Evaluation forwards are excluded with `paused()`. With full recomputation a forward runs twice;
both runs see the same gates, so means and fractions are unchanged.
"""

import contextlib
from typing import Dict, Optional

import torch


class GateTelemetry:
    def __init__(self, chunks, num_layers: int, device):
        self.sums = torch.zeros(num_layers, 3, dtype=torch.float64, device=device)  # [L, (sum, zeros, n)]
        self.active = True
        self.handles = []
        for chunk in chunks:
            for module in chunk.modules():
                if getattr(module, "gated", False):
                    self.handles.append(module.register_forward_hook(self._hook))

    @property
    def enabled(self) -> bool:
        return bool(self.handles) or torch.distributed.get_world_size() > 1

    def _hook(self, module, inputs, output):
        alpha = module.last_alpha
        if not self.active or alpha is None:
            return
        row = self.sums[module.layer_number - 1]
        row[0] += alpha.sum(dtype=torch.float64)
        row[1] += (alpha == 0).sum()
        row[2] += alpha.numel()

    @contextlib.contextmanager
    def paused(self):
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def collect(self) -> Optional[Dict[str, list]]:
        """{'gate_mean': [per layer], 'gate_zero_frac': [per layer]} since the last call (None if no
        layer has a gate anywhere); layers without a gate (layer 1) report None. Every rank calls it."""
        sums = self.sums.clone()
        self.sums.zero_()
        torch.distributed.all_reduce(sums)
        sums = sums.cpu()
        if sums[:, 2].sum() == 0:
            return None
        mean = [None if n == 0 else round(float(s / n), 6) for s, z, n in sums.tolist()]
        zero = [None if n == 0 else round(float(z / n), 6) for s, z, n in sums.tolist()]
        return {"gate_mean": mean, "gate_zero_frac": zero}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
