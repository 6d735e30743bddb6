"""`Arch`: what the project knows about one architecture, asked by the model, the planner, FLOPs, the conversion
and the tools (no torch, no megatron: argument parsing, the planner and the Slurm tools read it).

An arch is a subclass with its facts as class attributes and its formulas as methods; every default here is the
Transformer's (Megatron's GPT layer, nothing carried between layers). `model` / `config` / `cfg` / `spec`
arguments are anything with ModelArgs' field names (model/args.py): a ModelArgs, a SATConfig, the conversion's
ModelSpec. The hooks, by reader:

    checks      errors(model, name, setting): one line per setting the arch refuses (argument checks and
                SATConfig); layout_errors(config): what it refuses at a TP size (SATConfig)
    model       layer_class, attention_class ("module:Class", resolved by model/specs.py, or the class itself),
                unfused_input_norm(config); mixing_layers(model), ffn_size(model, layer); stream_count (inputs
                besides the residual stream handed on to the next layer, dense archs); wire_channels(config,
                last_first_layer) (channels added to the pipeline message); learned_lambdas(config) (ResFormer's
                model-wide lambda1)
    parameters  layer_parameters(model, layer, tp, parts), chunk_parameters(model) (model/args.py sums them)
    FLOPs       flops(cfg, out, tp): the arch's terms of model/flops.py's breakdown
    planner     connection_bytes(...), activation_extra(...), fused_gate(...) (training/planner.py)
    step time   step_ops(model, layer, ctx): the operators the arch adds to a layer (steptime/)
    conversion  hf_model_type, hf_class, hf_config(spec, cfg), hf_spec_fields(cfg, need), hf_names(),
                layer_extras(spec) (conversion/mapping.py); hf_code (conversion/hf_io.py)
    upcycling   upcycle_switch(field), own_fields(model), upcycle_errors(model, setting), upcycle_start(name, std),
                upcycle_note: starting the arch from a Transformer's weights (model/upcycle.py: the trainer's
                --pretrained-checkpoint of a Transformer run and the HF import's --arch)
    words       title (model card, figure legends), tags (model card), colour (sweep figures)

A new reader of per-arch knowledge adds its hook here, with the Transformer's answer as the default, and overrides
it in the arch modules that differ (as flops and connection_bytes are).

A new arch is a module in this package (found by its file: registry.py imports every module here) or a user's
module named in MSAT_ARCH_MODULES, that calls `register(MyArch())` (docs/architectures.md).
"""

from typing import Dict, List, Optional


