"""Megatron <-> Hugging Face: model description, configs, weight names and layouts (torch only, no megatron).

A `ModelSpec` describes one model independently of both frameworks. The weights move between Megatron (full
tensors at TP1/PP1, GPTModel.named_parameters names: decoder.layers.{i}.self_attention.linear_qkv.weight, ...) and
Hugging Face:
    SATFormer / ResFormer and the baselines: the authors' names (see hf_code/modeling_*.py);
    Transformer: transformers' native Qwen3 (per-head q/k RMSNorm, SwiGLU, rotate-half RoPE, no biases).
The names and shapes on both sides are one table (MODEL_WEIGHTS, LAYER_WEIGHTS, and layer_extras for the baselines'
own tensors); the shapes, the export and the import all read it. Two tensors change layout: Megatron's fused QKV
weight (per KV group: its q heads, k, v) and linear_fc1 ([gate; up]).

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

from megatron_sat import archs
from megatron_sat.model.args import ModelArgs, rope_scaling_errors


def convertible(names=None) -> tuple:
    """Every arch with an HF format (each arch's module says its model_type, config keys and weight names); names:
    the archs to look at (default: every registered one, a user's module of MSAT_ARCH_MODULES included)."""
    return tuple(a for a in (archs.names() if names is None else names) if archs.get(a).hf_model_type)


def hf_model_types(names=None) -> dict:
    """arch -> the exported config.json's model_type (the SATFormer authors' for the archs with remote code)."""
    return {a: archs.get(a).hf_model_type for a in convertible(names)}


def hf_classes(names=None) -> dict:
    """arch -> the class-name prefix of its exported remote code."""
    return {a: archs.get(a).hf_class for a in convertible(names) if archs.get(a).hf_class}


# the package's archs (importing this module imports no user module; the functions above include them)
CONVERTIBLE = convertible(archs.ARCHS)
HF_MODEL_TYPES = hf_model_types(archs.ARCHS)
HF_CLASSES = hf_classes(archs.ARCHS)


class ConversionError(ValueError):
    """A checkpoint or an HF folder that cannot be converted; the message says why."""


def unsupported_arch(arch: str, what: str = "arch") -> ConversionError:
    """The refusal of an arch that has no HF conversion, naming it and the convertible ones."""
    return ConversionError(f"{what} {arch!r} cannot be converted; supported archs: {', '.join(convertible())}")


@dataclass(kw_only=True)
class ModelSpec(ModelArgs):
    """One model for the conversion: its ModelArgs (model/args.py: shape, arch switches, norms) plus what the
    trainer keeps outside the model's description: the vocabulary (padded, as stored), the positions, the rotary
    base and whether the output layer is tied to the word embedding."""

    vocab_size: int
    max_position_embeddings: int
    rotary_base: float = 10000.0
    tied: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.arch not in convertible():
            raise unsupported_arch(self.arch)
        if self.num_attention_heads % self.num_query_groups:
            raise ConversionError(f"{self.num_attention_heads} attention heads are not a multiple of "
                                  f"{self.num_query_groups} KV heads")
        rope_errors = rope_scaling_errors(self)
        if rope_errors:
            raise ConversionError("RoPE scaling: " + "; ".join(rope_errors))

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------------
# configs
# ------------------------------------------------------------------------------------------------

# RoPE in config.json: transformers 4.x reads "rope_theta" and "rope_scaling" (None, or a dict with its "rope_type" or
# older "type"), 5.x "rope_parameters" (rope_type and rope_theta together). The one scaling built here is Llama 3.1+'s
# "llama3": its four keys are ModelArgs' rope_scaling_* fields
LLAMA3_KEYS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_scaling_low_freq_factor",
               "high_freq_factor": "rope_scaling_high_freq_factor",
               "original_max_position_embeddings": "rope_scaling_original_max_position_embeddings"}
ROPE_TYPES = ("default", "llama3")


def rope_keys(spec: ModelSpec) -> dict:
    """The config.json keys of the model's RoPE, for transformers 4.x and 5.x both."""
    theta = float(spec.rotary_base)
    if not spec.use_rope_scaling:
        return dict(rope_theta=theta, rope_parameters=dict(rope_type="default", rope_theta=theta))
    scaling = dict(rope_type="llama3", **{key: getattr(spec, name) for key, name in LLAMA3_KEYS.items()})
    return dict(rope_theta=theta, rope_scaling=scaling, rope_parameters=dict(scaling, rope_theta=theta))


def rope_fields(cfg: dict, need) -> dict:
    """The ModelSpec fields of an HF config's RoPE (rotary base, scaling), whichever transformers wrote it; an
    unsupported rope_type goes to `need` (one problem, naming what is supported)."""
    rope, scaling = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}  # transformers 5, 4
    params = scaling or rope
    kind = params.get("rope_type") or params.get("type") or "default"
    out = dict(rotary_base=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if kind not in ROPE_TYPES:
        need(False, f"rope_type {kind!r} (supported: {' and '.join(repr(t) for t in ROPE_TYPES)}, Llama 3.1+'s RoPE "
                    "scaling)")
    elif kind == "llama3":
        missing = [key for key in LLAMA3_KEYS if params.get(key) is None]
        need(not missing, f"rope_type 'llama3' without {', '.join(missing)}")
        out.update(use_rope_scaling=True, **{name: params[key] for key, name in LLAMA3_KEYS.items()
                                             if params.get(key) is not None})
    return out


def hf_config(spec: ModelSpec, dtype: torch.dtype, bos=None, eos=None, pad=None) -> dict:
    """config.json contents for the export of `spec`."""
    dtype_name = str(dtype).replace("torch.", "")
    # the fields transformers' Llama and Qwen3 configs share (the Transformer baseline exports as one of them)
    decoder = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups, head_dim=spec.kv_channels, hidden_act="silu",
        max_position_embeddings=spec.max_position_embeddings, initializer_range=spec.init_method_std,
        rms_norm_eps=spec.layernorm_epsilon, use_cache=True, tie_word_embeddings=spec.tied,
        **rope_keys(spec), attention_bias=False, attention_dropout=0.0, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        dtype=dtype_name)
    arch = archs.get(spec.arch)
    name = arch.hf_class
    if name and spec.use_rope_scaling:
        raise rope_scaling_refusal(spec.arch)
    remote = dict(
        architectures=[f"{name}ForCausalLM"], model_type=arch.hf_model_type,
        auto_map={"AutoConfig": f"configuration_{spec.arch}.{name}Config",
                  "AutoModelForCausalLM": f"modeling_{spec.arch}.{name}ForCausalLM"},
        hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers, num_heads=spec.num_attention_heads,
        num_kv_heads=spec.num_query_groups, head_dim=spec.kv_channels, qkv_bias=False, qk_norm=spec.qk_layernorm,
        window_size=None,
        rope_theta=float(spec.rotary_base), max_position_embeddings=spec.max_position_embeddings,
        hidden_ratio=spec.ffn_hidden_size // spec.hidden_size if spec.ffn_hidden_size % spec.hidden_size == 0
        else spec.ffn_hidden_size / spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
        hidden_act="swish", initializer_range=spec.init_method_std, elementwise_affine=True, norm_eps=spec.layernorm_epsilon,
        qk_norm_eps=spec.qk_norm_eps,
        use_cache=True, tie_word_embeddings=spec.tied, fuse_norm=False, fuse_swiglu=False,
        fuse_cross_entropy=False, fuse_linear_cross_entropy=False, use_l2warp=False,
        vocab_size=spec.vocab_size, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, dtype=dtype_name,
    ) if name else {}
    out = arch.hf_config(spec, decoder, remote)  # the arch's keys (its module, megatron_sat/archs/)
    if list(hf_model_types().values()).count(arch.hf_model_type) > 1:  # a model_type two archs share: say which
        out["megatron_sat_arch"] = spec.arch
    return out


