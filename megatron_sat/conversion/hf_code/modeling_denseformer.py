"""Hugging Face model of the DenseFormer baseline (remote code shipped with its exports).

Pure PyTorch (SDPA), with the SATFormer authors' classes and weight names
(models/denseformer in SkyeGunasekaran/SATFormer; dilation and period 1):

    model.embeddings, model.norm, lm_head
    model.layers.N.{attn_norm, mlp_norm}, model.layers.N.attn.*, model.layers.N.mlp.*   (layers.py)
    model.dwa_modules.alphas.N.weight   [1, N + 2]   block N's weights over X_0 .. X_{N+1}

With X_0 the embedding and X_{N+1} = Block_N(Y_N) the plain pre-norm block's output,
Y_{N+1} = sum_j alphas.N[j] X_j is the next block's input (Y_0 = X_0); the last Y goes to the final
norm. Every op outside attention is per token, so the KV cache holds the usual K and V.
"""

import torch
from torch import nn

from .configuration_denseformer import DenseFormerConfig
from .layers import MLP, Attention, ForCausalLM, PreTrained, RMSNorm, init, model_output, prepare


class DenseFormerBlock(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, rope, mask, cache):
        x = self.attn_norm(h)
        h = h + self.attn(x, x, x, rope, mask, cache)
        return h + self.mlp(self.mlp_norm(h))


class DWAModules(nn.Module):
    def __init__(self, n_blocks: int, dilation: int = 1, period: int = 1):
        super().__init__()
        if dilation != 1 or period != 1:
            raise ValueError("only dwa_dilation = dwa_period = 1 is supported (the authors' configs)")
        self.alphas = nn.ModuleList([nn.Linear(i + 2, 1, bias=False) for i in range(n_blocks)])

    def forward(self, history, block_idx: int):  # history: X_0 .. X_{block_idx + 1}, each [b, s, h]
        w = self.alphas[block_idx].weight[0]
        out = w[0] * history[0]
        for j in range(1, len(history)):
            out = out + w[j] * history[j]
        return out


class DenseFormerPreTrainedModel(PreTrained):
    config_class = DenseFormerConfig
    _no_split_modules = ["DenseFormerBlock"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DWAModules):  # identity at start: all weight on the newest output
            for linear in module.alphas:
                one_hot = torch.zeros_like(linear.weight)
                one_hot[0, -1] = 1.0
                init.copy_(linear.weight, one_hot)


class DenseFormerModel(DenseFormerPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([DenseFormerBlock(config, i) for i in range(config.num_hidden_layers)])
        self.dwa_modules = DWAModules(config.num_hidden_layers, config.dwa_dilation, config.dwa_period)
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        h, rope, mask, cache = prepare(self, input_ids, inputs_embeds, attention_mask, position_ids, cache, use_cache)
        history = [h]
        for i, layer in enumerate(self.layers):
            history.append(layer(h, rope, mask, cache))
            h = self.dwa_modules(history, i)
        return model_output(self.norm(h), cache)


class DenseFormerForCausalLM(DenseFormerPreTrainedModel, ForCausalLM):
    model_class = DenseFormerModel
