"""What DenseFormer and MUDDFormer share: every earlier layer's output X_0..X_{i-1} carried from layer to layer
(on the pipeline wire too: model/dense_transport.py), so no full recompute; the paper's BF16-only baselines."""

from megatron_sat.archs.base import Arch


class Dense(Arch):
    dense = True
    baseline = True
    hf_code = (("layers.py", "layers.py"), ("configuration_baselines.py", "configuration_{arch}.py"),
               ("modeling_{arch}.py", "modeling_{arch}.py"))

    def wire_channels(self, config, last_first_layer: int) -> int:
        # padded to the widest boundary: before the last chunk (model/dense_transport.py)
        return (self.stream_count + last_first_layer) * config.hidden_size

    def hf_extra_fields(self, cfg, need) -> dict:
        return dict(value_residual_last_k=None)
