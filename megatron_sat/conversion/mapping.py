"""Megatron <-> Hugging Face: model description, configs, weight names and layouts (torch only, no megatron).

A `ModelSpec` describes one model independently of both frameworks. The weights move between

  Megatron (full tensors at TP1/PP1, GPTModel.named_parameters names)
    embedding.word_embeddings.weight                      [V, h]
    decoder.layers.{i}.input_layernorm.weight             [h]
    decoder.layers.{i}.self_attention.linear_qkv.weight   [ng * (nq/ng + 2) * hn, h]   per KV group: q heads, k, v
    decoder.layers.{i}.self_attention.{q,k}_layernorm.weight  [hn]
    decoder.layers.{i}.self_attention.linear_proj.weight  [h, nq * hn]
    decoder.layers.{i}.pre_mlp_layernorm.weight           [h]
    decoder.layers.{i}.mlp.linear_fc1.weight              [2 F, h]  = [gate; up]
    decoder.layers.{i}.mlp.linear_fc2.weight              [h, F]
    decoder.final_layernorm.weight                        [h]
    output_layer.weight                                   [V, h]  (only when untied)
    SATFormer  decoder.layers.{i}.self_attention.value_residual_gate.weight   [ng, h]
    ResFormer  decoder.layers.{i}.self_attention.value_residual_lambda2       [1]
               value_residual_lambdas.{logits [N - 1], scale [1]}

  and Hugging Face
    SATFormer / ResFormer: the SATFormer authors' names (see hf_code/modeling_valueresidual.py);
    Transformer: transformers' native Qwen3 (per-head q/k RMSNorm, SwiGLU, rotate-half RoPE, no biases).

ResFormer's lambda1 = scale * softmax(logits)[n - 2] over all N - 1 layers after the first, in both (with
last-k too); a 'fixed' ResFormer (lambda1 = 0.5) is exported with logits 0 for the mixing layers, -inf
(an exact zero weight) for the others and scale 0.5 m.
The q/k RMSNorms have their own eps (qk_norm_eps, 1e-5 as the authors'): config field `qk_norm_eps` in
every export (Transformer: shipped Qwen3 subclasses that honour it, hf_code/modeling_qwen3_qknorm.py).
"""

import math
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron_sat.archs import ARCHS, VALUE_RESIDUAL, ffn_size

CONVERTIBLE = ARCHS  # every arch has an HF format
# the SATFormer authors' model_type and class-name prefix of each arch exported with remote code
HF_MODEL_TYPES = {"satformer": "SATFormer", "resformer": "ResFormer", "transformer": "qwen3",
                  "hyperconnections": "dhc", "denseformer": "denseformer", "muddformer": "muddformer"}
HF_CLASSES = {"satformer": "SATFormer", "resformer": "ResFormer", "hyperconnections": "HyperConnections",
              "denseformer": "DenseFormer", "muddformer": "MUDDFormer"}
HC_NAMES = {"static_alpha": "static_alpha", "static_beta": "static_beta", "norm.weight": "norm.weight",
            "dynamic_alpha": "dynamic_alpha_proj", "dynamic_beta": "dynamic_beta_proj",
            "dynamic_alpha_scale": "dynamic_alpha_scale", "dynamic_beta_scale": "dynamic_beta_scale"}
HC_SUBLAYERS = {"attention_hc": "attn_hc", "mlp_hc": "mlp_hc"}  # Megatron -> the authors' module names


class ConversionError(ValueError):
    """A checkpoint or an HF folder that cannot be converted; the message says why."""


def unsupported_arch(arch: str, what: str = "arch") -> ConversionError:
    """The refusal of an arch that has no HF conversion, naming it and the convertible ones."""
    return ConversionError(f"{what} {arch!r} cannot be converted; supported archs: {', '.join(CONVERTIBLE)}")


