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
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_valueresidual import ResFormerConfig, SATFormerConfig

try:  # transformers >= 5: initialisers that skip weights loaded from the checkpoint
    from transformers import initialization as _init
except ImportError:  # pragma: no cover
    _init = nn.init

# transformers renamed the cache argument and output field from past_key_values to cache (5.2x)
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SATFormerMixing(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = config.value_residual_gate
        self.alpha_proj = nn.Linear(config.hidden_size, _kv_heads(config), bias=config.value_residual_proj_bias)

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


def _kv_heads(config) -> int:
    return config.num_kv_heads or config.num_heads


def _mixes(config, layer_idx: int) -> bool:
    if not config.use_value_residual or layer_idx == 0:
        return False
    k = config.value_residual_last_k
    return k is None or layer_idx >= config.num_hidden_layers - k


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_heads, _kv_heads(config)
        self.head_dim = config.hidden_size // config.num_heads
        h, kv = config.hidden_size, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.qk_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.qk_norm_eps)
        self.produces_v1 = bool(config.use_value_residual) and layer_idx == 0
        mixing = ResFormerMixing if _is_resformer(config) else SATFormerMixing
        self.value_residual_mixing = mixing(config) if _mixes(config, layer_idx) else None

    def forward(self, x, cos, sin, mask, cache, v1, lambda1):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v_first = v if self.produces_v1 else None
        if self.value_residual_mixing is not None:
            if v1 is None:
                raise RuntimeError(f"layer {self.layer_idx} mixes V1 but layer 0 produced none")
            v = self.value_residual_mixing(v, v1, x, lambda1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # the cache holds K and the mixed V'
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1)), v_first


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        inter = config.intermediate_size or int(config.hidden_size * config.hidden_ratio)
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)
        if config.hidden_act not in ("swish", "silu"):
            raise ValueError(f"only the SwiGLU MLP (hidden_act swish/silu) is supported, got {config.hidden_act!r}")

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


def _attention_mask(attention_mask, b, s, past, device):
    """Boolean [b, 1, s, past + s]: causal, and padded keys hidden when a 2-D mask is given."""
    total = past + s
    rows = torch.arange(past, total, device=device)[:, None]
    mask = (torch.arange(total, device=device)[None, :] <= rows)[None, None].expand(b, 1, s, total)
    if attention_mask is not None:
        if attention_mask.dim() == 2:
            mask = mask & attention_mask[:, None, None, -total:].bool()
        elif attention_mask.dim() == 4:
            am = attention_mask[..., -total:]
            mask = mask & (am if am.dtype == torch.bool else am > torch.finfo(am.dtype).min / 2)
        else:
            raise ValueError(f"attention_mask must be 2-D or 4-D, got {attention_mask.dim()}-D")
    return mask | ~mask.any(-1, keepdim=True)  # fully padded rows attend everywhere (their output is unused)


class _PreTrained(PreTrainedModel):
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Block"]
    _supports_sdpa = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, ResFormerMixing):
            _init.constant_(module.lambda2, float(self.config.value_residual_lambda2_init))
        elif isinstance(module, LambdaManager):
            _init.constant_(module.lambda_scale, float(self.config.num_hidden_layers))
            _init.zeros_(module.lambda_logits)
        elif isinstance(module, RMSNorm):
            _init.ones_(module.weight)


class _Model(_PreTrained):
    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([Block(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        if _is_resformer(config) and config.use_value_residual:
            self.lambda_manager = LambdaManager(config.num_hidden_layers)
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        h = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        b, s, _ = h.shape
        cache = cache if cache is not None else past_key_values
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if use_cache and cache is None:
            cache = DynamicCache()
        if not use_cache:
            cache = None
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None and attention_mask is not None and attention_mask.dim() == 2:
            # left padding: each row's positions count its own tokens only
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -s:]
        elif position_ids is None:
            position_ids = torch.arange(past, past + s, device=h.device)[None].expand(b, s)
        # RoPE angles in float32 (as Megatron computes them), rotate-half layout. Computed here, not
        # kept in a buffer: from_pretrained builds models on the meta device, which non-persistent
        # buffers do not survive.
        d = self.config.hidden_size // self.config.num_heads
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=h.device) / d))
        freqs = position_ids[..., None].float() * inv_freq[None, None]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [b, 1, s, d]
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        mask = _attention_mask(attention_mask, b, s, past, h.device)
        lambdas = self.lambda_manager() if hasattr(self, "lambda_manager") else None
        v1 = None
        for i, layer in enumerate(self.layers):
            lambda1 = lambdas[i - 1] if lambdas is not None and i > 0 else None
            h, v_first = layer(h, cos, sin, mask, cache, v1, lambda1)
            if v_first is not None:
                v1 = v_first
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), **{_CACHE_FIELD: cache})


class _ForCausalLM(_PreTrained, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}
    model_class = None

    def __init__(self, config):
        super().__init__(config)
        self.model = self.model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, value):
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def get_decoder(self):
        return self.model

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, cache=None, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         cache=cache)
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: getattr(out, _CACHE_FIELD)})


class SATFormerPreTrainedModel(_PreTrained):
    config_class = SATFormerConfig


class SATFormerModel(SATFormerPreTrainedModel, _Model):
    config_class = SATFormerConfig


class SATFormerForCausalLM(SATFormerPreTrainedModel, _ForCausalLM):
    config_class = SATFormerConfig
    model_class = SATFormerModel


class ResFormerPreTrainedModel(_PreTrained):
    config_class = ResFormerConfig


class ResFormerModel(ResFormerPreTrainedModel, _Model):
    config_class = ResFormerConfig


class ResFormerForCausalLM(ResFormerPreTrainedModel, _ForCausalLM):
    config_class = ResFormerConfig
    model_class = ResFormerModel