class Arch:
    """The Transformer's facts: the defaults every arch overrides where it differs."""

    name: str = ""
    title: str = ""                  # how a model card and a figure legend name it
    colour: str = "#7F7F7F"          # its line colour in sweep figures
    tags: tuple = ()                 # the model card's tags besides 'megatron-sat' and the name
    aliases: tuple = ()              # other spellings of the name, suggested when one is given
    value_residual: bool = False     # carries layer 1's values V1 to later layers
    gated: bool = False              # V1 enters through SATFormer's learned gate (gate telemetry, fused gate)
    dense: bool = False              # carries every earlier layer's output (no full recompute)
    baseline: bool = False           # one of the paper's dense-connection baselines: BF16 only
    stream_count: int = 0            # inputs besides the residual stream a dense layer hands to the next
    layer_class: Optional[object] = None      # None: Megatron's TransformerLayer
    attention_class: Optional[object] = None  # None: Megatron's SelfAttention
    hf_model_type: Optional[str] = None       # the exported config.json's model_type
    hf_class: Optional[str] = None            # prefix of the exported remote-code classes (None: transformers')
    # the remote code an export ships: (file in conversion/hf_code, its name in the export), in writing order,
    # and text each shipped file has rewritten ({arch} in either: the arch's name)
    hf_code: tuple = ()
    hf_code_rewrites: tuple = ()
    # the arch's rows of the weight-name table (conversion/mapping.py's MODEL_WEIGHTS and LAYER_WEIGHTS, whose
    # columns they have; 'which': 'all', or 'mixing' for the layers that mix V1)
    hf_model_weights: tuple = ()
    hf_layer_weights: tuple = ()
    # the paper's 760M figures of SATFormer against this arch: (throughput x, memory saving), None: not reported
    paper_satformer_vs: Optional[tuple] = None
    # what the run banner says beside the name (None: the name alone)
    banner_note: Optional[str] = None
    # what the planner's memory estimate counts for a baseline (printed under its plan by plan-layout)
    memory_note: Optional[str] = None
    # how a start from a Transformer sets the arch's own parameters (the run's log line)
    upcycle_note: Optional[str] = None

    def __repr__(self) -> str:
        return f"<arch {self.name}>"

    # ---- checks ---------------------------------------------------------------------------------------------
    def errors(self, model, name, setting) -> List[str]:
        """One line per setting of `model` this arch refuses; name(field) / setting(field, value) spell a
        setting as a flag or a config field."""
        errors = []
        if self.baseline and model.fp8:
            errors.append(f"{name('fp8')} is not supported for the {self.name} baseline (BF16 only)")
        if self.dense and model.recompute_granularity == "full":
            errors.append(f"{setting('recompute_granularity', 'full')} is not supported for "
                          f"{setting('arch', self.name)}: arch {self.name!r} carries every earlier layer's output "
                          "from layer to layer, which full activation recompute cannot checkpoint; use "
                          f"{setting('recompute_granularity', 'selective')}")
        return errors

    @property
    def plain(self) -> bool:
        """Megatron's own layer and attention (the Transformer): what an HF import can grow another arch from."""
        return self.layer_class is None and self.attention_class is None

    def layout_errors(self, config) -> List[str]:
        """What the arch refuses of a model config's layout (its TP size)."""
        return []

    # ---- the model ------------------------------------------------------------------------------------------
    def unfused_input_norm(self, config) -> bool:
        """Whether the layer needs its input norm apart from linear_qkv (Transformer Engine's fused norm + QKV)."""
        return False

    def mixing_layers(self, model) -> List[int]:
        """1-based numbers of the layers that mix V1 (none without a value residual)."""
        return []

    def ffn_size(self, model, layer_number: int) -> int:
        """FFN width of 1-based layer_number."""
        return model.ffn_hidden_size

    def wire_channels(self, config, last_first_layer: int) -> int:
        """Channels the arch adds to the pipeline message ([s', b, h] plus these), besides V1, with PP;
        last_first_layer: the first global layer (1-based) of the last model chunk."""
        return 0

    def learned_lambdas(self, config) -> bool:
        """Whether the model holds ResFormer's model-wide learned lambda1."""
        return False

    # ---- parameters -----------------------------------------------------------------------------------------
    def layer_parameters(self, model, layer: int, tp: int, parts: Dict[str, int]) -> bool:
        """Add the arch's parameters of 1-based `layer` to parts (model/args.py's LAYER_PARTS); True when its
        value-residual parameters are split over TP (SATFormer's fused gate)."""
        return False

    def chunk_parameters(self, model) -> int:
        """Parameters every model chunk holds once."""
        return 0

    # ---- FLOPs ----------------------------------------------------------------------------------------------
    def flops(self, cfg, out: Dict[str, int], dims: Dict[str, int], tp: int) -> None:
        """Set the arch's terms of one token's forward FLOPs (model/flops.py: gate, gate_padding, mixing,
        connections; mlp where widths vary). dims: h, L, nh, ng, d (head dim), mlp_mats, m (mixing layers)."""

    # ---- the planner ----------------------------------------------------------------------------------------
    def fused_gate(self, cfg, tp: int) -> bool:
        """Whether the gate's rows are fused into linear_qkv at TP `tp`."""
        return False

    def padding_rows(self, cfg, tp: int) -> int:
        """Zero rows that pad one fused layer's linear_qkv over all TP ranks (0: no fused gate)."""
        return 0

    def activation_extra(self, cfg, *, s: int, b: int, t: int, act: float) -> float:
        """Bytes a layer keeps beyond the Transformer block's, one micro-batch (the gate's output)."""
        return 0.0

    def v1_kept_on_first_layer(self) -> bool:
        """Whether V1 lives inside layer 1's kept QKV output (no separate copy on that stage)."""
        return False

    def connection_bytes(self, cfg, layer: int, *, s: int, b: int, t: int, sp_div: int, act: float, local: bool,
                         first_in_chunk: bool, recompute: Optional[str]) -> float:
        """Bytes global layer `layer`'s connections keep for backward, one micro-batch."""
        return 0.0

    # ---- the step-time model ---------------------------------------------------------------------------------
    def step_ops(self, model, layer: int, ctx):
        """What the arch adds to global layer `layer`'s operators for one micro-batch on one rank (the step-time
        model, steptime/arch_ops.py): ctx.tokens (b s / CP, the GEMMs' rows), ctx.sp_tokens (/ TP under
        sequence parallelism), ctx.tp and ctx.act_bytes size them; ctx.gemm(...) and ctx.memory(...) make the
        operators (forward; their backward is derived), and ctx.layer(ops, qkv_columns, replaces_residual) is the
        answer. Each operator's group names it in the breakdown. The Transformer adds nothing."""
        return ctx.layer()

    # ---- starting from a Transformer (upcycling) -----------------------------------------------------------
    def upcycle_switch(self, field: str) -> bool:
        """Whether ModelArgs field `field` is one of the arch's own switches, which a Transformer's checkpoint has no
        say on (a start from one takes them from the command)."""
        return False

    def own_fields(self, model) -> tuple:
        """Name suffixes of the parameters the arch adds over a Transformer (a start from a Transformer's weights
        sets them by upcycle_start; every other tensor comes from the Transformer)."""
        return ()

    def upcycle_errors(self, model, setting) -> List[str]:
        """One line per reason `model` cannot start from a Transformer's weights at (or next to) its function
        (the Transformer itself never asks: its start is the checkpoint)."""
        return [f"{setting('arch', self.name)} cannot start from a Transformer's weights: no start of it computes "
                "the Transformer's function; train it from scratch, or start --arch satformer or --arch resformer from "
                "the Transformer"]

    def upcycle_start(self, name: str, std: float) -> tuple:
        """How own parameter `name` starts: ('normal', std) drawn from a generator seeded by its name
        (model/upcycle.py), or ('constant', value)."""
        raise NotImplementedError(f"arch {self.name!r} has no own parameter {name!r}")

    # ---- Hugging Face ---------------------------------------------------------------------------------------
    def hf_config(self, spec, decoder: dict, remote: dict) -> dict:
        """config.json of an export: `remote`, the keys every remote-code export shares, plus the arch's
        (`decoder`: the keys of transformers' Llama and Qwen3 configs)."""
        return remote

    def hf_spec_fields(self, cfg: dict, need) -> dict:
        """The ModelArgs fields of an imported config.json of an arch without remote code (hf_class None), but its
        RoPE (theta and scaling), which the conversion reads for every arch (mapping.rope_fields); need(cond, msg)
        collects a refusal."""
        raise NotImplementedError(f"arch {self.name!r} imports through remote code (hf_extra_fields)")

    def hf_extra_fields(self, cfg: dict, need) -> dict:
        """The ModelArgs fields an imported remote-code config.json gives beyond the shared ones;
        need(cond, msg) collects a refusal."""
        return {}

    def hf_code_for(self, spec) -> tuple:
        """The remote code files an export of `spec` ships (hf_code)."""
        return self.hf_code

    def hf_names(self) -> dict:
        """The HF module names of the weight table's {emb}, {attn}, {ln1}, {ln2}."""
        return dict(emb="model.embeddings.weight", attn="attn", ln1="attn_norm", ln2="mlp_norm")

    def hf_only_weights(self, spec) -> bool:
        """Whether the arch's own table rows are HF-only in this model (no Megatron tensor: written by the export,
        dropped by the import)."""
        return False

    def layer_extras(self, spec) -> List[tuple]:
        """(Megatron name, HF name, Megatron shape, HF shape) of the arch's own tensors, moved as they are."""
        return []