@dataclass
class ModelSpec:
    arch: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    rotary_base: float = 10000.0
    norm_eps: float = 1e-6
    qk_norm_eps: float = 1e-5
    value_residual_gate: str = "relu"
    value_residual_last_k: Optional[int] = None
    resformer_lambdas: str = "learned"
    hc_expansion_rate: int = 4
    hc_dynamic: bool = True
    muddformer_param_realloc: bool = True
    tied: bool = True

    def __post_init__(self):
        if self.arch not in CONVERTIBLE:
            raise unsupported_arch(self.arch)
        if self.num_attention_heads % self.num_query_groups:
            raise ConversionError(f"{self.num_attention_heads} attention heads are not a multiple of "
                                  f"{self.num_query_groups} KV heads")
        if self.arch != "transformer" and self.kv_channels * self.num_attention_heads != self.hidden_size:
            raise ConversionError(f"{self.arch} exports need head_dim = hidden_size / heads "
                                  f"({self.hidden_size}/{self.num_attention_heads}), got kv_channels={self.kv_channels}")

    @property
    def mixing_layers(self) -> list:
        """1-based layers that mix V1 (as SATConfig.mixing_layers)."""
        if self.arch not in VALUE_RESIDUAL:
            return []
        k = self.value_residual_last_k
        return list(range(2 if k is None else self.num_layers - k + 1, self.num_layers + 1))

    def ffn(self, layer_number: int) -> int:
        """FFN width of 1-based layer_number (MUDDFormer's vary with depth)."""
        return ffn_size(self, layer_number)

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------------
# configs
# ------------------------------------------------------------------------------------------------

def hf_config(spec: ModelSpec, dtype: torch.dtype, bos=None, eos=None, pad=None) -> dict:
    """config.json contents for the export of `spec`."""
    dtype_name = str(dtype).replace("torch.", "")
    if spec.arch == "transformer":
        return dict(
            architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
            num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_query_groups, head_dim=spec.kv_channels, hidden_act="silu",
            max_position_embeddings=spec.max_position_embeddings, initializer_range=0.02,
            rms_norm_eps=spec.norm_eps, qk_norm_eps=spec.qk_norm_eps, use_cache=True,
            auto_map={"AutoConfig": "modeling_transformer.Qwen3Config",
                      "AutoModelForCausalLM": "modeling_transformer.Qwen3ForCausalLM"}, tie_word_embeddings=spec.tied,
            rope_theta=float(spec.rotary_base),
            rope_parameters=dict(rope_type="default", rope_theta=float(spec.rotary_base)),
            attention_bias=False, attention_dropout=0.0, use_sliding_window=False, sliding_window=None,
            max_window_layers=spec.num_layers, layer_types=["full_attention"] * spec.num_layers,
            bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, dtype=dtype_name,
        )
    name = HF_CLASSES[spec.arch]
    cfg = dict(
        architectures=[f"{name}ForCausalLM"], model_type=HF_MODEL_TYPES[spec.arch],
        auto_map={"AutoConfig": f"configuration_{spec.arch}.{name}Config",
                  "AutoModelForCausalLM": f"modeling_{spec.arch}.{name}ForCausalLM"},
        hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers, num_heads=spec.num_attention_heads,
        num_kv_heads=spec.num_query_groups, qkv_bias=False, qk_norm=True, window_size=None,
        rope_theta=float(spec.rotary_base), max_position_embeddings=spec.max_position_embeddings,
        hidden_ratio=spec.ffn_hidden_size // spec.hidden_size if spec.ffn_hidden_size % spec.hidden_size == 0
        else spec.ffn_hidden_size / spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
        hidden_act="swish", initializer_range=0.02, elementwise_affine=True, norm_eps=spec.norm_eps,
        qk_norm_eps=spec.qk_norm_eps,
        use_cache=True, tie_word_embeddings=spec.tied, fuse_norm=False, fuse_swiglu=False,
        fuse_cross_entropy=False, fuse_linear_cross_entropy=False, use_l2warp=False,
        vocab_size=spec.vocab_size, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, dtype=dtype_name,
    )
    if spec.arch == "hyperconnections":
        cfg.update(expansion_rate=spec.hc_expansion_rate, use_dynamic_hc=spec.hc_dynamic, use_tanh=True,
                   hc_norm_type="rms")
        return cfg
    if spec.arch == "denseformer":
        cfg.update(dwa_dilation=1, dwa_period=1)
        return cfg
    if spec.arch == "muddformer":  # intermediate_size is the base width that param_realloc scales per layer
        cfg.update(num_ways=4, param_realloc=spec.muddformer_param_realloc, use_pre_post_da_norm=True)
        return cfg
    cfg.update(use_value_residual=True, value_residual_last_k=spec.value_residual_last_k)
    if spec.arch == "satformer":
        cfg.update(value_residual_gate=spec.value_residual_gate, value_residual_proj_bias=False)
    else:
        cfg.update(value_residual_lambda2_init=0.5, megatron_sat_resformer_lambdas=spec.resformer_lambdas)
    return cfg