def rope_scaling_refusal(arch: str) -> ConversionError:
    """An export of RoPE scaling through remote code: its modeling code has no RoPE scaling."""
    return ConversionError(f"RoPE scaling (llama3) exports only as the Transformer (transformers' Llama or Qwen3): "
                           f"the {arch} export's modeling code has no RoPE scaling")


def spec_from_hf_config(cfg: dict) -> ModelSpec:
    """The ModelSpec of an HF config.json (ours, the SATFormer authors', or a Qwen3 or Llama model we can hold:
    free head dim, GQA, untied embeddings, any rope theta; Llama has no q/k norms)."""
    mt = cfg.get("model_type")
    errors = []

    def need(cond, msg):
        if not cond:
            errors.append(msg)

    types = hf_model_types()
    arch = cfg.get("megatron_sat_arch") if archs.known(cfg.get("megatron_sat_arch") or "") else None
    arch = arch or next((a for a, t in types.items() if t == mt), None)
    if mt == "llama":  # transformers' own Llama: the Transformer without q/k norms
        arch = next((a for a in types if archs.get(a).hf_class is None), None)
    if arch is None:
        raise ConversionError(f"model_type {mt!r} cannot be imported: expected one of "
                              + ", ".join(repr(t) for t in (*dict.fromkeys(types.values()), "llama")))
    rope = rope_fields(cfg, need)
    if archs.get(arch).hf_class is None:  # transformers' own classes (Qwen3, Llama): the arch reads their config
        kw = dict(archs.get(arch).hf_spec_fields(cfg, need), **rope)
    else:
        extra = archs.get(arch).hf_extra_fields(cfg, need)  # the arch's keys (its module, megatron_sat/archs/)
        need(not cfg.get("qkv_bias", False), "qkv_bias=True (the Megatron model has no biases)")
        need(not cfg.get("value_residual_proj_bias", False), "value_residual_proj_bias=True")
        need(cfg.get("window_size") is None, "window_size (sliding-window attention)")
        need(cfg.get("hidden_act", "swish") in ("swish", "silu"), f"hidden_act {cfg.get('hidden_act')!r}")
        need(not rope.get("use_rope_scaling"), "RoPE scaling (llama3; the remote code has none)")
        h = cfg["hidden_size"]
        ffn = cfg.get("intermediate_size") or int(h * (cfg.get("hidden_ratio") or 4))
        kw = dict(arch=arch, num_layers=cfg["num_hidden_layers"], hidden_size=h,
                  num_attention_heads=cfg["num_heads"], num_query_groups=cfg.get("num_kv_heads") or cfg["num_heads"],
                  ffn_hidden_size=ffn, kv_channels=cfg.get("head_dim") or h // cfg["num_heads"],
                  rotary_base=rope["rotary_base"],
                  # the classes' defaults: q/k norms in the value-residual archs
                  qk_layernorm=bool(cfg.get("qk_norm", archs.get(arch).value_residual)),
                  layernorm_epsilon=cfg.get("norm_eps", 1e-6), value_residual_last_k=cfg.get("value_residual_last_k"),
                  qk_norm_eps=cfg.get("qk_norm_eps", 1e-5),  # the authors' configs have none: fla's default 1e-5
                  tied=cfg.get("tie_word_embeddings", False))
        kw.update(extra)
    if errors:
        raise ConversionError(f"this {mt} model has features the Megatron model does not: " + "; ".join(errors))
    return ModelSpec(vocab_size=cfg["vocab_size"], max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                     **kw)


