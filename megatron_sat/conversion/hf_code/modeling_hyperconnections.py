"""Hugging Face model of the Hyper-Connections baseline (remote code shipped with its exports).

Pure PyTorch (SDPA), with the SATFormer authors' classes and weight names
(models/hyperconnections in SkyeGunasekaran/SATFormer):

    model.embeddings, model.norm, lm_head
    model.layers.N.{attn_norm, mlp_norm}, model.layers.N.attn.*, model.layers.N.mlp.*   (layers.py)
    model.layers.N.{attn_hc, mlp_hc}.{static_alpha [n, n+1], static_beta [n]}
        and with use_dynamic_hc: norm.weight [h], dynamic_alpha_proj [h, n+1], dynamic_beta_proj [h],
        dynamic_alpha_scale [1], dynamic_beta_scale [1]

The embedding is copied into n streams H [b, s, n, h]; around each sublayer f (attention, MLP)
    alpha = static_alpha + s_a tanh(RMSNorm(H) W_alpha),  beta = static_beta + s_b tanh(RMSNorm(H) w_beta)
    mix = alpha^T H,  H = beta f(norm(mix[0])) + mix[1:]
and the streams are summed before the final norm. The dynamic weights' RMSNorm is the authors'
torch.nn.RMSNorm, with eps fixed at float32's machine epsilon: what their default eps (None) gives in
float32 and what the Megatron model uses in every precision (in bfloat16 their default would be 7.8e-3).
"""

import torch
from torch import nn

from .configuration_hyperconnections import HyperConnectionsConfig
from .layers import MLP, Attention, ForCausalLM, PreTrained, RMSNorm, init, model_output, prepare

HC_NORM_EPS = torch.finfo(torch.float32).eps


class HyperConnections(nn.Module):
    def __init__(self, config, index: int):
        super().__init__()
        n, h = config.expansion_rate, config.hidden_size
        if config.hc_norm_type != "rms" or not config.use_tanh:
            raise ValueError("only hc_norm_type='rms' with use_tanh=True is supported")
        self.n, self.index, self.dynamic = n, index, config.use_dynamic_hc
        self.static_beta = nn.Parameter(torch.ones(n))
        self.static_alpha = nn.Parameter(self.initial_alpha(n, index))
        if self.dynamic:
            self.norm = nn.RMSNorm(h, eps=HC_NORM_EPS)
            self.dynamic_beta_proj = nn.Parameter(torch.zeros(h))
            self.dynamic_alpha_proj = nn.Parameter(torch.zeros(h, n + 1))
            self.dynamic_beta_scale = nn.Parameter(torch.full((1,), 0.01))
            self.dynamic_alpha_scale = nn.Parameter(torch.full((1,), 0.01))

    @staticmethod
    def initial_alpha(n, index):
        alpha = torch.zeros(n, n + 1)
        alpha[index % n, 0] = 1.0
        alpha[:, 1:] = torch.eye(n)
        return alpha

    def width(self, H):  # H [b, s, n, h] -> mix [b, s, n+1, h], beta [b, s, n]
        alpha, beta = self.static_alpha, self.static_beta
        if self.dynamic:
            normed = self.norm(H)
            alpha = alpha + self.dynamic_alpha_scale * torch.tanh(normed @ self.dynamic_alpha_proj)
            beta = beta + self.dynamic_beta_scale * torch.tanh(normed @ self.dynamic_beta_proj)
        return alpha.transpose(-2, -1) @ H, beta

    def depth(self, mix, y, beta):  # y [b, s, h]
        return beta.unsqueeze(-1) * y.unsqueeze(-2) + mix[..., 1:, :]


class HyperConnectionsBlock(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config, layer_idx)
        self.attn_hc = HyperConnections(config, 2 * layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config)
        self.mlp_hc = HyperConnections(config, 2 * layer_idx + 1)

    def forward(self, H, rope, mask, cache):
        mix, beta = self.attn_hc.width(H)
        x = self.attn_norm(mix[..., 0, :])
        H = self.attn_hc.depth(mix, self.attn(x, x, x, rope, mask, cache), beta)
        mix, beta = self.mlp_hc.width(H)
        return self.mlp_hc.depth(mix, self.mlp(self.mlp_norm(mix[..., 0, :])), beta)


class HyperConnectionsPreTrainedModel(PreTrained):
    config_class = HyperConnectionsConfig
    _no_split_modules = ["HyperConnectionsBlock"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, HyperConnections):
            init.ones_(module.static_beta)
            init.copy_(module.static_alpha, module.initial_alpha(module.n, module.index))
            if module.dynamic:
                init.zeros_(module.dynamic_beta_proj)
                init.zeros_(module.dynamic_alpha_proj)
                init.constant_(module.dynamic_beta_scale, 0.01)
                init.constant_(module.dynamic_alpha_scale, 0.01)


class HyperConnectionsModel(HyperConnectionsPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([HyperConnectionsBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        h, rope, mask, cache = prepare(self, input_ids, inputs_embeds, attention_mask, position_ids, cache, use_cache)
        H = h.unsqueeze(-2).expand(*h.shape[:-1], self.config.expansion_rate, h.shape[-1])  # [b, s, n, h]
        for layer in self.layers:
            H = layer(H, rope, mask, cache)
        return model_output(self.norm(H.sum(-2)), cache)


class HyperConnectionsForCausalLM(HyperConnectionsPreTrainedModel, ForCausalLM):
    model_class = HyperConnectionsModel
