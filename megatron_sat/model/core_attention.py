"""Core attention for the local (non-TE) spec on torch's scaled_dot_product_attention.

Megatron's local DotProductAttention computes softmax(QK^T) as a [b, np, sq, sk] tensor with a baddbmm
and a separate softmax: at seq 4096 that tensor is the step's largest and slowest. SDPAttention keeps
Megatron's module (its __init__: heads per TP rank, softmax scale, dropout, checkpoint keys) and hands the
attention itself to torch.nn.functional.scaled_dot_product_attention, which picks FlashAttention, cuDNN or
memory-efficient kernels on a GPU (causal and GQA without repeating K and V) and a math kernel on CPU.
No well-kept library gives Megatron this module without Transformer Engine, so it is written here.

    query [sq, b, np/tp, hn], key and value [sk, b, ng/tp, hn]  ->  context [sq, b, np/tp * hn]

The same numbers as DotProductAttention within float rounding (tests/test_model_math.py). What SDPA
cannot express here (packed sequences, attention bias, windowed or learnable-offset softmax, QK layer
scaling, a causal mask between unequal query and key lengths) goes to DotProductAttention unchanged.
"""

import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """DotProductAttention whose forward is torch's scaled_dot_product_attention."""

    def _sdpa_supported(self, attention_bias, packed_seq_params) -> bool:
        return (packed_seq_params is None and attention_bias is None and self.softmax_offset is None
                and not self.config.apply_query_key_layer_scaling and self.scale_mask_softmax.window_size is None)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self._sdpa_supported(attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        sq, b, heads, hn = query.shape
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        mask = None
        if attention_mask is not None:  # Megatron's mask: True = masked out (already causal when it is given)
            mask = ~attention_mask.bool()
            causal = False
        elif causal and sq != key.shape[0]:  # SDPA's is_causal aligns top-left; Megatron's mask differs
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        causal = causal and sq > 1
        q = query.permute(1, 2, 0, 3)  # [b, np/tp, sq, hn]
        k = key.permute(1, 2, 0, 3)  # [b, ng/tp, sk, hn]
        v = value.permute(1, 2, 0, 3)  # [b, ng/tp, sk, hn]
        dropout = self.attention_dropout.p if self.training else 0.0
        gqa = q.shape[1] != k.shape[1]
        if dropout > 0.0 and not self.config.sequence_parallel:  # TP ranks draw their heads' dropout apart
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                     scale=self.softmax_scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                 scale=self.softmax_scale, enable_gqa=gqa)  # [b, np/tp, sq, hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)  # [sq, b, np/tp * hn]
