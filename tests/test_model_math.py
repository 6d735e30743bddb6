"""The Megatron model computes the paper's formulas: compared with a plain-PyTorch forward.

The reference below is written from ../shared/reference/satformer.md alone (no Megatron code):
pre-norm RMSNorm blocks, per-head QK RMSNorm, rotate-half RoPE (theta 1e4), causal GQA attention,
SwiGLU, tied embeddings, and the value residual

    layer 1:     V1 = V (raw value projection)
    SATFormer:   V'[t, j] = V[t, j] + ReLU(x_t W_alpha)[j] * V1[t, j]     x = normed attention input
    ResFormer:   V' = lambda1 V1 + lambda2 V,  lambda1 = s * softmax(logits) (learned) or 0.5/0.5

Every weight, norms included, is randomised first so that reading the wrong tensor shows. One
process runs all variants in float64 (RoPE angles and their cos/sin in float32, as Megatron
computes them); tolerance 1e-10 relative on the logits.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from dist_utils import init_megatron, run_distributed

VOCAB, SEQ, BATCH = 97, 12, 2
SIZES = dict(num_layers=4, hidden_size=48, num_attention_heads=6, num_query_groups=2, ffn_hidden_size=80)
VARIANTS = {
    "transformer": dict(arch="transformer"),
    "satformer": dict(arch="satformer"),
    "satformer_sigmoid_last2": dict(arch="satformer", value_residual_gate="sigmoid", value_residual_last_k=2),
    "satformer_softmax": dict(arch="satformer", value_residual_gate="softmax"),
    "resformer_learned": dict(arch="resformer"),
    "resformer_fixed": dict(arch="resformer", resformer_lambdas="fixed"),
}


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, theta=10000.0):  # x [b, s, heads, hn], rotate-half form
    hn, s = x.shape[-1], x.shape[1]
    inv = 1.0 / theta ** (torch.arange(0, hn, 2, dtype=torch.float32) / hn)  # Megatron: float32 angles
    ang = torch.cat([torch.outer(torch.arange(s, dtype=torch.float32), inv)] * 2, -1)  # [s, hn]
    cos, sin = (t.to(x.dtype)[None, :, None] for t in (ang.cos(), ang.sin()))
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_logits(w, cfg, tokens):
    """The model written from the formulas; w maps Megatron parameter names to tensors."""
    L, h, nq, ng = cfg["num_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_query_groups"]
    hn, arch = h // nq, cfg["arch"]
    gate = {"relu": F.relu, "sigmoid": torch.sigmoid, "softmax": lambda z: torch.softmax(z, -1) * z.shape[-1]}[
        cfg.get("value_residual_gate", "relu")]
    last_k = cfg.get("value_residual_last_k")
    mixing = list(range(2, L + 1)) if last_k is None else list(range(L - last_k + 1, L + 1))
    b, s = tokens.shape
    x = w["embedding.word_embeddings.weight"][tokens]  # [b, s, h]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    v1 = None
    for n in range(1, L + 1):
        p = f"decoder.layers.{n - 1}."
        xn = rms(x, w[p + "input_layernorm.weight"])
        qkv = (xn @ w[p + "self_attention.linear_qkv.weight"].T).view(b, s, ng, (nq // ng + 2) * hn)
        q, k, v = qkv.split([nq // ng * hn, hn, hn], -1)  # per KV group: its query heads, k, v
        q = rms(q.reshape(b, s, nq, hn), w[p + "self_attention.q_layernorm.weight"])
        k = rms(k, w[p + "self_attention.k_layernorm.weight"])
        if n == 1:
            v1 = v
        elif n in mixing and arch == "satformer":
            alpha = gate(xn @ w[p + "self_attention.value_residual_gate.weight"].T)  # [b, s, ng]
            v = v + alpha[..., None] * v1
        elif n in mixing and arch == "resformer":
            if cfg.get("resformer_lambdas") == "fixed":
                v = 0.5 * v1 + 0.5 * v
            else:
                lam1 = w["value_residual_lambdas.scale"] * torch.softmax(w["value_residual_lambdas.logits"], 0)
                v = lam1[mixing.index(n)] * v1 + w[p + "self_attention.value_residual_lambda2"] * v
        q, k = rope(q), rope(k)
        k, v = (t.repeat_interleave(nq // ng, dim=2) for t in (k, v))  # query head i uses group i // (nq/ng)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hn)
        att = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
        out = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, nq * hn)
        x = x + out @ w[p + "self_attention.linear_proj.weight"].T
        gate_up = rms(x, w[p + "pre_mlp_layernorm.weight"]) @ w[p + "mlp.linear_fc1.weight"].T
        g, u = gate_up.chunk(2, -1)
        x = x + (F.silu(g) * u) @ w[p + "mlp.linear_fc2.weight"].T
    x = rms(x, w["decoder.final_layernorm.weight"])
    return x @ w["embedding.word_embeddings.weight"].T  # tied output layer


def _worker():
    from megatron_sat.model.config import make_config
    from megatron_sat.model.gpt import build_model
    from megatron_sat.model.sizes import count_parameters

    init_megatron()
    results = {}
    for name, variant in VARIANTS.items():
        cfg = dict(SIZES, **variant)
        config = make_config(**cfg, params_dtype=torch.float64)
        model = build_model(config, vocab_size=VOCAB, max_sequence_length=SEQ)[0].double().eval()
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        with torch.no_grad():
            got = model(tokens, pos, None)  # [b, s, V]
            weights = {k: v.detach() for k, v in model.named_parameters()}
            want = reference_logits(weights, cfg, tokens)
        results[name] = ((got - want).abs().max() / want.abs().max()).item()
        # the causal mask: changing the last token changes no earlier logit
        tokens2 = tokens.clone()
        tokens2[:, -1] = (tokens2[:, -1] + 1) % VOCAB
        with torch.no_grad():
            got2 = model(tokens2, pos, None)
        results[name + "/params"] = (sum(p.numel() for p in model.parameters()), count_parameters(config, VOCAB)["total"])
        results[name + "/causal"] = (got2[:, :-1] - got[:, :-1]).abs().max().item()
    return results


@pytest.fixture(scope="module")
def errors():
    return run_distributed(_worker, 1, timeout=600)[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_formulas(errors, variant):
    assert errors[variant] <= 1e-10, f"{variant}: relative max logit error {errors[variant]:.2e}"
    assert errors[variant + "/causal"] == 0.0, f"{variant}: a later token changed an earlier logit"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parameter_count_formula(errors, variant):
    built, formula = errors[variant + "/params"]
    assert built == formula, f"{variant}: the model has {built} parameters, count_parameters says {formula}"
