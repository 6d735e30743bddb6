"""The model's description: its shape and every arch switch, written once (no torch, no megatron).

`ModelArgs` is what a model is, independently of how it is laid out, stored or trained. Each field carries
its facts as metadata (`model_field`):

    flag        the trainer's flag (training/arguments.py adds one per field that has one, with this default,
                help and choices; a bool field's flag switches it away from its default, --hc-static); None: a
                fixed choice of this project (the paper's Llama-style block), recorded and checked like the others
                but not a flag yet
    help        the flag's help
    resume      must match for a checkpoint to be resumed or its weights loaded (run_folder.model_differences)
    names_run   another value is another run (its run folder's name, sweep/plan.py; arguments.py's tag)
    megatron    Megatron-LM's flag for the same setting (None: Megatron-LM has none); it takes the field's value, or,
                a switch, gives the field's default (--swiglu: gated_linear_unit True; --disable-bias-linear:
                add_bias_linear False), so that a Megatron-LM command line can be checked against the model
    shape       the model's size (monitor and profiler tables); required: a flag the trainer needs unless a
                recipe or a config file gives it (Megatron-LM requires them)

Everything that turns settings into a model reads it: the trainer's flags, the model config
(model/config.py's SATConfig takes these fields; training/setup.py builds it from `model_args(args)`), the
record in every checkpoint and config.json (`asdict(model_args)`), the resume check (RESUME_FIELDS), the
Hugging Face conversion's ModelSpec (a ModelArgs plus vocabulary, positions, rotary base and tying), the
importer and lm-eval's checkpoint loader (`from_record`: a checkpoint's recorded arguments become a model one
way). LEGACY_DEFAULTS is the one place that says what runs written before a field existed used.

Adding a switch is one field here and its use in the model: it becomes a flag, a config field, a recorded
value and (resume=True) a resume check. The Hugging Face conversion does not carry it by itself: an export writes
no config.json key for it and an import takes its default, until the arch's mapping (conversion/mapping.py) writes
and reads one.

Parameter counts sit beside it: `layer_parameters` (one layer's parameters by part, as built: the block's here, the
arch's own parts from its module, megatron_sat/archs/) and `model_parameters` (the whole model's), which
model/sizes.py, the planner and the dry run read.
"""

import typing
from dataclasses import dataclass, field, fields
from typing import Dict, Mapping, Optional

from megatron_sat import archs
from megatron_sat.archs import (
    ARCHS,
    GATE_IMPLS,
    GATES,
    LOCAL_ATTENTION,
    OUTPUT_LAYER_INITS,
    RESFORMER_LAMBDAS,
    ffn_size,
    mixing_layers,
)

_REQUIRED = "required unless --recipe or --config gives it (no default)"


def model_field(default, *, flag: Optional[str] = None, help: Optional[str] = None, resume: bool = True,
                names_run: bool = True, megatron: Optional[str] = None, choices=None, shape: bool = False,
                required: bool = False):
    """A ModelArgs field with its facts (the module docstring says what each means)."""
    return field(default=default, metadata=dict(flag=flag, help=help, resume=resume, names_run=names_run,
                                                megatron=megatron, choices=choices, shape=shape, required=required))