# ------------------------------------------------------------------------------------------------
# the weight-name table: names and shapes on both sides, written once; shapes, export and import read it
# ------------------------------------------------------------------------------------------------

# (Megatron name, HF name, Megatron shape, HF shape, transform, which models have it) of the model-wide tensors, and
# of the tensors of every layer i (Megatron's under decoder.layers.{i}., HF's under
# model.layers.{i}.). {emb}, {attn}, {ln1}, {ln2}: the arch's HF module names (_hf_names). Shapes in the dims of
# weight_table: h hidden, hn head dim, q = nq hn, kv = ng hn, qkv = (nq + 2 ng) hn, ng KV heads, f the layer's
# FFN width, V vocabulary, L-1 layers after the first; digits as written.
# Which: 'all', 'untied' (no tied output layer), 'qk_layernorm' (q/k norms on), or 'mixing' (the layers that mix
# V1). Each arch's own rows are in its module (Arch.hf_model_weights, hf_layer_weights: after these, in this
# order); they can be HF-only in a model (Arch.hf_only_weights: a fixed ResFormer stores no lambdas).
# The two transforms join several HF tensors into one Megatron tensor, in table order: 'qkv' (per KV group its q
# heads, k and v: Megatron's fused layout) and 'fc1' ([gate; up]); every other tensor moves as it is, reshaped.
MODEL_WEIGHTS = (
    ("embedding.word_embeddings.weight", "{emb}", "V h", "V h", None, "all"),
    ("decoder.final_layernorm.weight", "model.norm.weight", "h", "h", None, "all"),
    ("output_layer.weight", "lm_head.weight", "V h", "V h", None, "untied"),
)
LAYER_WEIGHTS = (
    ("input_layernorm.weight", "{ln1}.weight", "h", "h", None, "all"),
    ("self_attention.linear_qkv.weight", "{attn}.q_proj.weight", "qkv h", "q h", "qkv", "all"),
    ("self_attention.linear_qkv.weight", "{attn}.k_proj.weight", "qkv h", "kv h", "qkv", "all"),
    ("self_attention.linear_qkv.weight", "{attn}.v_proj.weight", "qkv h", "kv h", "qkv", "all"),
    ("self_attention.q_layernorm.weight", "{attn}.q_norm.weight", "hn", "hn", None, "qk_layernorm"),
    ("self_attention.k_layernorm.weight", "{attn}.k_norm.weight", "hn", "hn", None, "qk_layernorm"),
    ("self_attention.linear_proj.weight", "{attn}.o_proj.weight", "h q", "h q", None, "all"),
    ("pre_mlp_layernorm.weight", "{ln2}.weight", "h", "h", None, "all"),
    ("mlp.linear_fc1.weight", "mlp.gate_proj.weight", "2f h", "f h", "fc1", "all"),
    ("mlp.linear_fc1.weight", "mlp.up_proj.weight", "2f h", "f h", "fc1", "all"),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight", "h f", "h f", None, "all"),
)


