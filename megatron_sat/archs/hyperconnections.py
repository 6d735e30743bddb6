"""Hyper-Connections: n residual streams H [s, b, n x h], mixed before attention and before the MLP by static (and,
by default, dynamic tanh) connection weights (model/hyperconnections.py); the first layer widens the stream, the
last sums it."""

from megatron_sat.archs.base import Arch
from megatron_sat.archs.registry import register

# one Hyper-Connection's tensors: Megatron's name -> the authors'
HC_NAMES = {"static_alpha": "static_alpha", "static_beta": "static_beta", "norm.weight": "norm.weight",
            "dynamic_alpha": "dynamic_alpha_proj", "dynamic_beta": "dynamic_beta_proj",
            "dynamic_alpha_scale": "dynamic_alpha_scale", "dynamic_beta_scale": "dynamic_beta_scale"}
HC_SUBLAYERS = {"attention_hc": "attn_hc", "mlp_hc": "mlp_hc"}  # Megatron -> the authors' module names


def hc_shapes(spec) -> dict:
    """One Hyper-Connection's tensors under their Megatron names (HC_NAMES gives the authors')."""
    n, h = spec.hc_expansion_rate, spec.hidden_size
    out = {"static_alpha": (n, n + 1), "static_beta": (n,)}
    if spec.hc_dynamic:
        out.update({"norm.weight": (h,), "dynamic_alpha": (h, n + 1), "dynamic_beta": (h,),
                    "dynamic_alpha_scale": (1,), "dynamic_beta_scale": (1,)})
    return out


class HyperConnections(Arch):
    name = "hyperconnections"
    title = "Hyper-Connections"
    colour = "#937860"
    tags = ("hyperconnections",)
    baseline = True
    aliases = ("hyper_connections", "hyper-connections", "hc")
    layer_class = "megatron_sat.model.hyperconnections:HyperConnectionsLayer"
    hf_model_type = "dhc"
    hf_class = "HyperConnections"
    paper_satformer_vs = (1.75, 0.31)
    memory_note = ("the n residual streams ([s, b, n x h] and the [s, b, (n+1) x h] mix per sublayer), the "
                   "dynamic weights and the n x h-wide pipeline message")
    hf_code = (("layers.py", "layers.py"), ("configuration_baselines.py", "configuration_{arch}.py"),
               ("modeling_{arch}.py", "modeling_{arch}.py"))

    def errors(self, model, name, setting) -> list:
        errors = super().errors(model, name, setting)
        if model.hc_expansion_rate < 1:
            errors.append(f"{name('hc_expansion_rate')} must be >= 1 (got {model.hc_expansion_rate})")
        return errors

    def wire_channels(self, config, last_first_layer: int) -> int:
        return (config.hc_expansion_rate - 1) * config.hidden_size  # the other n - 1 streams

    def layer_parameters(self, model, layer, tp, parts) -> bool:
        n, h = model.hc_expansion_rate, model.hidden_size
        hc = n * (n + 1) + n  # static alpha, beta
        if model.hc_dynamic:
            hc += h + h * (n + 1) + h + 2  # norm, dynamic alpha, beta, their two scales
        parts["connections"] = 2 * hc  # before attention and before the MLP
        return False

    def flops(self, cfg, out, dims, tp) -> None:
        n, h, L = cfg.hc_expansion_rate, dims["h"], dims["L"]
        per_sublayer = 2 * n * (n + 1) * h + 2 * n * h  # width mix, beta y +
        if cfg.hc_dynamic:
            per_sublayer += 2 * n * h * (n + 1) + 2 * n * h + 3 * n * (n + 2)
        out["connections"] = L * 2 * per_sublayer + (n - 1) * h  # + the streams' sum in layer L

    def connection_bytes(self, cfg, layer, *, s, b, t, sp_div, act, local, first_in_chunk, recompute) -> float:
        h, n = cfg.hidden_size, cfg.hc_expansion_rate
        u = act * s * b * h / sp_div  # one [s, b, h]
        x = act * s * b / sp_div  # one value per token
        stat = 4 * s * b / sp_div  # a norm's fp32 1/rms per token
        local_norm = (8 - act) * s * b * h / sp_div  # the local RMSNorm's fp32 x * rsqrt
        if recompute == "full":
            return 0.0 if layer == 1 else (n - 1) * u  # the checkpointed input is [s, b, n*h]
        out = 4 * n * u - ((n - 1) * u if layer == 1 else 0) + 2 * u  # H, mixes; sublayer outputs y
        if cfg.hc_dynamic:  # per sublayer: normed H [s, b, n*h], alpha/tanh [s, b, n, n+1], beta/tanh [s, b, n]
            out += 2 * (n * u + n * (2 * n + 4) * x + n * stat + (n * local_norm if local else 0))
        return out

    def hf_config(self, spec, decoder, remote) -> dict:
        return dict(remote, expansion_rate=spec.hc_expansion_rate, use_dynamic_hc=spec.hc_dynamic, use_tanh=True,
                    hc_norm_type="rms")

    def hf_extra_fields(self, cfg, need) -> dict:
        need(cfg.get("use_tanh", True), "use_tanh=False (the Megatron model's dynamic weights use tanh)")
        need(cfg.get("hc_norm_type", "rms") == "rms", f"hc_norm_type {cfg.get('hc_norm_type')!r} (need 'rms')")
        return dict(value_residual_last_k=None, hc_expansion_rate=cfg.get("expansion_rate", 4),
                    hc_dynamic=cfg.get("use_dynamic_hc", True))

    def layer_extras(self, spec) -> list:
        out = []
        for i in range(spec.num_layers):
            m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
            for sub, theirs in HC_SUBLAYERS.items():
                out += [(m + f"{sub}.{name}", p + f"{theirs}.{HC_NAMES[name]}", shape, shape)
                        for name, shape in hc_shapes(spec).items()]
        return out

    def step_ops(self, model, layer, ctx):
        """n streams, per sublayer (two a layer): dynamic weights from the normed streams ([n h] norm: 2 n h;
        [h -> n + 2] GEMM over T n rows), the width mix (reads n h, writes (n + 1) h) and the depth update (reads
        n h + h, writes n h); layer L sums the streams ((n + 1) h). These replace the block's residual adds."""
        h, n = model.hidden_size, model.hc_expansion_rate
        u = ctx.sp_tokens * h * ctx.act_bytes
        ops = []
        for sub in ("attention", "mlp"):
            if model.hc_dynamic:
                ops += [ctx.memory(f"hc {sub} stream norm", 2 * n * u, group="hc stream norms"),
                        ctx.gemm(f"hc {sub} dynamic weights", ctx.sp_tokens * n, n + 2, h, group="hc dynamic weights")]
            ops += [ctx.memory(f"hc {sub} width mix", (2 * n + 1) * u, group="hc width mix"),
                    ctx.memory(f"hc {sub} depth update", (2 * n + 1) * u, group="hc depth update")]
        if layer == model.num_layers:
            ops.append(ctx.memory("hc stream sum", (n + 1) * u, group="hc width mix"))
        return ctx.layer(ops=ops, replaces_residual=True)



ARCH = register(HyperConnections())
