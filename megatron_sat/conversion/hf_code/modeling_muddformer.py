"""Hugging Face model of the MUDDFormer baseline (remote code shipped with its exports).

Pure PyTorch (SDPA), with the SATFormer authors' classes and weight names
(models/muddformer in SkyeGunasekaran/SATFormer; 4 ways, pre/post depth-aggregate norms):

    model.embeddings, model.norm, lm_head
    model.layers.N.{attn_norm_q, attn_norm_k, attn_norm_v, mlp_norm}, model.layers.N.attn.*, model.layers.N.mlp.*
    model.layers.N.da.{w1.weight [C k, h], w2.weight [C k, C k], static_weight [C, k],
                       pre_da_norms.J.weight [h] (k of them), post_da_norms.c.weight [h] (C of them)}
    (k = N + 2 outputs X_0 .. X_{N+1} reachable; C = 4 ways, 1 after the last block)

Block N: A = X^R + Attention(q from norm_q(X^Q), k from norm_k(X^K), v from norm_v(X^V)), X = A + MLP(norm(A)),
with FFN width param_realloc (0.5x to 1.5x, multiples of 256); then
    dw [b, s, C, k] = w2 GELU(w1 rms(X)) + static_weight,   stream_c = post_c(sum_j dw[c, j] pre_j(X_j)) + X
gives X^Q, X^K, X^V, X^R of the next block (only X^R after the last). The KV cache holds K and V as usual.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_muddformer import MUDDFormerConfig
from .layers import MLP, Attention, ForCausalLM, PreTrained, RMSNorm, init, model_output, prepare


def ffn_width(config, layer_idx: int) -> int:
    """param_realloc: the authors' per-layer FFN width (0-based layer_idx)."""
    base, L = config.intermediate_size, config.num_hidden_layers
    if base is None:
        base = max(256, (int(config.hidden_size * config.hidden_ratio * 2 / 3) + 127) // 256 * 256)
    if not config.param_realloc or L == 1:
        return base
    i = layer_idx + 1
    scale = (0.5 * (L - i) + 1.5 * (i - 1)) / (L - 1)
    return max(256, (int(round(scale * base)) + 127) // 256 * 256)


class DepthAggregateModule(nn.Module):
    def __init__(self, config, accessible: int, last: bool):
        super().__init__()
        h = config.hidden_size
        self.eps, self.ways, self.k = config.norm_eps, 1 if last else config.num_ways, accessible
        self.w1 = nn.Linear(h, self.ways * accessible, bias=False)
        self.w2 = nn.Linear(self.ways * accessible, self.ways * accessible, bias=False)
        self.static_weight = nn.Parameter(torch.zeros(self.ways, accessible))
        self.pre_da_norms = nn.ModuleList([nn.RMSNorm(h, eps=config.norm_eps) for _ in range(accessible)])
        self.post_da_norms = nn.ModuleList([nn.RMSNorm(h, eps=config.norm_eps) for _ in range(self.ways)])

    def forward(self, history):  # k tensors [b, s, h]
        x = history[-1]
        b, s, _ = x.shape
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # RMSNorm without a scale
        dw = self.w2(F.gelu(self.w1(xn))).view(b, s, self.ways, self.k) + self.static_weight  # [b, s, C, k]
        normed = [norm(xj) for norm, xj in zip(self.pre_da_norms, history)]
        out = []
        for c in range(self.ways):
            acc = dw[..., c, 0, None] * normed[0]
            for j in range(1, self.k):
                acc = acc + dw[..., c, j, None] * normed[j]
            out.append(self.post_da_norms[c](acc) + x)
        return out


class MUDDFormerBlock(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        if config.num_ways != 4 or not config.use_pre_post_da_norm:
            raise ValueError("only num_ways=4 with use_pre_post_da_norm=True is supported (the authors' configs)")
        h = config.hidden_size
        self.attn_norm_q = RMSNorm(h, config.norm_eps)
        self.attn_norm_k = RMSNorm(h, config.norm_eps)
        self.attn_norm_v = RMSNorm(h, config.norm_eps)
        self.attn = Attention(config, layer_idx)
        self.mlp_norm = RMSNorm(h, config.norm_eps)
        self.mlp = MLP(config, ffn_width(config, layer_idx))
        self.da = DepthAggregateModule(config, layer_idx + 2, layer_idx == config.num_hidden_layers - 1)

    def forward(self, xq, xk, xv, xr, rope, mask, cache):
        a = xr + self.attn(self.attn_norm_q(xq), self.attn_norm_k(xk), self.attn_norm_v(xv), rope, mask, cache)
        return a + self.mlp(self.mlp_norm(a))


class MUDDFormerPreTrainedModel(PreTrained):
    config_class = MUDDFormerConfig
    _no_split_modules = ["MUDDFormerBlock"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DepthAggregateModule):
            init.normal_(module.w1.weight, mean=0.0, std=1.0 / module.w1.weight.shape[1])
            init.zeros_(module.w2.weight)
            init.zeros_(module.static_weight)
            for norm in module.post_da_norms:
                init.constant_(norm.weight, 1e-3)


class MUDDFormerModel(MUDDFormerPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([MUDDFormerBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        h, rope, mask, cache = prepare(self, input_ids, inputs_embeds, attention_mask, position_ids, cache, use_cache)
        history, (xq, xk, xv, xr) = [h], (h, h, h, h)
        for layer in self.layers:
            history.append(layer(xq, xk, xv, xr, rope, mask, cache))
            streams = layer.da(history)
            if len(streams) == 4:
                xq, xk, xv, xr = streams
            else:
                xr = streams[0]
        return model_output(self.norm(xr), cache)


class MUDDFormerForCausalLM(MUDDFormerPreTrainedModel, ForCausalLM):
    model_class = MUDDFormerModel