def _split_qkv(qkv: torch.Tensor, spec: ModelSpec) -> List[torch.Tensor]:
    """Megatron's fused QKV weight -> [q, k, v] (per KV group: its nq/ng query heads, then k, then v)."""
    hn, ng = spec.kv_channels, spec.num_query_groups
    g = spec.num_attention_heads // ng
    qkv = qkv.view(ng, (g + 2) * hn, spec.hidden_size)
    return [qkv[:, : g * hn].reshape(g * ng * hn, -1), qkv[:, g * hn: (g + 1) * hn].reshape(ng * hn, -1),
            qkv[:, (g + 1) * hn:].reshape(ng * hn, -1)]


def _join_qkv(parts: List[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """[q, k, v] -> Megatron's fused QKV weight; inverse of _split_qkv."""
    hn, ng, h = spec.kv_channels, spec.num_query_groups, spec.hidden_size
    g = spec.num_attention_heads // ng
    q, k, v = parts
    return torch.cat([q.view(ng, g * hn, h), k.view(ng, hn, h), v.view(ng, hn, h)], dim=1).reshape(-1, h)


SPLIT = {"qkv": _split_qkv, "fc1": lambda fc1, spec: list(fc1.chunk(2, dim=0))}
JOIN = {"qkv": _join_qkv, "fc1": lambda parts, spec: torch.cat(parts)}


def _has(which: str, spec: ModelSpec, layer: Optional[int] = None) -> bool:
    """Whether a table row's tensor is in this model (`which` as in the table; layer 1-based)."""
    if which == "mixing":
        return layer in spec.mixing_layers
    return which == "all" or (not spec.tied if which == "untied" else spec.qk_layernorm)


def weight_table(spec: ModelSpec) -> List[Tuple[Optional[str], str, tuple, tuple, Optional[str]]]:
    """(Megatron name or None for an HF-only tensor, HF name, Megatron shape, HF shape, transform) of every tensor
    of the model: MODEL_WEIGHTS, LAYER_WEIGHTS for each layer and the baselines' own tensors (layer_extras)."""
    hn, nq, ng, h = spec.kv_channels, spec.num_attention_heads, spec.num_query_groups, spec.hidden_size
    names = _hf_names(spec.arch)
    dims = {"h": h, "hn": hn, "q": nq * hn, "kv": ng * hn, "qkv": (nq + 2 * ng) * hn, "ng": ng, "V": spec.vocab_size,
            "L-1": spec.num_layers - 1}
    arch = archs.get(spec.arch)
    hf_only = arch.hf_only_weights(spec)  # the arch's own rows have no Megatron tensor in this model

    def row(meg, hf, meg_shape, hf_shape, transform, which, own=False):
        def shape(text):
            return tuple(int(d) if d.isdigit() else dims[d] for d in text.split())
        meg = None if hf_only and own else meg
        return meg, hf.format(**names), shape(meg_shape), shape(hf_shape), transform

    rows = [row(*r) for r in MODEL_WEIGHTS if _has(r[-1], spec)]
    rows += [row(*r, own=True) for r in arch.hf_model_weights if _has(r[-1], spec)]
    for i in range(spec.num_layers):
        dims.update({"f": spec.ffn(i + 1), "2f": 2 * spec.ffn(i + 1)})
        rows += [row(f"decoder.layers.{i}." + meg, f"model.layers.{i}." + hf, *rest)
                 for meg, hf, *rest in LAYER_WEIGHTS if _has(rest[-1], spec, i + 1)]
        rows += [row(f"decoder.layers.{i}." + meg, f"model.layers.{i}." + hf, *rest, own=True)
                 for meg, hf, *rest in arch.hf_layer_weights if _has(rest[-1], spec, i + 1)]
    return rows + [(meg, hf, meg_shape, hf_shape, None) for meg, hf, meg_shape, hf_shape in layer_extras(spec)]


def megatron_shapes(spec: ModelSpec) -> Dict[str, tuple]:
    return {meg: shape for meg, _, shape, _, _ in weight_table(spec) if meg}


def hf_shapes(spec: ModelSpec) -> Dict[str, tuple]:
    return {hf: shape for _, hf, _, shape, _ in weight_table(spec)}


def _hf_names(arch: str) -> dict:
    return archs.get(arch).hf_names()


def layer_extras(spec: ModelSpec) -> List[Tuple[str, str, tuple, tuple]]:
    """(Megatron name, HF name, Megatron shape, HF shape) of an arch's own tensors (its module's layer_extras),
    moved as they are."""
    return archs.get(spec.arch).layer_extras(spec)


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

def _fixed_resformer_lambdas(spec: ModelSpec, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """The HF lambdas of a fixed ResFormer (lambda1 = lambda2 = 0.5 in the mixing layers): lambda2 0.5, logits 0 for
    the mixing layers and -inf (an exact zero weight) for the others, scale 0.5 m."""
    mixing = spec.mixing_layers
    logits = torch.full((spec.num_layers - 1,), -math.inf, dtype=dtype)
    logits[torch.tensor([layer - 2 for layer in mixing])] = 0.0  # 1-based layer n -> index n - 2
    out = {"model.lambda_manager.lambda_logits": logits,
           "model.lambda_manager.lambda_scale": torch.tensor(0.5 * len(mixing), dtype=dtype)}
    attn = _hf_names(spec.arch)["attn"]
    out.update({f"model.layers.{n - 1}.{attn}.value_residual_mixing.lambda2": torch.tensor(0.5, dtype=dtype)
                for n in mixing})
    return out


def megatron_to_hf(state: Dict[str, torch.Tensor], spec: ModelSpec) -> Dict[str, torch.Tensor]:
    """Full Megatron tensors (TP1/PP1 names) -> HF tensors (contiguous, same dtype)."""
    check_shapes(state, megatron_shapes(spec), "the Megatron checkpoint")
    table = weight_table(spec)
    hf_only = _fixed_resformer_lambdas(spec, state["embedding.word_embeddings.weight"].dtype) \
        if any(meg is None for meg, *_ in table) else {}
    out, parts = {}, {}
    for meg, hf, _, hf_shape, transform in table:
        if meg is None:
            out[hf] = hf_only[hf]
        elif transform:  # the next of the HF tensors this Megatron tensor splits into, in table order
            out[hf] = parts.setdefault(meg, SPLIT[transform](state[meg], spec)).pop(0)
        else:
            out[hf] = state[meg].reshape(hf_shape)
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_megatron(state: Dict[str, torch.Tensor], spec: ModelSpec) -> Dict[str, torch.Tensor]:
    """HF tensors -> full Megatron tensors (TP1/PP1 names); inverse of megatron_to_hf."""
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}  # older Llama files' buffers
    if spec.tied:
        state.pop("lm_head.weight", None)  # some writers save the tied copy too
    check_shapes(state, hf_shapes(spec), "the Hugging Face weights")
    out, parts = {}, {}
    for meg, hf, meg_shape, _, transform in weight_table(spec):
        if meg is None:
            continue
        if transform:  # joined below from all of its HF tensors
            out[meg] = None
            parts.setdefault(meg, (transform, []))[1].append(state[hf])
        else:
            out[meg] = state[hf].reshape(meg_shape)
    for meg, (transform, tensors) in parts.items():
        out[meg] = JOIN[transform](tensors, spec)
    return {k: v.contiguous() for k, v in out.items()}