def spec_from_hf_config(cfg: dict) -> ModelSpec:
    """The ModelSpec of an HF config.json (ours, the SATFormer authors', or a Qwen3 model we can hold)."""
    mt = cfg.get("model_type")
    errors = []

    def need(cond, msg):
        if not cond:
            errors.append(msg)

    if mt == "qwen3":
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        need(rope.get("rope_type", "default") == "default", f"rope_type {rope.get('rope_type')!r} (need 'default')")
        need(not cfg.get("attention_bias", False), "attention_bias=True (Megatron model has no biases)")
        need(not cfg.get("use_sliding_window", False), "sliding-window attention")
        need(cfg.get("hidden_act", "silu") == "silu", f"hidden_act {cfg.get('hidden_act')!r} (need silu)")
        kw = dict(arch="transformer", num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                  num_attention_heads=cfg["num_attention_heads"],
                  num_query_groups=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                  ffn_hidden_size=cfg["intermediate_size"],
                  kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                  rotary_base=theta, norm_eps=cfg.get("rms_norm_eps", 1e-6),
                  # native Qwen3 normalises q/k with rms_norm_eps
                  qk_norm_eps=cfg.get("qk_norm_eps", cfg.get("rms_norm_eps", 1e-6)),
                  tied=cfg.get("tie_word_embeddings", False))
    elif mt in HF_MODEL_TYPES.values():
        if mt in ("SATFormer", "ResFormer"):
            need(cfg.get("use_value_residual", True), "use_value_residual=False (export it as a Transformer instead)")
        elif mt == "dhc":
            need(cfg.get("use_tanh", True), "use_tanh=False (the Megatron model's dynamic weights use tanh)")
            need(cfg.get("hc_norm_type", "rms") == "rms", f"hc_norm_type {cfg.get('hc_norm_type')!r} (need 'rms')")
        elif mt == "denseformer":
            need(cfg.get("dwa_dilation", 1) == 1 and cfg.get("dwa_period", 1) == 1,
                 "dwa_dilation or dwa_period other than 1 (the Megatron model averages after every block)")
        else:
            need(cfg.get("num_ways", 4) == 4, f"num_ways {cfg.get('num_ways')} (the Megatron model has 4)")
            need(cfg.get("use_pre_post_da_norm", True), "use_pre_post_da_norm=False")
        need(cfg.get("qk_norm", False), "qk_norm=False (the Megatron model always normalises q and k)")
        need(not cfg.get("qkv_bias", False), "qkv_bias=True (the Megatron model has no biases)")
        need(not cfg.get("value_residual_proj_bias", False), "value_residual_proj_bias=True")
        need(cfg.get("window_size") is None, "window_size (sliding-window attention)")
        need(cfg.get("hidden_act", "swish") in ("swish", "silu"), f"hidden_act {cfg.get('hidden_act')!r}")
        h = cfg["hidden_size"]
        ffn = cfg.get("intermediate_size") or int(h * (cfg.get("hidden_ratio") or 4))
        arch = {v: k for k, v in HF_MODEL_TYPES.items()}[mt]
        kw = dict(arch=arch, num_layers=cfg["num_hidden_layers"], hidden_size=h,
                  num_attention_heads=cfg["num_heads"], num_query_groups=cfg.get("num_kv_heads") or cfg["num_heads"],
                  ffn_hidden_size=ffn, kv_channels=h // cfg["num_heads"], rotary_base=cfg.get("rope_theta", 1e4),
                  norm_eps=cfg.get("norm_eps", 1e-6), value_residual_last_k=cfg.get("value_residual_last_k"),
                  qk_norm_eps=cfg.get("qk_norm_eps", 1e-5),  # the authors' configs have none: fla's default 1e-5
                  tied=cfg.get("tie_word_embeddings", False))
        if mt == "SATFormer":
            kw["value_residual_gate"] = cfg.get("value_residual_gate", "relu")
        elif mt == "ResFormer":
            kw["resformer_lambdas"] = cfg.get("megatron_sat_resformer_lambdas", "learned")
        else:
            kw.update(value_residual_last_k=None, hc_expansion_rate=cfg.get("expansion_rate", 4),
                      hc_dynamic=cfg.get("use_dynamic_hc", True),
                      muddformer_param_realloc=cfg.get("param_realloc", True))
    else:
        raise ConversionError(f"model_type {mt!r} cannot be imported: expected one of "
                              + ", ".join(repr(t) for t in HF_MODEL_TYPES.values()))
    if errors:
        raise ConversionError(f"this {mt} model has features the Megatron model does not: " + "; ".join(errors))
    return ModelSpec(vocab_size=cfg["vocab_size"], max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                     **kw)


