"""The paper's formulas in plain PyTorch: the reference that tests/test_model_math.py compares the
Megatron model with, forward (logits) and backward (autograd through these functions).

Written from the paper's formulas alone (arXiv 2605.03953; docs/architectures.md; no Megatron code): pre-norm RMSNorm blocks,
per-head QK RMSNorm (eps 1e-5, the others 1e-6), rotate-half RoPE (theta 1e4), causal GQA attention, SwiGLU, tied embeddings,
and the value residual

    layer 1:     V1 = V (raw value projection)
    SATFormer:   V'[t, j] = V[t, j] + gate(x_t W_alpha)[j] * V1[t, j]     x = normed attention input
    ResFormer:   V' = lambda1 V1 + lambda2 V,  lambda1 = s * softmax(logits) over layers 2..L (learned) or 0.5/0.5

and the connection baselines (X_0 = embedding, X_i = layer i's output):

    DenseFormer:       Y_i = sum_{j<=i} w_i[j] X_j  is layer i+1's input (Y_0 = X_0)
    MUDDFormer:        layer i+1 takes Q, K, V and the residual from 4 ways, each
                       RMSNorm(sum_j dw[c, j] RMSNorm_j(X_j)) + X_i with dw = static + MLP(RMSNorm(X_i));
                       per-layer FFN widths; 1 way out of the last layer
    Hyper-Connections: n streams H; mix = alpha^T H, H <- beta y + mix[1:], y = f(norm(mix[0])) for
                       the attention and the MLP, alpha/beta static (+ tanh dynamic); output sum_n H

`w` maps Megatron parameter names to tensors (leaves that require grad, for the gradient test).
"""

import math

import torch
import torch.nn.functional as F

# The gate functions of the authors' code, over the KV-head axis: relu (the paper's), sigmoid, tanh,
# identity, softmax x N_kv and softmax * sigmoid x N_kv (the authors scale both softmax forms by N_kv).
GATES = {
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "identity": lambda z: z,
    "softmax": lambda z: torch.softmax(z, -1) * z.shape[-1],
    "softmax_sigmoid": lambda z: torch.softmax(z, -1) * torch.sigmoid(z) * z.shape[-1],
}


NORM_EPS = 1e-6  # the RMSNorms of the blocks and the final norm (the authors' norm_eps)
QK_NORM_EPS = 1e-5  # the per-head q and k RMSNorms (the authors' attention: flash-linear-attention's default)
HC_NORM_EPS = torch.finfo(torch.float32).eps  # Hyper-Connections' norm: torch.nn.RMSNorm's default eps


