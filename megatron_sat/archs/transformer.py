"""The Transformer (Qwen3-style): Megatron's GPT layer untouched; exported as transformers' own Qwen3 (Llama
without q/k norms)."""

from megatron_sat.archs.base import Arch
from megatron_sat.archs.registry import register


class Transformer(Arch):
    name = "transformer"
    title = "Transformer (Qwen3-style)"
    colour = "#4C72B0"
    tags = ("transformer",)
    hf_model_type = "qwen3"
    hf_code = (("modeling_qwen3_qknorm.py", "modeling_transformer.py"),)  # only with q/k norms
    # a GPT-3 script's user would otherwise expect GPT-3's block (LayerNorm, GELU, learned positions, biases)
    banner_note = "Llama-style block: RMSNorm, SwiGLU, RoPE, no biases"

    def hf_config(self, spec, decoder: dict, remote: dict) -> dict:
        if not spec.qk_layernorm:  # no q/k norms: transformers' own Llama, no remote code
            return dict(architectures=["LlamaForCausalLM"], model_type="llama",
                        **dict(decoder, rope_scaling=decoder.get("rope_scaling")), mlp_bias=False, pretraining_tp=1)
        return dict(
            architectures=["Qwen3ForCausalLM"], model_type="qwen3", **decoder, qk_norm_eps=spec.qk_norm_eps,
            auto_map={"AutoConfig": "modeling_transformer.Qwen3Config",
                      "AutoModelForCausalLM": "modeling_transformer.Qwen3ForCausalLM"},
            use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_layers,
            layer_types=["full_attention"] * spec.num_layers,
        )

    def hf_code_for(self, spec) -> tuple:
        return self.hf_code if spec.qk_layernorm else ()

    def hf_spec_fields(self, cfg, need) -> dict:
        """A Qwen3 or Llama config.json we can hold: free head dim, GQA, untied embeddings; Llama has no q/k norms.
        Its RoPE (theta, Llama 3.1+ scaling) the conversion reads for every arch (conversion/mapping.py)."""
        mt = cfg.get("model_type")
        need(not cfg.get("attention_bias", False), "attention_bias=True (Megatron model has no biases)")
        need(not cfg.get("mlp_bias", False), "mlp_bias=True (Megatron model has no biases)")
        need(cfg.get("pretraining_tp", 1) == 1, f"pretraining_tp {cfg.get('pretraining_tp')} (need 1)")
        need(not cfg.get("use_sliding_window", False), "sliding-window attention")
        need(cfg.get("hidden_act", "silu") == "silu", f"hidden_act {cfg.get('hidden_act')!r} (need silu)")
        return dict(arch=self.name, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                    num_attention_heads=cfg["num_attention_heads"],
                    num_query_groups=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                    ffn_hidden_size=cfg["intermediate_size"],
                    kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                    layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6),
                    # native Qwen3 normalises q/k with rms_norm_eps; Llama has no q/k norms
                    qk_norm_eps=cfg.get("qk_norm_eps", cfg.get("rms_norm_eps", 1e-6)), qk_layernorm=mt == "qwen3",
                    tied=cfg.get("tie_word_embeddings", False))

    def hf_names(self) -> dict:
        return dict(emb="model.embed_tokens.weight", attn="self_attn", ln1="input_layernorm",
                    ln2="post_attention_layernorm")


ARCH = register(Transformer())
