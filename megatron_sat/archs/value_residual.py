"""What ResFormer and SATFormer share: layer 1's values V1 carried to the mixing layers (the layer and attention
classes of model/layer.py and model/attention.py, V1 on the pipeline wire), and their remote code."""

from megatron_sat.archs.base import Arch


class ValueResidual(Arch):
    value_residual = True
    tags = ("value-residual",)
    layer_class = "megatron_sat.model.layer:ValueResidualTransformerLayer"
    attention_class = "megatron_sat.model.attention:ValueResidualSelfAttention"
    hf_code = (("layers.py", "layers.py"), ("configuration_valueresidual.py", "configuration_{arch}.py"),
               ("modeling_valueresidual.py", "modeling_{arch}.py"))
    hf_code_rewrites = (("from .configuration_valueresidual import", "from .configuration_{arch} import"),)

    def mixing_layers(self, model):
        """Layers 2..L, or the last k with value_residual_last_k = k (layer 1 produces V1)."""
        k = model.value_residual_last_k
        return list(range(2 if k is None else model.num_layers - k + 1, model.num_layers + 1))

    def hf_config(self, spec, decoder, remote) -> dict:
        return dict(remote, use_value_residual=True, value_residual_last_k=spec.value_residual_last_k)

    def hf_extra_fields(self, cfg, need) -> dict:
        need(cfg.get("use_value_residual", True), "use_value_residual=False (export it as a Transformer instead)")
        return {}


def value_mix(model, ctx, name: str):
    """The step-time operator of V' = l1 V1 + l2 V (ResFormer) or alpha V1 + V (SATFormer) in one kernel: reads V1
    and V, writes V' (3 g d / t values a token); backward: the gradients of V1 (accumulated) and V (5 g d / t)."""
    values = ctx.tokens * model.num_query_groups * model.kv_channels / ctx.tp
    return ctx.memory(name, 3 * values * ctx.act_bytes, group=name, bwd_bytes=5 * values * ctx.act_bytes)
