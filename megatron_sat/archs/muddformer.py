"""MUDDFormer: C = 4 ways out of every layer but the last (1 there), each a dynamic weighted sum of the k = i + 1
outputs X_0..X_i the layer reads (model/muddformer.py); Q, K and V from their own streams; the FFN width grows from
0.5x at layer 1 to 1.5x at layer L (param_realloc, the authors' configs)."""

from megatron_sat.archs.dense import Dense
from megatron_sat.archs.registry import register


def ways_and_inputs(layer: int, num_layers: int):
    """(C, k) of 1-based `layer`: ways out of it (4, 1 in the last layer) and the outputs X_0..X_i it reads."""
    return (4 if layer < num_layers else 1), layer + 1


class MUDDFormer(Dense):
    name = "muddformer"
    title = "MUDDFormer"
    colour = "#8172B3"
    tags = ("muddformer",)
    aliases = ("mudd",)
    stream_count = 3  # X^Q, X^K, X^V
    layer_class = "megatron_sat.model.muddformer:MUDDFormerLayer"
    attention_class = "megatron_sat.model.muddformer:MultiInputSelfAttention"
    hf_model_type = "muddformer"
    hf_class = "MUDDFormer"
    paper_satformer_vs = (1.82, 0.05)
    memory_note = ("the 4 streams and their weighted sums, the dynamic-weight MLP, the per-call Q/K/V weight "
                   "slices, param_realloc FFN widths, the history on the pipeline message and its gradients")

    def layout_errors(self, config) -> list:
        if config.num_query_groups < config.tensor_model_parallel_size:
            return [f"muddformer needs num_query_groups ({config.num_query_groups}) >= tensor parallel size "
                    f"({config.tensor_model_parallel_size}): its Q, K and V come from different inputs"]
        return []

    def unfused_input_norm(self, config) -> bool:
        return True  # Q, K and V inputs have norms of their own

    def ffn_size(self, model, layer_number: int) -> int:
        """0.5x at layer 1 to 1.5x at layer L with param_realloc, rounded to the nearest multiple of 256 and at least
        256, as the authors' code does at every size (so that an export computes what their code computes)."""
        base, num_layers = model.ffn_hidden_size, model.num_layers
        if not model.muddformer_param_realloc or num_layers == 1:
            return base
        scale = (0.5 * (num_layers - layer_number) + 1.5 * (layer_number - 1)) / (num_layers - 1)
        return max(256, (int(round(scale * base)) + 127) // 256 * 256)

    def layer_parameters(self, model, layer, tp, parts) -> bool:
        h = model.hidden_size
        C, k = ways_and_inputs(layer, model.num_layers)
        parts["norms"] += 2 * h  # key and value input norms
        parts["connections"] = C * k * h + (C * k) ** 2 + C * k + k * h + C * h  # w1, w2, static, pre/post norms
        return False

    def flops(self, cfg, out, dims, tp) -> None:
        h, L = dims["h"], dims["L"]
        total = 0
        for i in range(1, L + 1):
            c, k = ways_and_inputs(i, L)
            total += 2 * h * c * k + c * k + 2 * (c * k) ** 2 + c * k + c * (2 * k - 1) * h + c * h
        out["connections"] = total
        out["mlp"] = sum(2 * h * self.ffn_size(cfg, i) * dims["mlp_mats"] for i in range(1, L + 1))

    def connection_bytes(self, cfg, layer, *, s, b, t, sp_div, act, local, first_in_chunk, recompute) -> float:
        h = cfg.hidden_size
        u = act * s * b * h / sp_div  # one [s, b, h]
        x = act * s * b / sp_div  # one value per token
        stat = 4 * s * b / sp_div  # a norm's fp32 1/rms per token
        local_norm = (8 - act) * s * b * h / sp_div  # the local RMSNorm's fp32 x * rsqrt
        C, k = ways_and_inputs(layer, cfg.num_layers)
        a, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
        norms = 2 + C  # key and value input norms, post-norms (the pre-norms of X_0..X_i are recomputed)
        out = 3 * act * s * b * h - u  # Q, K, V inputs [s, b, h], gathered under SP
        out += 0 if first_in_chunk else 3 * u  # X^Q, X^K, X^V [s, b, h]
        out += (1 + C) * u + 3 * C * k * x  # rms(X_i), C sums; W1 out, GELU out, dw [s, b, C*k]
        out += act * (a + 2 * g) * d * h / t  # Q, K, V weight slices
        out += u if layer == cfg.num_layers else 0  # R stream, the final norm's input
        return out + (norms + 1) * stat + (norms * local_norm if local else 0)

    def hf_config(self, spec, decoder, remote) -> dict:
        # intermediate_size is the base width that param_realloc scales per layer
        return dict(remote, num_ways=4, param_realloc=spec.muddformer_param_realloc, use_pre_post_da_norm=True)

    def hf_extra_fields(self, cfg, need) -> dict:
        need(cfg.get("num_ways", 4) == 4, f"num_ways {cfg.get('num_ways')} (the Megatron model has 4)")
        need(cfg.get("use_pre_post_da_norm", True), "use_pre_post_da_norm=False")
        return dict(super().hf_extra_fields(cfg, need), muddformer_param_realloc=cfg.get("param_realloc", True))

    def hf_names(self) -> dict:
        return dict(super().hf_names(), ln1="attn_norm_q")

    def layer_extras(self, spec) -> list:
        h, L, out = spec.hidden_size, spec.num_layers, []
        for i in range(L):
            m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
            C, k = ways_and_inputs(i + 1, L)  # ways out of layer i; outputs X_0 .. X_{i+1} it reads
            out += [(m + "key_input_layernorm.weight", p + "attn_norm_k.weight", (h,), (h,)),
                    (m + "value_input_layernorm.weight", p + "attn_norm_v.weight", (h,), (h,))]
            d, da = m + "depth_aggregate.", p + "da."
            out += [(d + "w1", da + "w1.weight", (C * k, h), (C * k, h)),
                    (d + "w2", da + "w2.weight", (C * k, C * k), (C * k, C * k)),
                    (d + "static_weight", da + "static_weight", (C, k), (C, k))]
            out += [(d + f"pre_norms.{j}.weight", da + f"pre_da_norms.{j}.weight", (h,), (h,)) for j in range(k)]
            out += [(d + f"post_norms.{c}.weight", da + f"post_da_norms.{c}.weight", (h,), (h,)) for c in range(C)]
        return out

    def step_ops(self, model, layer, ctx):
        """C = 4 ways out (1 at layer L), k = i + 1 inputs: the dynamic weights' [h -> Ck] and [Ck -> Ck] GEMMs,
        pre-norm reads of X_0..X_i (2k h), C weighted sums (C (k + 1) h), the key and value input norms and C
        post-norms (2 (2 + C) h); the FFN is the layer's own width (param_realloc, ffn_size)."""
        h, k = model.hidden_size, layer + 1
        c = 1 if layer == model.num_layers else 4
        u = ctx.sp_tokens * h * ctx.act_bytes
        return ctx.layer(ops=[
            ctx.gemm("muddformer dynamic weights W1", ctx.sp_tokens, c * k, h, group="muddformer dynamic weights W1"),
            ctx.gemm("muddformer dynamic weights W2", ctx.sp_tokens, c * k, c * k,
                     group="muddformer dynamic weights W2"),
            ctx.memory("muddformer pre-norms", 2 * k * u, group="muddformer pre-norms"),
            ctx.memory("muddformer weighted sums", c * (k + 1) * u, group="muddformer weighted sums", count=c),
            ctx.memory("muddformer norms", 2 * (2 + c) * u, group="muddformer norms", count=2 + c),
        ])



ARCH = register(MUDDFormer())
