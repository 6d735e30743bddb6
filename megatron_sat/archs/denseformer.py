"""DenseFormer: after every block a depth-weighted average of X_0..X_i (model/denseformer.py)."""

from megatron_sat.archs.dense import Dense
from megatron_sat.archs.registry import register


class DenseFormer(Dense):
    name = "denseformer"
    title = "DenseFormer"
    colour = "#55A868"
    tags = ("denseformer",)
    aliases = ("dwa",)
    layer_class = "megatron_sat.model.denseformer:DenseFormerLayer"
    hf_model_type = "denseformer"
    hf_class = "DenseFormer"
    memory_note = ("each layer's output X_i, kept for the depth-weighted averages, the history on the pipeline "
                   "message and its gradients in backward")

    def layer_parameters(self, model, layer, tp, parts) -> bool:
        parts["connections"] = layer + 1  # DWA weights over X_0..X_i
        return False

    def flops(self, cfg, out, dims, tp) -> None:
        out["connections"] = sum((2 * (i + 1) - 1) * dims["h"] for i in range(1, dims["L"] + 1))  # weighted sums

    def connection_bytes(self, cfg, layer, *, s, b, t, sp_div, act, local, first_in_chunk, recompute) -> float:
        return act * s * b * cfg.hidden_size / sp_div  # X_i

    def hf_config(self, spec, decoder, remote) -> dict:
        return dict(remote, dwa_dilation=1, dwa_period=1)

    def hf_extra_fields(self, cfg, need) -> dict:
        need(cfg.get("dwa_dilation", 1) == 1 and cfg.get("dwa_period", 1) == 1,
             "dwa_dilation or dwa_period other than 1 (the Megatron model averages after every block)")
        return super().hf_extra_fields(cfg, need)

    def layer_extras(self, spec) -> list:
        # after layer i (0-based): weights over X_0 .. X_{i+1}
        return [(f"decoder.layers.{i}.dwa_weights", f"model.dwa_modules.alphas.{i}.weight", (i + 2,), (1, i + 2))
                for i in range(spec.num_layers)]

    def step_ops(self, model, layer, ctx):
        """The depth-weighted average after layer i over k = i + 1 outputs X_0..X_i: reads k h, writes h; backward
        reads the gradient and the k inputs and accumulates k gradients ((1 + 3k) h)."""
        k, u = layer + 1, ctx.sp_tokens * model.hidden_size * ctx.act_bytes
        name = "denseformer weighted sum"
        return ctx.layer(ops=[ctx.memory(name, (k + 1) * u, group=name, bwd_bytes=(1 + 3 * k) * u)])



ARCH = register(DenseFormer())