@dataclass
class ModelArgs:
    """The model: shape and arch switches under SATConfig's field names (model/config.py). The derived sizes
    (num_query_groups, ffn_hidden_size, kv_channels) are None until given and resolved here as Megatron does."""

    arch: str = model_field("satformer", flag="--arch", help=f"one of {', '.join(ARCHS)}")
    num_layers: int = model_field(4, flag="--num-layers", help=_REQUIRED, megatron="--num-layers", shape=True,
                                  required=True)
    hidden_size: int = model_field(64, flag="--hidden-size", help=_REQUIRED, megatron="--hidden-size", shape=True,
                                   required=True)
    num_attention_heads: int = model_field(4, flag="--num-attention-heads", help=_REQUIRED,
                                           megatron="--num-attention-heads", shape=True, required=True)
    num_query_groups: Optional[int] = model_field(None, flag="--num-query-groups",
                                                  help="KV heads (default: = attention heads)",
                                                  megatron="--num-query-groups", shape=True)
    ffn_hidden_size: Optional[int] = model_field(None, flag="--ffn-hidden-size", help="default 4 x hidden",
                                                 megatron="--ffn-hidden-size", shape=True)
    value_residual_gate: str = model_field("relu", flag="--value-residual-gate",
                                           help=f"SATFormer gate, one of {', '.join(GATES)}")
    # 'fused': W_alpha's N_kv rows inside linear_qkv, one per KV group, and the mix in one GPU kernel
    # (model/fused_gate.py); 'separate': its own GEMM on the normalised x. Same function and checkpoints. Fused needs
    # num_query_groups divisible by TP and no QKV bias; otherwise the gate is separate (SATConfig says which runs)
    value_residual_gate_impl: str = model_field(
        "fused", flag="--value-residual-gate-impl", resume=False,
        help=f"SATFormer gate: {' | '.join(GATE_IMPLS)} (fused: W_alpha's rows in the QKV projection and the mix in "
             "one GPU kernel; separate: its own GEMM, for A/B runs); checkpoints load in either")
    value_residual_last_k: Optional[int] = model_field(None, flag="--value-residual-last-k",
                                                       help="mix V1 into the last k layers only")
    # ResFormer: 'fixed' is V' = 0.5 V1 + 0.5 V; 'learned' the SATFormer authors' baseline: per-layer lambda2 (init
    # 0.5) and lambda1 = s * softmax(logits) over all L - 1 layers after the first (s init to L, logits init 0; with
    # last-k the non-mixing layers' logits stay in the softmax, as the authors'), shared by every pipeline stage
    resformer_lambdas: str = model_field("learned", flag="--resformer-lambdas", choices=RESFORMER_LAMBDAS)
    hc_expansion_rate: int = model_field(4, flag="--hc-expansion-rate",
                                         help="hyperconnections: number of residual streams n")
    hc_dynamic: bool = model_field(True, flag="--hc-static",
                                   help="hyperconnections: static connection weights only (default: dynamic, tanh, "
                                        "as the authors)")
    # MUDDFormer's FFN width grows linearly from 0.5x (layer 1) to 1.5x (layer L), rounded to a multiple of 256
    # (the authors' configs; archs.ffn_size), keeping the total about the same
    muddformer_param_realloc: bool = model_field(
        True, flag="--no-muddformer-param-realloc",
        help="muddformer: same FFN width in every layer (default: 0.5x at layer 1 to 1.5x at layer L)")
    # the SATFormer authors' attention builds its q/k norms with flash-linear-attention's RMSNorm default, 1e-5,
    # never with norm_eps (1e-6, layernorm_epsilon here)
    qk_norm_eps: float = model_field(
        1e-5, flag="--qk-norm-eps",
        help="eps of the per-head q/k RMSNorms (the SATFormer authors': 1e-5; the other norms use 1e-6). "
             "Checkpoints that record none used the other norms' eps (1e-6): resuming one asks for --qk-norm-eps 1e-6")
    # 'unscaled' is N(0, std) as the authors' models (rescale_prenorm_residual=False); ignored when SATConfig's
    # output_layer_init_method is given
    output_layer_init: str = model_field(
        "scaled", flag="--output-layer-init", choices=OUTPUT_LAYER_INITS, resume=False,
        help="attention-output and MLP-down projections: scaled = N(0, std / sqrt(2L)) (Megatron), unscaled = "
             "N(0, std) (the SATFormer authors; the paper recipes)")
    # not a weight: checkpoints load in either (model/core_attention.py)
    local_attention: str = model_field(
        "sdpa", flag="--local-attention", choices=LOCAL_ATTENTION, resume=False,
        help="core attention of the local implementation: sdpa = torch's scaled_dot_product_attention (flash "
             "kernels on GPUs), dot_product = Megatron's DotProductAttention (materialises the s x s scores)")
    # published shapes (Qwen3: head dim 128 at hidden 1024 with 16 heads; Llama: no QK-norm, norm eps 1e-5). The head
    # dim is free for every arch: SATFormer's gate and V1 are per KV head ([s, b, ng, hn])
    kv_channels: Optional[int] = model_field(
        None, flag="--kv-channels", megatron="--kv-channels",
        help="head dim, independent of hidden / heads (default: --hidden-size / --num-attention-heads)")
    layernorm_epsilon: float = model_field(1e-6, flag="--norm-epsilon", megatron="--norm-epsilon",
                                           help="eps of the input, pre-MLP and final RMSNorms (Llama: 1e-5)")
    # the paper's default is on; --no-qk-layernorm for Llama-style attention (a flag named after its field takes
    # both spellings, Megatron-LM's --qk-layernorm a no-op here)
    qk_layernorm: bool = model_field(True, flag="--qk-layernorm", megatron="--qk-layernorm",
                                     help="per-head RMSNorm of q and k (default on, as the paper; --no-qk-layernorm: "
                                          "off, as Llama)")
    # Llama 3.1+ RoPE scaling (transformers' rope_type "llama3"): the inverse frequencies whose wavelength is longer
    # than original / low are divided by the factor, those shorter than original / high are kept, those between are
    # interpolated smoothly (model/rope.py). Megatron-Core's RotaryEmbedding fixes low, high and original at 1, 4
    # and 8192; here all four are the model's, so any Llama 3.x config is exact
    use_rope_scaling: bool = model_field(
        False, flag="--use-rope-scaling", megatron="--use-rope-scaling",
        help="Llama 3.1+ RoPE scaling (rope_type llama3) with the four --rope-scaling-* values")
    rope_scaling_factor: float = model_field(
        8.0, flag="--rope-scaling-factor", megatron="--rope-scaling-factor",
        help="with --use-rope-scaling: low frequencies divided by this (>= 1; Llama 3.1: 8, Llama 3.2: 32)")
    rope_scaling_low_freq_factor: float = model_field(
        1.0, flag="--rope-scaling-low-freq-factor",
        help="with --use-rope-scaling: wavelengths above original / this are scaled by the factor (> 0)")
    rope_scaling_high_freq_factor: float = model_field(
        4.0, flag="--rope-scaling-high-freq-factor",
        help="with --use-rope-scaling: wavelengths below original / this are kept (> the low factor)")
    rope_scaling_original_max_position_embeddings: int = model_field(
        8192, flag="--rope-scaling-original-max-position-embeddings",
        help="with --use-rope-scaling: the context the model was first trained at (> 0; Llama 3.x: 8192)")
    # the paper's Llama-style block (docs/architectures.md): fixed here, recorded and checked on resume
    normalization: str = model_field("RMSNorm", megatron="--normalization")
    gated_linear_unit: bool = model_field(True, megatron="--swiglu")
    add_bias_linear: bool = model_field(False, megatron="--disable-bias-linear")
    init_method_std: float = model_field(0.02, flag="--init-method-std", resume=False, megatron="--init-method-std",
                                         help="std of the normal weight init (Megatron-LM's --init-method-std)")
    value_residual_gate_init_std: float = model_field(0.02, resume=False)  # std of W_alpha's normal init

    def __post_init__(self):
        heads = self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None and heads:
            self.kv_channels = self.hidden_size // heads  # TransformerConfig's default

    # the per-arch facts, under SATConfig's names (the arch's module, megatron_sat/archs/, writes them once for both)
    @property
    def uses_value_residual(self) -> bool:
        return archs.get(self.arch).value_residual

    @property
    def is_dense(self) -> bool:
        return archs.get(self.arch).dense

    @property
    def mixing_layers(self) -> list:
        return mixing_layers(self)

    def ffn(self, layer_number: int) -> int:
        """FFN width of 1-based layer_number (MUDDFormer's vary with depth)."""
        return ffn_size(self, layer_number)