# ------------------------------------------------------------------------------------------------
# shapes
# ------------------------------------------------------------------------------------------------

def megatron_shapes(spec: ModelSpec) -> Dict[str, tuple]:
    h, hn, nq, ng, f = spec.hidden_size, spec.kv_channels, spec.num_attention_heads, spec.num_query_groups, \
        spec.ffn_hidden_size
    out = {"embedding.word_embeddings.weight": (spec.vocab_size, h), "decoder.final_layernorm.weight": (h,)}
    if not spec.tied:
        out["output_layer.weight"] = (spec.vocab_size, h)
    mixing = spec.mixing_layers
    for i in range(spec.num_layers):
        p, f = f"decoder.layers.{i}.", spec.ffn(i + 1)
        out.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attention.linear_qkv.weight": ((nq + 2 * ng) * hn, h),
            p + "self_attention.q_layernorm.weight": (hn,),
            p + "self_attention.k_layernorm.weight": (hn,),
            p + "self_attention.linear_proj.weight": (h, nq * hn),
            p + "pre_mlp_layernorm.weight": (h,),
            p + "mlp.linear_fc1.weight": (2 * f, h),
            p + "mlp.linear_fc2.weight": (h, f),
        })
        if i + 1 in mixing and spec.arch == "satformer":
            out[p + "self_attention.value_residual_gate.weight"] = (ng, h)
        if i + 1 in mixing and spec.arch == "resformer" and spec.resformer_lambdas == "learned":
            out[p + "self_attention.value_residual_lambda2"] = (1,)
    out.update({meg: shape for meg, _, shape, _ in layer_extras(spec)})
    if spec.arch == "resformer" and spec.resformer_lambdas == "learned":
        out["value_residual_lambdas.logits"] = (spec.num_layers - 1,)
        out["value_residual_lambdas.scale"] = (1,)
    return out


