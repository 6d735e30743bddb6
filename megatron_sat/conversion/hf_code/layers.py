"""Layers shared by the SATFormer, ResFormer, DenseFormer, MUDDFormer and Hyper-Connections exports (shipped as
remote code beside each modeling file).

Pure PyTorch with scaled_dot_product_attention (no fla, no flash-attn), under the module and weight
names of the SATFormer authors' models (built on flash-linear-attention's Attention and GatedMLP):

    attn.{q,k,v,o}_proj, attn.{q,k}_norm (per head, eps qk_norm_eps), mlp.{gate,up,down}_proj

The attention takes its query, key and value inputs apart (MUDDFormer feeds three different streams);
the KV cache holds K (after norm and RoPE) and V. Written for megatron_sat's exports: nothing here
comes from another library but transformers' cache and base classes.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

try:  # transformers >= 5: initialisers that skip weights loaded from the checkpoint
    from transformers import initialization as init
except ImportError:  # transformers 4.x (tests/test_conversion.py loads every export with 4.57.1)
    init = nn.init

# transformers renamed the cache argument and output field from past_key_values to cache (5.2x)
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class RMSNorm(nn.Module):
    """flash-linear-attention's RMSNorm: normalised in float32, scaled by a weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def head_dim(config) -> int:
    """The head dim: config.head_dim where given (published shapes: free of hidden / heads), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_heads


def kv_heads(config) -> int:
    return config.num_kv_heads or config.num_heads


class Attention(nn.Module):
    """q/k/v/o projections, per-head q/k norms, RoPE, causal GQA (the value-residual exports subclass it to mix V1
    into V before attend)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_heads, kv_heads(config)
        self.head_dim = head_dim(config)
        h, kv = config.hidden_size, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.qk_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.qk_norm_eps)

    def forward(self, xq, xk, xv, rope, mask, cache):  # x* [b, s, h]
        b, s, _ = xq.shape
        q = self.q_proj(xq).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(xk).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(xv).view(b, s, self.num_kv_heads, self.head_dim)
        return self.attend(q, k, v, *rope, mask, cache)

    def attend(self, q, k, v, cos, sin, mask, cache):  # q [b, s, heads, d], k, v [b, s, kv heads, d]
        b, s = q.shape[:2]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU (flash-linear-attention's GatedMLP names)."""

    def __init__(self, config, intermediate_size=None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size or int(config.hidden_size * config.hidden_ratio)
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)
        if config.hidden_act not in ("swish", "silu"):
            raise ValueError(f"only the SwiGLU MLP (hidden_act swish/silu) is supported, got {config.hidden_act!r}")

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def attention_mask(mask_2d_or_4d, b, s, past, device):
    """Boolean [b, 1, s, past + s]: causal, and padded keys hidden when a 2-D mask is given."""
    total = past + s
    rows = torch.arange(past, total, device=device)[:, None]
    mask = (torch.arange(total, device=device)[None, :] <= rows)[None, None].expand(b, 1, s, total)
    if mask_2d_or_4d is not None:
        if mask_2d_or_4d.dim() == 2:
            mask = mask & mask_2d_or_4d[:, None, None, -total:].bool()
        elif mask_2d_or_4d.dim() == 4:
            am = mask_2d_or_4d[..., -total:]
            mask = mask & (am if am.dtype == torch.bool else am > torch.finfo(am.dtype).min / 2)
        else:
            raise ValueError(f"attention_mask must be 2-D or 4-D, got {mask_2d_or_4d.dim()}-D")
    return mask | ~mask.any(-1, keepdim=True)  # fully padded rows attend everywhere (their output is unused)


def prepare(model, input_ids, inputs_embeds, attention_mask_in, position_ids, cache, use_cache):
    """(embeddings [b, s, h], (cos, sin), mask, cache) for one forward of a decoder."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids and inputs_embeds")
    h = model.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
    b, s, _ = h.shape
    use_cache = use_cache if use_cache is not None else (model.config.use_cache and not model.training)
    if use_cache and cache is None:
        cache = DynamicCache()
    if not use_cache:
        cache = None
    past = cache.get_seq_length() if cache is not None else 0
    if position_ids is None and attention_mask_in is not None and attention_mask_in.dim() == 2:
        # left padding: each row's positions count its own tokens only
        position_ids = (attention_mask_in.long().cumsum(-1) - 1).clamp(min=0)[:, -s:]
    elif position_ids is None:
        position_ids = torch.arange(past, past + s, device=h.device)[None].expand(b, s)
    # RoPE angles in float32 (as Megatron computes them), rotate-half layout; computed here, not in a buffer
    # (from_pretrained builds models on the meta device, which non-persistent buffers do not survive)
    d = head_dim(model.config)
    inv_freq = 1.0 / (model.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=h.device) / d))
    freqs = position_ids[..., None].float() * inv_freq[None, None]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [b, 1, s, d]
    rope = (emb.cos().to(h.dtype), emb.sin().to(h.dtype))
    return h, rope, attention_mask(attention_mask_in, b, s, past, h.device), cache


class PreTrained(PreTrainedModel):
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _supports_sdpa = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, (RMSNorm, nn.RMSNorm)) and module.weight is not None:
            init.ones_(module.weight)

    def get_input_embeddings(self):  # the decoder's embeddings (ForCausalLM reaches through .model)
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value


class ForCausalLM(PreTrained, GenerationMixin):
    """The LM head on top of `model_class` (each arch: class XForCausalLM(XPreTrainedModel, ForCausalLM))."""

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
                         cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache)
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: getattr(out, CACHE_FIELD)})


def model_output(hidden, cache):
    return BaseModelOutputWithPast(last_hidden_state=hidden, **{CACHE_FIELD: cache})