FIELDS = tuple(fields(ModelArgs))
NAMES = tuple(f.name for f in FIELDS)
FLAGGED = tuple(f.name for f in FIELDS if f.metadata["flag"])  # the trainer's model flags, by dest
RESUME_FIELDS = tuple(f.name for f in FIELDS if f.metadata["resume"])
SHAPE = tuple(f.name for f in FIELDS if f.metadata["shape"])
REQUIRED = tuple(f.name for f in FIELDS if f.metadata["required"])

# what runs recorded before a field existed used, where that differs from the field's default today: every reader
# of an older checkpoint or config.json (from_record, the resume check) fills it in from here
LEGACY_DEFAULTS = {"qk_norm_eps": 1e-6}  # q/k norms used the other norms' eps before they had their own


def rope_scaling_errors(model) -> list:
    """One line per bad RoPE scaling value of `model` (a ModelArgs, or anything with its fields), under the trainer's
    flag names; checked whether or not --use-rope-scaling is on (the values are recorded either way)."""
    out = []
    if not model.rope_scaling_factor >= 1:
        out.append(f"--rope-scaling-factor must be >= 1 (got {model.rope_scaling_factor})")
    low, high = model.rope_scaling_low_freq_factor, model.rope_scaling_high_freq_factor
    if not 0 < low < high:
        out.append(f"need 0 < --rope-scaling-low-freq-factor ({low}) < --rope-scaling-high-freq-factor ({high})")
    if not model.rope_scaling_original_max_position_embeddings > 0:
        out.append("--rope-scaling-original-max-position-embeddings must be > 0 (got "
                   f"{model.rope_scaling_original_max_position_embeddings})")
    return out


def defaults() -> dict:
    """{field: default} (the derived sizes None)."""
    return {f.name: f.default for f in FIELDS}


