"""Hugging Face models of SATFormer and ResFormer (remote code shipped with every export).

Pure PyTorch with scaled_dot_product_attention (no fla, no flash-attn), with the SATFormer
authors' module and weight names:

    model.embeddings, model.layers.N.{attn_norm, mlp_norm}, model.layers.N.attn.{q,k,v,o}_proj,
    model.layers.N.attn.{q,k}_norm, model.layers.N.mlp.{gate,up,down}_proj, model.norm, lm_head
    SATFormer: model.layers.N.attn.value_residual_mixing.alpha_proj.weight   [num_kv_heads, hidden]
    ResFormer: model.layers.N.attn.value_residual_mixing.lambda2             []
               model.lambda_manager.{lambda_scale [], lambda_logits [N - 1]}

Per layer (x = attn_norm(h), the input of q/k/v; layer 1 is index 0):
    V1 = v_proj(x) of layer 1 (raw, before any mixing)
    SATFormer: V' = V + gate(alpha_proj(x)) * V1        (per token and KV head)
    ResFormer: V' = lambda1[n] * V1 + lambda2[n] * V    (lambda1 = scale * softmax(logits)[n - 1])
then per-head RMSNorm on q and k (eps qk_norm_eps, 1e-5 as the authors'), rotate-half RoPE on q and k
(not on V), causal GQA attention.

KV cache: the cache holds K (after norm and RoPE) and the mixed V'. V1 of the tokens of the
current step is recomputed by layer 1 from those tokens, so cached and uncached decoding agree.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_valueresidual import ResFormerConfig, SATFormerConfig
from .layers import MLP, ForCausalLM, PreTrained, RMSNorm, init, kv_heads, model_output, prepare
from .layers import Attention as PlainAttention


def _gate(name: str, logits: torch.Tensor) -> torch.Tensor:
    n = logits.shape[-1]
    if name == "relu":
        return F.relu(logits)
    if name == "sigmoid":
        return torch.sigmoid(logits)
    if name == "softmax":
        return torch.softmax(logits, dim=-1) * n
    if name == "softmax_sigmoid":
        return torch.softmax(logits, dim=-1) * torch.sigmoid(logits) * n
    if name == "tanh":
        return torch.tanh(logits)
    if name == "identity":
        return logits
    raise ValueError(f"unknown value_residual_gate {name!r}")


class SATFormerMixing(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = config.value_residual_gate
        self.alpha_proj = nn.Linear(config.hidden_size, kv_heads(config), bias=config.value_residual_proj_bias)

    def forward(self, v, v1, x, lambda1=None):  # v, v1 [b, s, kv, d]; x [b, s, h]
        alpha = _gate(self.gate, self.alpha_proj(x)).to(v.dtype)
        return v + alpha.unsqueeze(-1) * v1


class ResFormerMixing(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.lambda2 = nn.Parameter(torch.tensor(float(config.value_residual_lambda2_init)))

    def forward(self, v, v1, x, lambda1=None):
        return lambda1.to(v.dtype) * v1 + self.lambda2.to(v.dtype) * v


class LambdaManager(nn.Module):
    """ResFormer's lambda1[n] = lambda_scale * softmax(lambda_logits)[n - 1] for layers n = 1..N-1 (0-based)."""

    def __init__(self, num_layers: int):
        super().__init__()
        self.lambda_scale = nn.Parameter(torch.tensor(float(num_layers)))
        self.lambda_logits = nn.Parameter(torch.zeros(num_layers - 1))

    def forward(self):
        return self.lambda_scale * torch.softmax(self.lambda_logits.float(), dim=0)


def _is_resformer(config) -> bool:
    return config.model_type == "ResFormer"


def _mixes(config, layer_idx: int) -> bool:
    if not config.use_value_residual or layer_idx == 0:
        return False
    k = config.value_residual_last_k
    return k is None or layer_idx >= config.num_hidden_layers - k


class Attention(PlainAttention):
    """layers.py's Attention with V1: layer 0 hands its raw V on, the mixing layers mix it into V before attend (the
    cache holds K and the mixed V')."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.produces_v1 = bool(config.use_value_residual) and layer_idx == 0
        mixing = ResFormerMixing if _is_resformer(config) else SATFormerMixing
        self.value_residual_mixing = mixing(config) if _mixes(config, layer_idx) else None

    def forward(self, x, cos, sin, mask, cache, v1, lambda1):  # x [b, s, h]
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v_first = v if self.produces_v1 else None
        if self.value_residual_mixing is not None:
            if v1 is None:
                raise RuntimeError(f"layer {self.layer_idx} mixes V1 but layer 0 produced none")
            v = self.value_residual_mixing(v, v1, x, lambda1)
        return self.attend(q, k, v, cos, sin, mask, cache), v_first


class Block(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, cos, sin, mask, cache, v1, lambda1):
        out, v_first = self.attn(self.attn_norm(h), cos, sin, mask, cache, v1, lambda1)
        h = h + out
        return h + self.mlp(self.mlp_norm(h)), v_first


class _PreTrained(PreTrained):
    _no_split_modules = ["Block"]

    def _init_weights(self, module):
        super()._init_weights(module)  # RMSNorm weights 1
        if isinstance(module, ResFormerMixing):
            init.constant_(module.lambda2, float(self.config.value_residual_lambda2_init))
        elif isinstance(module, LambdaManager):
            init.constant_(module.lambda_scale, float(self.config.num_hidden_layers))
            init.zeros_(module.lambda_logits)


class _Model(_PreTrained):
    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([Block(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        if _is_resformer(config) and config.use_value_residual:
            self.lambda_manager = LambdaManager(config.num_hidden_layers)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        h, (cos, sin), mask, cache = prepare(self, input_ids, inputs_embeds, attention_mask, position_ids, cache,
                                             use_cache)
        lambdas = self.lambda_manager() if hasattr(self, "lambda_manager") else None
        v1 = None
        for i, layer in enumerate(self.layers):
            lambda1 = lambdas[i - 1] if lambdas is not None and i > 0 else None
            h, v_first = layer(h, cos, sin, mask, cache, v1, lambda1)
            if v_first is not None:
                v1 = v_first
        return model_output(self.norm(h), cache)


class SATFormerPreTrainedModel(_PreTrained):
    config_class = SATFormerConfig


class SATFormerModel(SATFormerPreTrainedModel, _Model):
    config_class = SATFormerConfig


class SATFormerForCausalLM(SATFormerPreTrainedModel, ForCausalLM):
    config_class = SATFormerConfig
    model_class = SATFormerModel


class ResFormerPreTrainedModel(_PreTrained):
    config_class = ResFormerConfig


class ResFormerModel(ResFormerPreTrainedModel, _Model):
    config_class = ResFormerConfig


class ResFormerForCausalLM(ResFormerPreTrainedModel, ForCausalLM):
    config_class = ResFormerConfig
    model_class = ResFormerModel
