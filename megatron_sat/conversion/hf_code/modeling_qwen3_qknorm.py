"""transformers' Qwen3 with q/k RMSNorms of their own eps (remote code shipped with Transformer exports).

megatron_sat's Transformer normalises q and k with eps qk_norm_eps (1e-5, the SATFormer authors') and every
other norm with rms_norm_eps (1e-6); native Qwen3 uses rms_norm_eps for both. These subclasses keep Qwen3's
classes, weights and names and only set the q/k norms' eps, so the folder also loads as plain Qwen3 without
trust_remote_code (then q/k use rms_norm_eps: logits differ by about 1e-5 relative).
"""

from transformers import Qwen3Config as _Qwen3Config
from transformers import Qwen3ForCausalLM as _Qwen3ForCausalLM


class Qwen3Config(_Qwen3Config):
    def __init__(self, qk_norm_eps=None, **kwargs):
        super().__init__(**kwargs)
        self.qk_norm_eps = self.rms_norm_eps if qk_norm_eps is None else qk_norm_eps


class Qwen3ForCausalLM(_Qwen3ForCausalLM):
    config_class = Qwen3Config

    def __init__(self, config):
        super().__init__(config)
        eps = getattr(config, "qk_norm_eps", None)
        if eps is not None:
            for layer in self.model.layers:
                layer.self_attn.q_norm.variance_epsilon = eps
                layer.self_attn.k_norm.variance_epsilon = eps