def flag_type(f) -> Optional[type]:
    """The argparse type of a field's flag: int or float (str and switches: None, argparse's own)."""
    kind = f.type
    if typing.get_origin(kind) is typing.Union:  # Optional[int] -> int
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return kind if kind in (int, float) else None


def with_legacy(record: Mapping) -> dict:
    """`record` (a checkpoint's or config.json's recorded fields or arguments) with LEGACY_DEFAULTS for the fields
    it does not record."""
    return dict({k: v for k, v in LEGACY_DEFAULTS.items() if k not in record}, **record)


def from_record(record: Mapping) -> ModelArgs:
    """The ModelArgs of recorded arguments: a namespace's vars, a checkpoint's args or model fields, a config.json.
    Keys that are not fields are ignored, None is the default, and what an older run did not record is
    LEGACY_DEFAULTS' value (else today's default)."""
    known = with_legacy({k: v for k, v in record.items() if k in NAMES and v is not None})
    return ModelArgs(**known)


def model_args(args) -> ModelArgs:
    """The ModelArgs of parsed trainer arguments (an argparse namespace): every flagged field from its flag, the
    fixed ones at their defaults."""
    return ModelArgs(**{k: getattr(args, k) for k in FLAGGED})


def record(model) -> dict:
    """What checkpoints and config.json record of a model: its ModelArgs' fields, as asdict gives them (`model`: a
    ModelArgs, or anything with its fields: a SATConfig, the conversion's ModelSpec)."""
    return {k: getattr(model, k) for k in NAMES}


# ---------------------------------------------------------------------------------------------------------------
# parameters: the block's formulas here, each arch's own parts in its module (megatron_sat/archs/); model/sizes.py,
# the planner and the dry run read them
# ---------------------------------------------------------------------------------------------------------------

LAYER_PARTS = ("attention", "mlp", "norms", "value_residual", "gate_padding", "connections")
# parts whose tensors tensor parallelism splits (the others are replicated on every TP rank); SATFormer's gate
# is split too when it is fused into linear_qkv
SHARDED_PARTS = ("attention", "mlp", "gate_padding")


def layer_parameters(model, layer: int, tp: int = 1) -> Dict[str, int]:
    """Parameters of 1-based global layer `layer` by part (LAYER_PARTS), exactly as built, plus "sharded": how many
    of them tensor parallelism splits over the `tp` ranks (the rest are on every rank). `model`: a ModelArgs or
    anything with its field names (a SATConfig). SATFormer's fused gate pads each rank's rows to a multiple of 16
    (gate_padding, which depends on tp); its W_alpha is split with linear_qkv when fused, else replicated."""
    h, hn = model.hidden_size, model.kv_channels
    nq, ng = model.num_attention_heads, model.num_query_groups
    parts = dict.fromkeys(LAYER_PARTS, 0)
    parts["attention"] = h * (nq + 2 * ng) * hn + nq * hn * h  # linear_qkv + linear_proj
    parts["mlp"] = h * ffn_size(model, layer) * (3 if model.gated_linear_unit else 2)
    parts["norms"] = 2 * h + (2 * hn if model.qk_layernorm else 0)  # input, pre-MLP, q and k norms
    sharded_gate = archs.get(model.arch).layer_parameters(model, layer, tp, parts)  # the arch's own parts
    parts["sharded"] = sum(parts[p] for p in SHARDED_PARTS) + (parts["value_residual"] if sharded_gate else 0)
    return parts


def chunk_parameters(model) -> int:
    """Parameters every model chunk (pipeline stage part) holds once, replicated (the arch's module says: ResFormer's
    learned lambda1, L - 1 logits and a scale)."""
    return archs.get(model.arch).chunk_parameters(model)


def model_parameters(model, vocab_size: int, tied_embeddings: bool = True, tp: int = 1) -> Dict[str, int]:
    """The whole model's parameters by part (LAYER_PARTS summed over the layers, the word embedding and output
    layer, the final norm in "norms", ResFormer's lambda1 in "value_residual") and their "total" (which counts
    the fused gate's padding: it takes memory)."""
    parts = dict.fromkeys(("embedding",) + LAYER_PARTS, 0)
    for layer in range(1, model.num_layers + 1):
        for name, n in layer_parameters(model, layer, tp).items():
            if name in parts:
                parts[name] += n
    parts["embedding"] = vocab_size * model.hidden_size * (1 if tied_embeddings else 2)
    parts["norms"] += model.hidden_size  # final norm
    parts["value_residual"] += chunk_parameters(model)
    parts["total"] = sum(parts.values())
    return parts