def rms(x, w, eps=NORM_EPS):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, theta=10000.0):  # x [b, s, heads, hn], rotate-half form
    hn, s = x.shape[-1], x.shape[1]
    inv = 1.0 / theta ** (torch.arange(0, hn, 2, dtype=torch.float32) / hn)  # Megatron: float32 angles
    ang = torch.cat([torch.outer(torch.arange(s, dtype=torch.float32), inv)] * 2, -1)  # [s, hn]
    cos, sin = (t.to(x.dtype)[None, :, None] for t in (ang.cos(), ang.sin()))
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def qkv(w, p, xn, cfg):
    """q [b, s, nq, hn] and k [b, s, ng, hn] after QK-norm, raw v [b, s, ng, hn], from the normed input xn."""
    h, nq, ng = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_query_groups"]
    hn, (b, s) = h // nq, xn.shape[:2]
    fused = (xn @ w[p + "self_attention.linear_qkv.weight"].T).view(b, s, ng, (nq // ng + 2) * hn)
    q, k, v = fused.split([nq // ng * hn, hn, hn], -1)  # per KV group: its query heads, k, v
    q = rms(q.reshape(b, s, nq, hn), w[p + "self_attention.q_layernorm.weight"], QK_NORM_EPS)
    k = rms(k, w[p + "self_attention.k_layernorm.weight"], QK_NORM_EPS)
    return q, k, v


def attend(w, p, q, k, v):
    """RoPE, causal GQA softmax attention and linear_proj: [b, s, h]."""
    (b, s, nq, hn), ng = q.shape, k.shape[2]
    q, k = rope(q), rope(k)
    k, v = (t.repeat_interleave(nq // ng, dim=2) for t in (k, v))  # query head i uses group i // (nq/ng)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hn)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    att = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    out = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, nq * hn)
    return out @ w[p + "self_attention.linear_proj.weight"].T


def attention(w, p, xn, cfg):
    return attend(w, p, *qkv(w, p, xn, cfg))


def mlp(w, p, xn):  # SwiGLU
    g, u = (xn @ w[p + "mlp.linear_fc1.weight"].T).chunk(2, -1)
    return (F.silu(g) * u) @ w[p + "mlp.linear_fc2.weight"].T


def block(w, p, x, cfg):
    """The pre-norm Transformer block."""
    x = x + attention(w, p, rms(x, w[p + "input_layernorm.weight"]), cfg)
    return x + mlp(w, p, rms(x, w[p + "pre_mlp_layernorm.weight"]))


def value_residual_decoder(w, cfg, x):
    """Transformer, SATFormer, ResFormer."""
    L, arch = cfg["num_layers"], cfg["arch"]
    gate = GATES[cfg.get("value_residual_gate", "relu")]
    last_k = cfg.get("value_residual_last_k")
    mixing = list(range(2, L + 1)) if last_k is None else list(range(L - last_k + 1, L + 1))
    v1 = None
    for n in range(1, L + 1):
        p = f"decoder.layers.{n - 1}."
        xn = rms(x, w[p + "input_layernorm.weight"])
        q, k, v = qkv(w, p, xn, cfg)
        if n == 1:
            v1 = v
        elif n in mixing and arch == "satformer":
            alpha = gate(xn @ w[p + "self_attention.value_residual_gate.weight"].T)  # [b, s, ng]
            v = v + alpha[..., None] * v1
        elif n in mixing and arch == "resformer":
            if cfg.get("resformer_lambdas") == "fixed":
                v = 0.5 * v1 + 0.5 * v
            else:
                # softmax over all L - 1 layers after the first, mixing or not (the authors')
                lam1 = w["value_residual_lambdas.scale"] * torch.softmax(w["value_residual_lambdas.logits"], 0)
                v = lam1[n - 2] * v1 + w[p + "self_attention.value_residual_lambda2"] * v
        x = x + attend(w, p, q, k, v)
        x = x + mlp(w, p, rms(x, w[p + "pre_mlp_layernorm.weight"]))
    return x


def denseformer_decoder(w, cfg, x):
    """X_i = Block_i(Y_{i-1}), Y_i = sum_{j<=i} w_i[j] X_j (depth-weighted average), Y_0 = X_0."""
    xs, y = [x], x
    for i in range(1, cfg["num_layers"] + 1):
        p = f"decoder.layers.{i - 1}."
        xs.append(block(w, p, y, cfg))
        y = sum(wj * xj for wj, xj in zip(w[p + "dwa_weights"], xs, strict=True))
    return y


def muddformer_decoder(w, cfg, x):
    """Four dynamic dense ways (Q, K, V, R) into each layer; a single one out of the last."""
    L, (b, s) = cfg["num_layers"], x.shape[:2]
    xs, (xq, xk, xv, xr) = [x], [x] * 4
    for i in range(1, L + 1):
        p = f"decoder.layers.{i - 1}."
        q, _, _ = qkv(w, p, rms(xq, w[p + "input_layernorm.weight"]), cfg)
        _, k, _ = qkv(w, p, rms(xk, w[p + "key_input_layernorm.weight"]), cfg)
        _, _, v = qkv(w, p, rms(xv, w[p + "value_input_layernorm.weight"]), cfg)
        a = xr + attend(w, p, q, k, v)
        xi = a + mlp(w, p, rms(a, w[p + "pre_mlp_layernorm.weight"]))
        xs.append(xi)
        d, C, k = p + "depth_aggregate.", (4 if i < L else 1), i + 1
        xi_n = xi * torch.rsqrt(xi.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMSNorm without scale
        dw = (F.gelu(xi_n @ w[d + "w1"].T) @ w[d + "w2"].T).view(b, s, C, k) + w[d + "static_weight"]
        normed = [rms(xj, w[d + f"pre_norms.{j}.weight"]) for j, xj in enumerate(xs)]
        ways = [rms(sum(dw[..., c, j:j + 1] * normed[j] for j in range(k)), w[d + f"post_norms.{c}.weight"]) + xi
                for c in range(C)]
        if i < L:
            xq, xk, xv, xr = ways
    return ways[0]


def hyper_connection(w, p, H, f, dynamic):
    """H [b, s, n, h] -> beta y + the n remixed streams, y = f(the mixed sublayer input)."""
    alpha, beta = w[p + "static_alpha"], w[p + "static_beta"]  # [n, n+1], [n]
    if dynamic:
        Hn = rms(H, w[p + "norm.weight"], HC_NORM_EPS)
        alpha = alpha + w[p + "dynamic_alpha_scale"] * torch.tanh(Hn @ w[p + "dynamic_alpha"])  # [b, s, n, n+1]
        beta = beta + w[p + "dynamic_beta_scale"] * torch.tanh(Hn @ w[p + "dynamic_beta"])  # [b, s, n]
    alpha = alpha.expand(*H.shape[:2], *alpha.shape[-2:])
    beta = beta.expand(*H.shape[:3])
    mix = torch.einsum("bsnk,bsnh->bskh", alpha, H)  # [b, s, n+1, h]
    y = f(mix[:, :, 0])  # [b, s, h]
    return beta[..., None] * y[:, :, None, :] + mix[:, :, 1:]


def hyperconnections_decoder(w, cfg, x):
    n, dynamic = cfg.get("hc_expansion_rate", 4), cfg.get("hc_dynamic", True)
    H = x[:, :, None, :].repeat(1, 1, n, 1)  # n copies of the embedding
    for i in range(1, cfg["num_layers"] + 1):
        p = f"decoder.layers.{i - 1}."
        H = hyper_connection(w, p + "attention_hc.", H,
                             lambda z, p=p: attention(w, p, rms(z, w[p + "input_layernorm.weight"]), cfg), dynamic)
        H = hyper_connection(w, p + "mlp_hc.", H,
                             lambda z, p=p: mlp(w, p, rms(z, w[p + "pre_mlp_layernorm.weight"])), dynamic)
    return H.sum(2)


DECODERS = {"denseformer": denseformer_decoder, "muddformer": muddformer_decoder,
            "hyperconnections": hyperconnections_decoder}


def reference_logits(w, cfg, tokens):
    """The model written from the formulas; w maps Megatron parameter names to tensors."""
    x = w["embedding.word_embeddings.weight"][tokens]  # [b, s, h]
    x = DECODERS.get(cfg["arch"], value_residual_decoder)(w, cfg, x)
    x = rms(x, w["decoder.final_layernorm.weight"])
    return x @ w["embedding.word_embeddings.weight"].T  # tied output layer
