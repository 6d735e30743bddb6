"""SATFormer: V' = V + alpha(x) V1 in the mixing layers, alpha = f(x W_alpha) per KV head (the paper's gate,
model/attention.py); W_alpha's rows fused into linear_qkv by default (model/fused_gate.py), padded per TP rank to a
multiple of 16 rows."""

from megatron_sat.archs.registry import register
from megatron_sat.archs.value_residual import ValueResidual, value_mix

FUSED_ROW_MULTIPLE = 16  # each TP rank's fused linear_qkv width is padded to a multiple of this
ZERO_AT_ZERO = ("relu", "tanh", "identity")  # the gates with f(0) = 0: W_alpha = 0 is the Transformer's function


def fused_padding(groups: int, q_per_group: int, head_dim: int) -> int:
    """Zero rows that pad one TP rank's fused QKV + gate width ((q + 2) d per group, one gate row per group)."""
    width = groups * ((q_per_group + 2) * head_dim + 1)
    return -width % FUSED_ROW_MULTIPLE


class SATFormer(ValueResidual):
    name = "satformer"
    title = "SATFormer"
    colour = "#C44E52"
    gated = True
    hf_model_type = "SATFormer"
    hf_class = "SATFormer"
    hf_layer_weights = (
        ("self_attention.value_residual_gate.weight", "{attn}.value_residual_mixing.alpha_proj.weight", "ng h", "ng h",
         None, "mixing"),
    )

    upcycle_note = "W_alpha ~ N(0, {std}^2) (--upcycle-gate-std), every other weight the Transformer's"

    def upcycle_switch(self, field) -> bool:
        return field.startswith("value_residual_")  # the gate, its impl, last-k

    def own_fields(self, model) -> tuple:
        return ("self_attention.value_residual_gate.weight",)

    def upcycle_errors(self, model, setting) -> list:
        if model.value_residual_gate in ZERO_AT_ZERO:
            return []
        return [f"{setting('value_residual_gate', model.value_residual_gate)} is not 0 at 0, so a SATFormer started "
                "from a Transformer would not compute the Transformer's function: use one of "
                f"{', '.join(ZERO_AT_ZERO)}"]

    def upcycle_start(self, name, std) -> tuple:
        """W_alpha ~ N(0, std^2): std 0 is exactly the Transformer (alpha = f(0) = 0), but a ReLU gate's gradient
        is 0 there and it never opens; a small std opens about half the gate units, alpha V1 tiny."""
        return ("normal", std)

    def fused_gate(self, cfg, tp: int) -> bool:
        """Whether the gate is fused at TP size `tp`: the fused impl, num_query_groups divisible by TP, no bias."""
        ng = getattr(cfg, "num_query_groups", None) or cfg.num_attention_heads
        return (getattr(cfg, "value_residual_gate_impl", "fused") == "fused" and ng % tp == 0
                and not (getattr(cfg, "add_bias_linear", False) or getattr(cfg, "add_qkv_bias", False)))

    def padding_rows(self, cfg, tp: int) -> int:
        """Zero padding rows of one fused layer's weight over all TP ranks (0 when the gate is not fused)."""
        if not self.fused_gate(cfg, tp):
            return 0
        nh = cfg.num_attention_heads
        ng = getattr(cfg, "num_query_groups", None) or nh
        d = getattr(cfg, "kv_channels", None) or cfg.hidden_size // nh
        return tp * fused_padding(ng // tp, nh // ng, d)

    def unfused_input_norm(self, config) -> bool:
        return not config.fused_value_residual_gate  # the separate gate reads the normalised x

    def layer_parameters(self, model, layer, tp, parts) -> bool:
        if layer not in self.mixing_layers(model):
            return False
        parts["value_residual"] = model.num_query_groups * model.hidden_size  # W_alpha
        parts["gate_padding"] = model.hidden_size * self.padding_rows(model, tp)
        return self.fused_gate(model, tp)

    def flops(self, cfg, out, dims, tp) -> None:
        m, h, ng = dims["m"], dims["h"], dims["ng"]
        out["gate"] = m * (2 * h * ng + ng)
        out["gate_padding"] = m * 2 * h * self.padding_rows(cfg, tp)
        out["mixing"] = m * 2 * ng * dims["d"]

    def activation_extra(self, cfg, *, s, b, t, act) -> float:
        return act * s * b * cfg.num_query_groups / t  # the gate's output alpha [s, b, ng/t]

    def v1_kept_on_first_layer(self) -> bool:
        return True

    def hf_config(self, spec, decoder, remote) -> dict:
        return dict(super().hf_config(spec, decoder, remote), value_residual_gate=spec.value_residual_gate,
                    value_residual_proj_bias=False)

    def hf_extra_fields(self, cfg, need) -> dict:
        return dict(super().hf_extra_fields(cfg, need), value_residual_gate=cfg.get("value_residual_gate", "relu"))

    def step_ops(self, model, layer, ctx):
        """Mixing layers: the gate's ng rows inside linear_qkv (fused; separate: its own replicated [h, ng] GEMM), the
        gate function and the mix alpha V1 + V in one kernel (value_mix; backward: model/fused_gate.py's fused
        kernel). The fused layout's zero padding (under 16 rows a rank) is left out."""
        if layer not in model.mixing_layers:
            return ctx.layer()
        ng, h = model.num_query_groups, model.hidden_size
        fused = model.value_residual_gate_impl == "fused" and ng % ctx.tp == 0 and not model.add_bias_linear
        mix = value_mix(model, ctx, "satformer gate + mix")
        if fused:
            return ctx.layer(ops=[mix], qkv_columns=ng)
        return ctx.layer(ops=[ctx.gemm("satformer gate GEMM", ctx.tokens, ng, h, group="satformer gate GEMM"), mix])



ARCH = register(SATFormer())