def hf_shapes(spec: ModelSpec) -> Dict[str, tuple]:
    h, hn, nq, ng, f = spec.hidden_size, spec.kv_channels, spec.num_attention_heads, spec.num_query_groups, \
        spec.ffn_hidden_size
    n = _hf_names(spec.arch)
    out = {n["emb"]: (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tied:
        out["lm_head.weight"] = (spec.vocab_size, h)
    out.update({hf: shape for _, hf, _, shape in layer_extras(spec)})
    for i in range(spec.num_layers):
        p, a, f = f"model.layers.{i}.", f"model.layers.{i}.{n['attn']}.", spec.ffn(i + 1)
        out.update({p + n["ln1"] + ".weight": (h,), a + "q_proj.weight": (nq * hn, h),
                    a + "k_proj.weight": (ng * hn, h), a + "v_proj.weight": (ng * hn, h),
                    a + "o_proj.weight": (h, nq * hn), a + "q_norm.weight": (hn,), a + "k_norm.weight": (hn,),
                    p + n["ln2"] + ".weight": (h,), p + "mlp.gate_proj.weight": (f, h),
                    p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)})
        if i + 1 in spec.mixing_layers:
            if spec.arch == "satformer":
                out[a + "value_residual_mixing.alpha_proj.weight"] = (ng, h)
            else:
                out[a + "value_residual_mixing.lambda2"] = ()
    if spec.arch == "resformer":
        out["model.lambda_manager.lambda_scale"] = ()
        out["model.lambda_manager.lambda_logits"] = (spec.num_layers - 1,)
    return out


def hc_shapes(spec: ModelSpec) -> Dict[str, tuple]:
    """One Hyper-Connection's tensors under their Megatron names (HC_NAMES gives the authors')."""
    n, h = spec.hc_expansion_rate, spec.hidden_size
    out = {"static_alpha": (n, n + 1), "static_beta": (n,)}
    if spec.hc_dynamic:
        out.update({"norm.weight": (h,), "dynamic_alpha": (h, n + 1), "dynamic_beta": (h,),
                    "dynamic_alpha_scale": (1,), "dynamic_beta_scale": (1,)})
    return out


def _hf_names(arch: str) -> dict:
    if arch == "transformer":
        return dict(emb="model.embed_tokens.weight", attn="self_attn", ln1="input_layernorm",
                    ln2="post_attention_layernorm")
    return dict(emb="model.embeddings.weight", attn="attn", ln1="attn_norm_q" if arch == "muddformer" else "attn_norm",
                ln2="mlp_norm")


def layer_extras(spec: ModelSpec) -> List[Tuple[str, str, tuple, tuple]]:
    """(Megatron name, HF name, Megatron shape, HF shape) of the baselines' own tensors, moved as they are."""
    h, L, out = spec.hidden_size, spec.num_layers, []
    for i in range(L):
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        if spec.arch == "hyperconnections":
            for sub, theirs in HC_SUBLAYERS.items():
                out += [(m + f"{sub}.{name}", p + f"{theirs}.{HC_NAMES[name]}", shape, shape)
                        for name, shape in hc_shapes(spec).items()]
        elif spec.arch == "denseformer":  # after layer i (0-based): weights over X_0 .. X_{i+1}
            out.append((m + "dwa_weights", f"model.dwa_modules.alphas.{i}.weight", (i + 2,), (1, i + 2)))
        elif spec.arch == "muddformer":
            C, k = (4 if i + 1 < L else 1), i + 2  # ways out of layer i; outputs X_0 .. X_{i+1} it reads
            out += [(m + "key_input_layernorm.weight", p + "attn_norm_k.weight", (h,), (h,)),
                    (m + "value_input_layernorm.weight", p + "attn_norm_v.weight", (h,), (h,))]
            d, da = m + "depth_aggregate.", p + "da."
            out += [(d + "w1", da + "w1.weight", (C * k, h), (C * k, h)),
                    (d + "w2", da + "w2.weight", (C * k, C * k), (C * k, C * k)),
                    (d + "static_weight", da + "static_weight", (C, k), (C, k))]
            out += [(d + f"pre_norms.{j}.weight", da + f"pre_da_norms.{j}.weight", (h,), (h,)) for j in range(k)]
            out += [(d + f"post_norms.{c}.weight", da + f"post_da_norms.{c}.weight", (h,), (h,)) for c in range(C)]
    return out


def check_shapes(state: Dict[str, torch.Tensor], expected: Dict[str, tuple], what: str) -> None:
    """ConversionError listing missing, unexpected and mis-shaped tensors."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k}: {tuple(state[k].shape)} instead of {expected[k]}" for k in sorted(set(state) & set(expected))
             if tuple(state[k].shape) != tuple(expected[k])]
    if missing or unexpected or wrong:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
            if items:
                parts.append(f"{label} ({len(items)}): " + ", ".join(items[:8]) + (" ..." if len(items) > 8 else ""))
        raise ConversionError(f"{what} does not match the model configuration:\n  " + "\n  ".join(parts))


# ------------------------------------------------------------------------------------------------
# weights
# ------------------------------------------------------------------------------------------------

def megatron_to_hf(state: Dict[str, torch.Tensor], spec: ModelSpec) -> Dict[str, torch.Tensor]:
    """Full Megatron tensors (TP1/PP1 names) -> HF tensors (contiguous, same dtype)."""
    check_shapes(state, megatron_shapes(spec), "the Megatron checkpoint")
    hn, nq, ng = spec.kv_channels, spec.num_attention_heads, spec.num_query_groups
    g = nq // ng
    n = _hf_names(spec.arch)
    out = {n["emb"]: state["embedding.word_embeddings.weight"], "model.norm.weight": state["decoder.final_layernorm.weight"]}
    if not spec.tied:
        out["lm_head.weight"] = state["output_layer.weight"]
    out.update({hf: state[meg].reshape(shape) for meg, hf, _, shape in layer_extras(spec)})
    mixing = spec.mixing_layers
    fixed = spec.arch == "resformer" and spec.resformer_lambdas == "fixed"
    for i in range(spec.num_layers):
        m, p, a = f"decoder.layers.{i}.", f"model.layers.{i}.", f"model.layers.{i}.{n['attn']}."
        qkv = state[m + "self_attention.linear_qkv.weight"]
        qkv = qkv.view(ng, (g + 2) * hn, spec.hidden_size)
        gate, up = state[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out.update({
            p + n["ln1"] + ".weight": state[m + "input_layernorm.weight"],
            a + "q_proj.weight": qkv[:, : g * hn].reshape(nq * hn, -1),
            a + "k_proj.weight": qkv[:, g * hn: (g + 1) * hn].reshape(ng * hn, -1),
            a + "v_proj.weight": qkv[:, (g + 1) * hn:].reshape(ng * hn, -1),
            a + "o_proj.weight": state[m + "self_attention.linear_proj.weight"],
            a + "q_norm.weight": state[m + "self_attention.q_layernorm.weight"],
            a + "k_norm.weight": state[m + "self_attention.k_layernorm.weight"],
            p + n["ln2"] + ".weight": state[m + "pre_mlp_layernorm.weight"],
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": state[m + "mlp.linear_fc2.weight"],
        })
        if i + 1 in mixing and spec.arch == "satformer":
            out[a + "value_residual_mixing.alpha_proj.weight"] = state[m + "self_attention.value_residual_gate.weight"]
        if i + 1 in mixing and spec.arch == "resformer":
            lam2 = torch.tensor(0.5, dtype=qkv.dtype) if fixed else state[m + "self_attention.value_residual_lambda2"]
            out[a + "value_residual_mixing.lambda2"] = lam2.reshape(())
    if spec.arch == "resformer":
        dtype = state["embedding.word_embeddings.weight"].dtype
        if fixed:  # lambda1 = 0.5 for every mixing layer, 0 for the others
            logits = torch.full((spec.num_layers - 1,), -math.inf, dtype=dtype)
            logits[torch.tensor([layer - 2 for layer in mixing])] = 0.0  # 1-based layer n -> index n - 2
            scale = torch.tensor(0.5 * len(mixing), dtype=dtype)
        else:  # the same softmax over layers 2..N on both sides
            logits = state["value_residual_lambdas.logits"]
            scale = state["value_residual_lambdas.scale"].reshape(())
        out["model.lambda_manager.lambda_logits"] = logits
        out["model.lambda_manager.lambda_scale"] = scale
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_megatron(state: Dict[str, torch.Tensor], spec: ModelSpec) -> Dict[str, torch.Tensor]:
    """HF tensors -> full Megatron tensors (TP1/PP1 names); inverse of megatron_to_hf."""
    state = dict(state)
    if spec.tied:
        state.pop("lm_head.weight", None)  # some writers save the tied copy too
    check_shapes(state, hf_shapes(spec), "the Hugging Face weights")
    hn, nq, ng, h = spec.kv_channels, spec.num_attention_heads, spec.num_query_groups, spec.hidden_size
    g = nq // ng
    n = _hf_names(spec.arch)
    out = {"embedding.word_embeddings.weight": state[n["emb"]], "decoder.final_layernorm.weight": state["model.norm.weight"]}
    if not spec.tied:
        out["output_layer.weight"] = state["lm_head.weight"]
    out.update({meg: state[hf].reshape(shape) for meg, hf, shape, _ in layer_extras(spec)})
    mixing = spec.mixing_layers
    learned = spec.arch == "resformer" and spec.resformer_lambdas == "learned"
    for i in range(spec.num_layers):
        m, p, a = f"decoder.layers.{i}.", f"model.layers.{i}.", f"model.layers.{i}.{n['attn']}."
        qkv = torch.cat([state[a + "q_proj.weight"].view(ng, g * hn, h), state[a + "k_proj.weight"].view(ng, hn, h),
                         state[a + "v_proj.weight"].view(ng, hn, h)], dim=1)
        out.update({
            m + "input_layernorm.weight": state[p + n["ln1"] + ".weight"],
            m + "self_attention.linear_qkv.weight": qkv.reshape(-1, h),
            m + "self_attention.q_layernorm.weight": state[a + "q_norm.weight"],
            m + "self_attention.k_layernorm.weight": state[a + "k_norm.weight"],
            m + "self_attention.linear_proj.weight": state[a + "o_proj.weight"],
            m + "pre_mlp_layernorm.weight": state[p + n["ln2"] + ".weight"],
            m + "mlp.linear_fc1.weight": torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]),
            m + "mlp.linear_fc2.weight": state[p + "mlp.down_proj.weight"],
        })
        if i + 1 in mixing and spec.arch == "satformer":
            out[m + "self_attention.value_residual_gate.weight"] = state[a + "value_residual_mixing.alpha_proj.weight"]
        if i + 1 in mixing and learned:
            out[m + "self_attention.value_residual_lambda2"] = state[a + "value_residual_mixing.lambda2"].reshape(1)
    if learned:
        out["value_residual_lambdas.logits"] = state["model.lambda_manager.lambda_logits"]
        out["value_residual_lambdas.scale"] = state["model.lambda_manager.lambda_scale"].reshape(1)
    return {k: v.contiguous() for k, v in out.items()}
