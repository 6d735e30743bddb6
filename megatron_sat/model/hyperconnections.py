"""Hyper-Connections baseline (Zhu et al. 2024): n residual streams instead of one.

Each sublayer (attention, then MLP) reads and writes the stream matrix H [s, b, n, h]:

    alpha [s, b, n, n+1] = static_alpha + s_a * tanh(RMSNorm(H) @ W_alpha)     (dynamic; RMSNorm eps 1.19e-7)
    beta  [s, b, n]      = static_beta  + s_b * tanh(RMSNorm(H) @ w_beta)
    mix = alpha^T H                                           [s, b, n+1, h]
    y   = sublayer(norm(mix[:, :, 0]))                        the usual pre-norm attention or MLP
    H   = beta * y + mix[:, :, 1:]                            depth connection

Layer 1 starts from n copies of the embedding; layer L sums the streams before the final norm.
Init as in the authors' code: static_alpha = [e_(k mod n) | I] for sublayer k, static_beta = 1,
dynamic projections 0, scales 0.01; under Megatron's scaled output init the sublayers' output projections
are also divided by sqrt(n) (not under the authors' unscaled init).

Between layers and pipeline stages H travels as the hidden state itself, laid out [s, b, n*h]:
the pipeline message is (n-1)*h channels wider than Megatron expects (parallel/pipeline.py), and
full recompute checkpoints it like any hidden state. Every op here is per token, so tensor,
sequence and context parallelism need nothing more than replicated weights (flagged
`sequence_parallel` under SP, so Megatron sums their gradients over the TP group).
"""

import math

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor

from megatron_sat.model.config import SATConfig

HC_NORM_EPS = torch.finfo(torch.float32).eps  # what torch.nn.RMSNorm(eps=None) uses on float32 inputs


class HyperConnection(torch.nn.Module):
    """The width and depth connections around one sublayer (index k counts sublayers from 0)."""

    def __init__(self, config: SATConfig, norm_builder, k: int):
        super().__init__()
        n, h = config.hc_expansion_rate, config.hidden_size
        self.n, self.dynamic = n, config.hc_dynamic
        dtype = config.params_dtype
        static_alpha = torch.zeros(n, n + 1, dtype=dtype)
        static_alpha[k % n, 0] = 1.0
        static_alpha[:, 1:] = torch.eye(n, dtype=dtype)
        self.static_alpha = torch.nn.Parameter(static_alpha)
        self.static_beta = torch.nn.Parameter(torch.ones(n, dtype=dtype))
        params = [self.static_alpha, self.static_beta]
        if self.dynamic:
            # torch.nn.RMSNorm's default eps (the authors' norm): float32 machine epsilon, not norm_eps
            self.norm = norm_builder(config=config, hidden_size=h, eps=HC_NORM_EPS)
            self.dynamic_alpha = torch.nn.Parameter(torch.zeros(h, n + 1, dtype=dtype))
            self.dynamic_beta = torch.nn.Parameter(torch.zeros(h, dtype=dtype))
            self.dynamic_alpha_scale = torch.nn.Parameter(torch.full((1,), 0.01, dtype=dtype))
            self.dynamic_beta_scale = torch.nn.Parameter(torch.full((1,), 0.01, dtype=dtype))
            params += [self.dynamic_alpha, self.dynamic_beta, self.dynamic_alpha_scale, self.dynamic_beta_scale]
        if config.sequence_parallel:
            for p in params:
                p.sequence_parallel = True

    def weights(self, H: torch.Tensor):
        """alpha [s, b, n, n+1] and beta [s, b, n] (broadcastable shapes when static)."""
        if not self.dynamic:
            return self.static_alpha, self.static_beta
        normed = self.norm(H)  # [s, b, n, h]
        alpha = self.static_alpha + self.dynamic_alpha_scale * torch.tanh(normed @ self.dynamic_alpha)
        beta = self.static_beta + self.dynamic_beta_scale * torch.tanh(normed @ self.dynamic_beta)
        return alpha, beta

    def forward(self, H: torch.Tensor, sublayer) -> torch.Tensor:
        alpha, beta = self.weights(H)
        mix = torch.einsum("...nk,...nh->...kh", alpha, H)  # [s, b, n+1, h]
        y = sublayer(mix[..., 0, :])  # [s, b, h]
        return beta.unsqueeze(-1) * y.unsqueeze(-2) + mix[..., 1:, :]  # [s, b, n, h]


class HyperConnectionsLayer(TransformerLayer):
    """A Megatron TransformerLayer whose residual stream is n streams wide (hidden [s, b, n*h])."""

    def __init__(self, config: SATConfig, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        k = 2 * (self.layer_number - 1)
        self.attention_hc = HyperConnection(config, submodules.norm, k)
        self.mlp_hc = HyperConnection(config, submodules.norm, k + 1)
        # With Megatron's scaled output init, the sublayers' outputs are also divided by sqrt(n) (n streams are
        # summed). The authors' default init (output_layer_init='unscaled', the paper recipes) has no such factor:
        # their models leave rescale_prenorm_residual off, so o_proj and down_proj are plain N(0, 0.02).
        if config.perform_initialization and config.output_layer_init == "scaled":
            with torch.no_grad():
                for linear in (self.self_attention.linear_proj, self.mlp.linear_fc2):
                    linear.weight.div_(math.sqrt(self.mlp_hc.n))

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, **kwargs):
        n = self.mlp_hc.n
        s, b = hidden_states.shape[:2]
        if self.layer_number == 1:
            H = hidden_states.unsqueeze(2).expand(s, b, n, -1)  # [s, b, n, h]: n copies of the embedding
        else:
            H = hidden_states.view(s, b, n, -1)  # [s, b, n, h]

        def attention(x):
            out, bias = self.self_attention(
                self.input_layernorm(x), attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin, attention_bias=attention_bias,
                inference_context=inference_context, packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
            )
            return out if bias is None else out + bias

        def mlp(x):
            out, bias = self.mlp(self.pre_mlp_layernorm(x))
            return out if bias is None else out + bias

        H = self.attention_hc(H, attention)
        H = self.mlp_hc(H, mlp)
        if self.layer_number == self.config.num_layers:
            return H.sum(dim=2), context  # [s, b, h]: the streams collapse before the final norm
        out = make_viewless_tensor(H.reshape(s, b, -1), requires_grad=True, keep_graph=True)  # [s, b, n*h]
        return out, context
