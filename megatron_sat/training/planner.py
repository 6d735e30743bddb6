"""Layout planner: check a recipe's parallel layout and estimate its memory per GPU, without a cluster.

    python tools/plan_layout.py --recipe satformer_1.3B                     # the recipe's default layout
    python tools/plan_layout.py --recipe satformer_1.3B --nodes 1 --gpu H200 --micro-batch-size 8

    from megatron_sat.training.planner import plan_recipe
    plan = plan_recipe("satformer_760M", ["--pipeline-model-parallel-size", "2"], nodes=1)
    print(plan.format()); assert plan.ok, plan.errors

Checks: megatron_sat.parallel.layout.validate (TP/PP/VPP/CP/SP divisibility against heads, KV heads, layers,
sequence, micro-batch count), global batch = micro-batch x DP x accumulation, and memory per GPU <= 90% of
the GPU's (10% left for allocator fragmentation and what the estimate leaves out).

Memory per GPU (bytes; worst pipeline stage; bf16 training on GPUs, fp32 on CPU):
  model states   params_stage x (2 bf16 weights + 4 fp32 grad buffer [grad_reduce_in_fp32]
                                 + 12 fp32 master/m/v, divided by DP with the distributed optimizer)
                 params_stage: the stage's layers' linears / TP (MUDDFormer: each layer's own FFN width; SATFormer's
                 fused gate: W_alpha's rows and their zero padding rows in linear_qkv, sharded with it; its separate
                 gate: replicated) + their norms and the baselines' connections (each layer's own, as built;
                 replicated, not / TP), ResFormer's learned lambda1 on every chunk, + the word embedding (the
                 vocabulary padded to a multiple of 128 x TP, as the trainer does) / TP on the first stage and
                 (tied, PP > 1) its copy on the last stage. Exact: the dry run (megatron_sat/profiling/dry_run.py)
                 checks it against every built rank.
  activations    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
                 counted for this block (RMSNorm, QK-norm, SwiGLU, no dropout), per layer and micro-batch,
                 s sequence, b micro-batch, h hidden, f FFN, a heads, g KV heads, d head dim, t TP
                 (bf16 bytes; every 2 becomes 4 with fp32 activations, activation_bytes=4):
                    attention  2sbh norm in + 2sbh QKV in (both / t with SP) + 2sb(a+g)d/t QK-norm in
                               + 2sb(a+2g)d/t core-attention in + 2sbad/t projection in
                               + the attention kernel's own (dropped by selective recompute): flash
                               attention (Transformer Engine's flash and cuDNN paths in bf16/fp16) keeps the
                               fp32 softmax statistics 4sba/t, its output being the projection's input; TE's
                               unfused fp32 path its scores and softmax (5as^2b/t at 2 bytes a value, doubled at 4)
                    MLP        2sbh norm in + 2sbh FC1 in (/ t with SP) + 8sbf/t (gate, up, silu, product)
                    SATFormer  2sbg/t gate values
                 The local backend (Megatron's local spec, CPU; backend='local') keeps more, measured by the dry
                 run: each RMSNorm keeps an fp32 copy of its input, the fp32 x * rsqrt and fp32 1/rms (8 bytes a
                 value + 4 a row, in place of the input), the rotary q and k besides the QKV output (SATFormer's
                 fused layers excepted), a fifth f-wide SwiGLU tensor, and only the cross entropy's fp32 logits;
                 without recompute its flash attention keeps its output and fp32 log-sum-exp, not 5as^2b scores.
                 full recompute keeps only each layer's input (2sbh, / t with SP) plus one layer's full set.
                 In flight: 1F1B keeps min(PP - stage, micro-batches) micro-batches on a stage (PP = 1: one);
                 interleaving (VPP) multiplies stage 0's by 1 + (PP - 1) / (PP x VPP).
                 Last stage: final-norm and output-layer inputs (4sbh) and logits 6sbV/t (bf16 + fp32 loss).
  V1 extra       value-residual archs carry V1 (2sbgd/t) through every stage for each in-flight micro-batch,
                 plus its gradient accumulator for the one in backward.
  connections    the baselines' activations beyond the block's, per layer i (global, 1-based) and in-flight
                 micro-batch; u = 2sbh (/ t with SP) one hidden-sized tensor, x = 2sb (/ t with SP) one value
                 per token (every connection op is per token; its weights are replicated over TP):
                    DenseFormer       u X_i, kept for every later depth-weighted average (the average Y_i, the
                                      next block's input, takes X_i's place in the block count)
                    MUDDFormer        3 x 2sbh - u: Q, K and V inputs, gathered (SP) or replicated over TP, where
                                      the block counts one QKV input; + 3u X^Q, X^K, X^V (none at a chunk's first
                                      layer: they come on the wire); + (1 + C)u rms(X_i) and the C weighted sums
                                      (the pre-normed X_0..X_i are recomputed in backward, not kept);
                                      + 3Ck x dynamic weights (W1 out, GELU out, weights);
                                      + 2(a+2g)dh/t Q, K, V weight slices (a copy per call, kept for backward);
                                      + u the R stream into the final norm (i = L). k = i + 1 inputs, C = 4 ways
                                      (1 at i = L); the block's MLP term takes the layer's param_realloc width
                    Hyper-Connections 4nu two H [s, b, n*h] and two mixes [s, b, (n+1)*h] in place of the block's
                                      two norm inputs (less (n-1)u at i = 1: its first H is n views of X_0)
                                      + 2u sublayer outputs (beta's gradient); dynamic: + 2nu normed H
                                      + 2n(2n+4)x alpha, beta and their tanh. Full recompute: (n-1)u more per layer
                                      input ([s, b, n*h], not at i = 1) plus one layer's connections in backward
                    norms             each extra norm keeps fp32 statistics (4sb, / t with SP); the local backend
                                      (CPU) also keeps RMSNorm's x * rsqrt (one more u per extra norm: 2 + C
                                      for MUDDFormer, 2n per Hyper-Connections layer)
                 DenseFormer and MUDDFormer refuse full recompute (counted as selective).
                 Pipeline message [s, b, h + W] (/ t with SP), padded to the widest boundary: W = (S + f)h for the
                 dense archs (f: first layer of the last chunk; S = 3 streams for MUDDFormer, 0 for DenseFormer),
                 (n-1)h for Hyper-Connections. Megatron keeps each in-flight micro-batch's received and sent
                 message (deallocate_pipeline_outputs is off): 2sbW (/ t with SP) per chunk that receives and per
                 chunk that sends (Hyper-Connections: sends only; what it receives is the first layer's H above).
                 History grads (dense archs): in backward, gradients of X_0..X_e wait in autograd's buffers until
                 each layer's own backward, (e + 1)u for the one micro-batch in backward (e: the stage's last layer).
                 Checked: with the local backend (fp32) these equal the measured difference in saved bytes to the
                 Transformer's, to the byte for MHA, on one rank (tests/test_recipes.py; also TP 2 with and without
                 SP, once by hand); on GPUs Transformer Engine's norms are taken to keep only their input and
                 statistics (not measured).
                 Approximated: with GQA, Megatron's split of the fused QKV keeps other copies than MUDDFormer's
                 separate Q, K, V (taken equal; the paper grid is MHA); MUDDFormer's FFN widths go through the
                 block's 8sbf/t. Left out: MUDDFormer's stream gradients and the messages' gradients (one at a
                 time), and the Transformer's own [s, b, h] message, which Megatron keeps too.
  overhead       3 GiB (CUDA context, NCCL and cuBLAS workspaces).
GPU time: the step-time model's predicted step (megatron_sat.steptime.predict_step: compute on the GPU's
roofline, the layout's collectives, the pipeline schedule simulated) at the plan's layout x steps x GPUs, with the
band of the model's error against published throughput (steptime's STEP_TIME_ERROR, docs/step_time.md); with an
explicit MFU (mfu=, --mfu) instead: FLOPs per token (megatron_sat.model.flops, 3 x forward) x tokens / (peak x MFU).
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import recipes  # the repository's recipes/ package (the paper grid registers itself on import)
from megatron_sat import archs, steptime
from megatron_sat.archs import ffn_size
from megatron_sat.model.args import LAYER_PARTS, chunk_parameters, layer_parameters
from megatron_sat.model.flops import PEAK_TFLOPS, flops_per_token
from megatron_sat.model.sizes import count_parameters
from megatron_sat.model.wire import chunk_layers, v1_wire_channels, wire_channels
from megatron_sat.training.argument_checks import argument_errors
from megatron_sat.training.arguments import recipe_args
from recipes.paper import CLUSTERS, cluster

GIB = 1024 ** 3
# How closely what the real code builds must match the plan (profiling/dry_run.py checks it); here so that the
# dry run's CLI shows them in --help without importing megatron-core.
DEFAULT_TOLERANCE = 0.01  # relative: Megatron pads its gradient buffers and optimizer shards (measured at most 0.004%)
ACTIVATION_TOLERANCE = 0.03  # relative: saved activations against the planner (measured -2.8% .. +2.4%, docs/dry_run.md)
GPU_MEMORY_GIB = {"H100": 80.0, "H200": 141.0, "A100": 80.0, "cpu": None}
USABLE_FRACTION = 0.9
OVERHEAD_GIB = 3.0


def step_time_error() -> float:
    """The relative band around GPU hours from predicted step times: the step-time model's error against the
    published figures (steptime.STEP_TIME_ERROR, docs/step_time.md)."""

    return steptime.STEP_TIME_ERROR


def known_gpus() -> List[str]:
    """GPU kinds a plan sizes memory for: GPU_MEMORY_GIB's and the step-time model's (gpus.json)."""
    return list(GPU_MEMORY_GIB) + [g for g in steptime.gpu_names() if g not in GPU_MEMORY_GIB]


def gpu_memory_gib(gpu: str) -> Optional[float]:
    """A GPU's memory (GiB): GPU_MEMORY_GIB's, else the step-time model's description of it; None for the CPU or
    an unknown GPU."""
    if gpu in GPU_MEMORY_GIB:
        return GPU_MEMORY_GIB[gpu]
    return float(steptime.load_gpu(gpu).memory_gib) if gpu in steptime.gpu_names() else None


def load_recipes():
    """The recipes package (the paper grid is registered when it is imported)."""
    return recipes


@dataclass
class Plan:
    recipe: str
    arch: str
    nodes: int
    gpus_per_node: int
    gpu: str
    tp: int
    pp: int
    vpp: Optional[int]
    sp: bool
    dp: int
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    seq_length: int
    train_iters: int
    warmup_iters: int
    lr: float
    parameters: int
    flops_per_token: float
    recompute: Optional[str]
    memory: Dict[str, float] = field(default_factory=dict)  # GiB per GPU (worst stage)
    capacity_gib: Optional[float] = None
    gpu_hours: Optional[float] = None
    mfu: Optional[float] = None  # predicted at the layout, or the one given (mfu_given)
    mfu_given: bool = False  # GPU hours from an assumed MFU (--mfu) rather than the step-time model
    step_time_s: Optional[float] = None  # predicted
    gpu_hours_band: Optional[Tuple[float, float]] = None  # the model's error band around gpu_hours
    fp8: bool = False
    errors: List[str] = field(default_factory=list)
    vocab_size: int = 0  # padded as the trainer pads it
    stages: List[dict] = field(default_factory=list)  # stage_estimates, one per pipeline stage

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_length

    @property
    def tokens(self) -> int:
        return self.train_iters * self.tokens_per_step

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def layout(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"] + ([f"VPP{self.vpp}"] if self.vpp else []) + [f"DP{self.dp}"]
        return "x".join(parts) + ("+SP" if self.sp else "")

    @property
    def wall_hours(self) -> Optional[float]:
        return None if self.gpu_hours is None else self.gpu_hours / self.world_size

    def format(self) -> str:
        m = self.memory
        lines = [
            f"recipe {self.recipe}: {self.arch}, {self.parameters / 1e6:,.1f}M parameters",
            f"  cluster   {self.nodes} node(s) x {self.gpus_per_node} {self.gpu} = {self.world_size} ranks, "
            f"layout {self.layout}",
            f"  batch     micro {self.micro_batch_size} x DP {self.dp} x {self.num_microbatches} accumulation = "
            f"global {self.global_batch_size} x seq {self.seq_length} = {self.tokens_per_step:,} tokens/step",
            f"  schedule  {self.train_iters:,} steps = {format_tokens(self.tokens)} tokens, warmup {self.warmup_iters}, "
            f"peak lr {self.lr:g}",
        ]
        if m and self.capacity_gib is None:
            lines.append(f"  memory    not checked ({self.gpu}: no GPU memory to size against)")
        elif m:
            cap = f"{self.capacity_gib:.0f} GiB"
            lines.append(
                f"  memory    {m['total']:.1f} GiB per GPU of {cap} (weights {m['weights']:.1f}, grads {m['grads']:.1f}, "
                f"optimizer {m['optimizer']:.1f}, activations {m['activations']:.1f} "
                f"[{m['in_flight']:g} micro-batch(es) in flight, recompute {self.recompute or 'none'}], "
                f"V1 {m['v1']:.2f}, "
                + (f"connections {m['connections']:.1f}, " if m.get("connections") else "")
                + (f"history grads {m['history_grads']:.1f}, " if m.get("history_grads") else "")
                + f"overhead {m['overhead']:.1f})")
        if self.gpu_hours is not None and self.mfu_given:
            lines.append(f"  compute   {self.flops_per_token / 1e9:.2f} GFLOP/token, {self.gpu_hours:,.0f} GPU hours "
                         f"at an assumed {100 * self.mfu:.0f}% MFU (--mfu) = {self.wall_hours:.1f} h on "
                         f"{self.world_size} GPUs")
        elif self.gpu_hours is not None:
            lo, hi = self.gpu_hours_band
            lines.append(f"  compute   {self.flops_per_token / 1e9:.2f} GFLOP/token, predicted step "
                         f"{self.step_time_s:.2f} s ({100 * self.mfu:.0f}% MFU), {hours(self.gpu_hours)} GPU hours "
                         f"({hours(lo)}-{hours(hi)}) = {self.wall_hours:.1f} h on {self.world_size} GPUs")
        lines.append("  status    OK" if self.ok else "  status    INVALID:\n    " + "\n    ".join(self.errors))
        return "\n".join(lines)


def hours(h: float) -> str:
    """GPU hours as 1,234 or 5.6 (under 10)."""
    return f"{h:,.0f}" if h >= 10 else f"{h:.1f}"


def format_tokens(n: float) -> str:
    """A token count as 1.23B, 4.56M or 7,890 (plans and the grid table)."""
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,.0f}"


def resolve_args(recipe: Optional[str], overrides: Sequence[str] = ()):
    """The trainer's argparse.Namespace for `recipe` + command-line `overrides` (--config FILE among them), by the
    trainer's layered resolver (arguments.recipe_args; not validated for data)."""
    return recipe_args(recipe, overrides)


def default_cluster(recipe: Optional[str]) -> dict:
    """The cluster a plan assumes unless told: a registered recipe's (recipes.paper.cluster), else the debug one
    (a config file alone, an external recipe)."""
    return cluster(recipe) if recipe in recipes.RECIPES else CLUSTERS["debug"].as_dict()


def plan_recipe(recipe: Optional[str], overrides: Sequence[str] = (), nodes: Optional[int] = None,
                gpus_per_node: Optional[int] = None, gpu: Optional[str] = None, mfu: Optional[float] = None) -> Plan:
    """Plan `recipe` (or the one --config FILE in `overrides` names) on its default cluster (default_cluster) with
    any of it overridden; mfu: an assumed MFU for the GPU hours instead of the step-time model's prediction."""
    args = resolve_args(recipe, overrides)
    c = default_cluster(args.recipe)
    return make_plan(args, recipe=args.recipe or "none", nodes=nodes or c["nodes"],
                     gpus_per_node=gpus_per_node or c["gpus_per_node"], gpu=gpu or c["gpu"], mfu=mfu)


def padded_vocab_size(vocab_size: int, args, tp: int) -> int:
    """The embedding rows the trainer builds: the vocabulary rounded up to make_vocab_size_divisible_by x TP (as
    Megatron-LM; the trainer's Loop does the same with its tokenizer's vocabulary)."""
    multiple = getattr(args, "make_vocab_size_divisible_by", 128) * tp
    return -(-vocab_size // multiple) * multiple


def make_plan(args, recipe: str, nodes: int, gpus_per_node: int, gpu: str, mfu: Optional[float] = None) -> Plan:
    """Validate and size the run described by trainer arguments `args` on nodes x gpus_per_node `gpu`s; GPU hours
    from the step-time model at the layout, or from `mfu` when one is given (module docstring)."""
    # torch and megatron-core (4 s) only when a plan is made: plan_layout, dry_run and submit_grid read this
    # module's tables before parsing their arguments, and --help and bad input must answer at once
    from megatron_sat.parallel.layout import validate
    from megatron_sat.training.setup import model_config, precision_and_layout

    on_gpu = gpu != "cpu"  # a GPU target has Transformer Engine (the trainer's default backend there)
    errors = argument_errors(args, None, inputs=False, gpu=on_gpu, te=on_gpu)  # the trainer's checks; the layout's below
    capacity = gpu_memory_gib(gpu)
    if gpu not in GPU_MEMORY_GIB and capacity is None:
        errors.append(f"unknown GPU {gpu!r}; known: {', '.join(known_gpus())}")
    try:
        cfg = model_config(args)  # the shape and arch switches; the layout is checked below, recompute counted
    except ValueError as e:
        raise ValueError(f"recipe {recipe}: {e}") from None
    world = nodes * gpus_per_node
    bf16, dist_opt, _, layout = precision_and_layout(args, gpu=gpu != "cpu")  # as the trainer decides on the target
    vocab = padded_vocab_size(args.vocab_size or 32000, args, layout.tp)
    dp = max(layout.dp(world), 1)
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    num_micro = gbs // (mbs * dp) if mbs > 0 else 0
    if args.lr_warmup_iters > args.train_iters:
        errors.append(f"warmup {args.lr_warmup_iters} steps exceeds train_iters {args.train_iters}")
    try:
        validate(layout, cfg, world, seq_length=args.seq_length, num_microbatches=num_micro or None,
                 backend="te" if gpu != "cpu" else "local", micro_batch_size=mbs, global_batch_size=gbs)
    except ValueError as e:
        errors.extend(str(e).splitlines()[1:] or [str(e)])
    errors = [e.strip() for e in errors]
    params = count_parameters(cfg, vocab, tp=layout.tp)["total"]
    flops = flops_per_token(cfg, args.seq_length, vocab, tp=layout.tp)
    plan = Plan(recipe=recipe, arch=args.arch, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu, tp=layout.tp,
                pp=layout.pp, vpp=layout.vpp, sp=layout.sp, dp=dp, micro_batch_size=mbs, global_batch_size=gbs,
                num_microbatches=num_micro, seq_length=args.seq_length, train_iters=args.train_iters,
                warmup_iters=args.lr_warmup_iters, lr=args.lr, parameters=params, flops_per_token=flops,
                recompute=args.recompute_granularity, capacity_gib=capacity, mfu=mfu, errors=errors,
                vocab_size=vocab)
    plan.fp8 = bool(bf16 and getattr(args, "fp8_format", None))
    if mfu is not None and gpu in PEAK_TFLOPS:
        plan.mfu_given = True
        plan.gpu_hours = flops * plan.tokens / (PEAK_TFLOPS[gpu] * 1e12 * mfu) / 3600
    elif gpu != "cpu" and not errors:
        predicted = predict_plan(plan, args)
        plan.step_time_s, plan.mfu = predicted.step_time_s, predicted.mfu
        plan.gpu_hours = predicted.step_time_s * plan.train_iters * plan.world_size / 3600
        err = step_time_error()
        plan.gpu_hours_band = (plan.gpu_hours * (1 - err), plan.gpu_hours * (1 + err))
    if not errors:
        plan.stages = stage_estimates(cfg, layout, dp=dp, micro_batch_size=mbs, num_microbatches=num_micro,
                                      seq_length=args.seq_length, vocab_size=vocab, bf16=bf16,
                                      distributed_optimizer=dist_opt, recompute=args.recompute_granularity,
                                      backend="te" if gpu != "cpu" else "local")
        plan.memory = max(plan.stages, key=lambda st: st["total"])["gib"]  # estimate_memory: the worst stage
        if plan.capacity_gib and plan.memory["total"] > USABLE_FRACTION * plan.capacity_gib:
            plan.errors.append(
                f"estimated {plan.memory['total']:.1f} GiB per GPU exceeds {100 * USABLE_FRACTION:.0f}% of the "
                f"{gpu}'s {plan.capacity_gib:.0f} GiB: lower --micro-batch-size, add --recompute-granularity "
                "selective/full, or raise TP/PP")
    return plan


def predict_plan(plan: Plan, args):
    """The step-time model's StepPrediction at the plan's layout, precision and overlap flags, as the trainer
    resolves `args` on a GPU (steptime.layout_from_args: the run's own overlaps, off unless it turns them on)."""
    from megatron_sat.model.args import model_args

    return steptime.predict_step(model_args(args), steptime.layout_from_args(args, plan.world_size), steptime.cluster(
        plan.gpu, nodes=plan.nodes, gpus_per_node=plan.gpus_per_node), seq_length=plan.seq_length,
        vocab_size=plan.vocab_size)


def _layer_params(cfg, layer: int, t: int) -> Tuple[float, float]:
    """(TP-sharded over all TP ranks, replicated on each) parameters of global layer `layer`, exactly as built
    (model/args.py's layer_parameters, which model/sizes.py sums too)."""
    parts = layer_parameters(cfg, layer, t)
    return parts["sharded"], sum(parts[p] for p in LAYER_PARTS) - parts["sharded"]


def _chunk_params(cfg) -> int:
    """Parameters every model chunk holds once (model/args.py's chunk_parameters: ResFormer's learned lambda1)."""
    return chunk_parameters(cfg)


def _connection_bytes(cfg, layer: int, *, s: int, b: int, t: int, sp_div: int, act: float, local: bool,
                      first_in_chunk: bool, recompute: Optional[str]) -> float:
    """Bytes global layer `layer` of a baseline keeps for backward beyond the block's, one micro-batch
    (module docstring, "connections")."""
    return archs.get(cfg.arch).connection_bytes(cfg, layer, s=s, b=b, t=t, sp_div=sp_div, act=act, local=local,
                                                first_in_chunk=first_in_chunk, recompute=recompute)


def estimate_memory(cfg, layout, *, dp: int, micro_batch_size: int, num_microbatches: int, seq_length: int,
                    vocab_size: int, bf16: bool = True, distributed_optimizer: bool = True,
                    recompute: Optional[str] = "selective", activation_bytes: Optional[int] = None,
                    backend: str = "te", memo: Optional[dict] = None) -> Dict[str, float]:
    """GiB per GPU on the worst pipeline stage, by part (see the module docstring for the formulas).

    activation_bytes: bytes per activation value (default 2 with bf16, else 4); backend: 'te' or 'local'
    (Megatron-Core's RMSNorm, which also keeps the normalised input of the baselines' extra norms); memo: see
    stage_estimates.
    """
    stages = stage_estimates(cfg, layout, dp=dp, micro_batch_size=micro_batch_size,
                             num_microbatches=num_microbatches, seq_length=seq_length, vocab_size=vocab_size, bf16=bf16,
                             distributed_optimizer=distributed_optimizer, recompute=recompute,
                             activation_bytes=activation_bytes, backend=backend, memo=memo)
    worst = max(stages, key=lambda st: st["total"])  # the first of equal ones, as before
    return worst["gib"]


def stage_estimates(cfg, layout, *, dp: int, micro_batch_size: int, num_microbatches: int, seq_length: int,
                    vocab_size: int, bf16: bool = True, distributed_optimizer: bool = True,
                    recompute: Optional[str] = "selective", activation_bytes: Optional[int] = None,
                    backend: str = "te", memo: Optional[dict] = None) -> List[dict]:
    """Every pipeline stage's plan (estimate_memory's arguments), what the dry run checks a built rank against:
    params (this rank's, exact), its weights/grads/optimizer bytes, per_micro_batch (bytes autograd saves in one
    micro-batch's forward over this rank's chunks: block, logits, connections and V1; no pipeline buffers),
    message ([s', b, channels] of every pipeline message), in_flight, total (bytes) and gib (estimate_memory's
    dict for this stage). memo: a dict shared by calls for the same cfg (the layout search's), keeping each
    stage's layer parameter counts for the next layout with the same layers and TP."""
    t, pp, vpp = layout.tp, layout.pp, layout.vpp
    memo = {} if memo is None else memo
    chunks = vpp or 1
    s, b, h = seq_length, micro_batch_size, cfg.hidden_size
    a, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    sp_div = t if layout.sp else 1
    if cfg.is_dense and recompute == "full":
        recompute = "selective"  # these archs refuse full recompute (their modules, megatron_sat/archs/: Arch.errors)
    emb = vocab_size * h / t
    # bytes per parameter: weights, fp32 grad buffer, optimizer (fp32 master + Adam m, v; no master in fp32)
    w_bytes, g_bytes, o_bytes = (2, 4, 12) if bf16 else (4, 4, 8)
    if distributed_optimizer:
        o_bytes = o_bytes / dp
    act = activation_bytes or (2 if bf16 else 4)
    sbh = s * b * h
    local = backend == "local"

    def norm(values: float, rows: float) -> float:  # what one RMSNorm over `values` (in `rows` rows) keeps
        # the local backend (torch's RMSNorm, CPU) keeps an fp32 copy of its input, the fp32 x * rsqrt and the fp32
        # 1/rms per row, whatever the precision (measured by the dry run); Transformer Engine: its input
        return 8 * values + 4 * rows if local else act * values

    attn = (norm(sbh / sp_div, s * b / sp_div) + act * sbh / sp_div + norm(s * b * (a + g) * d / t, s * b * (a + g) / t)
            + act * (s * b * (a + 2 * g) * d / t + s * b * a * d / t))
    if local:  # the QK-norm's input is a view of the kept QKV output; its rotary output is kept (measured; not
        # in SATFormer's fused layers, which split q, k, v out of the fused output and keep none of it)
        attn += act * s * b * (a + g) * d / t
    # SwiGLU: gate, up, silu, product; the local spec's glu also keeps (up + glu_linear_offset), a fifth
    swiglu = 5 if local else 4
    # what the attention kernel itself keeps without recompute. Flash attention keeps the fp32 softmax statistics
    # [b, a, s] besides q, k, v (counted above): the CPU's SDPA also a copy of its output (measured by the dry run);
    # Transformer Engine's flash and cuDNN fused paths (its choice for bf16/fp16) save their output, the projection's
    # input (counted above). TE in fp32 runs its unfused path, which keeps the 5as^2b scores of Korthikanti et al.
    if local:
        scores = act * s * b * a * d / t + 4 * s * b * a / t
    elif act == 2:
        scores = 4 * s * b * a / t
    else:
        scores = 2.5 * act * a * s * s * b / t  # 5as^2b at 2 bytes a value
    arch = archs.get(cfg.arch)
    extra = arch.activation_extra(cfg, s=s, b=b, t=t, act=act)
    fused = arch.fused_gate(cfg, t)

    def block(layer: int, with_scores: bool) -> float:  # one layer's saved bytes, the Transformer block's part
        mlp = norm(sbh / sp_div, s * b / sp_div) + act * (sbh / sp_div + swiglu * s * b * ffn_size(cfg, layer) / t)
        own = attn - (act * s * b * (a + g) * d / t if local and fused and layer in cfg.mixing_layers else 0.0)
        return own + mlp + extra + (scores if with_scores else 0.0)

    def connections(layer: int, first_in_chunk: bool, how: Optional[str]) -> float:
        return _connection_bytes(cfg, layer, s=s, b=b, t=t, sp_div=sp_div, act=act, local=backend == "local",
                                 first_in_chunk=first_in_chunk, recompute=how)

    full = recompute == "full"
    v1 = act * s * b * g * d / t if cfg.uses_value_residual else 0.0
    split = chunk_layers(cfg.num_layers, pp * chunks)
    wire = wire_channels(cfg, split) * act * s * b / sp_div  # one message's extra channels
    out = []
    m = max(num_microbatches, 1)
    last_stage_act = act * (2 * sbh / sp_div + s * b * vocab_size / t) + 4 * s * b * vocab_size / t
    if local:  # the final norm as above; the cross entropy keeps its fp32 logits, not the output layer's (measured)
        last_stage_act = norm(sbh / sp_div, s * b / sp_div) + act * sbh / sp_div + 4 * s * b * vocab_size / t
    message = (s // sp_div, b, h + wire_channels(cfg, split) + v1_wire_channels(cfg, t, layout.sp))
    for stage in range(pp):
        in_flight = 1 if pp == 1 else min(pp - stage, m)
        if vpp and stage == 0:
            in_flight = min(pp, m) * (1 + (pp - 1) / (pp * vpp))
        mine = [v * pp + stage for v in range(chunks)]  # this rank's chunks (global chunk index)
        layers = [i for c in mine for i in split[c]]
        params_key = ("layer_params", tuple(layers), t)
        if params_key not in memo:
            memo[params_key] = tuple(sum(x) for x in zip(*(_layer_params(cfg, i, t) for i in layers)))
        sharded, replicated = memo[params_key]
        params = sharded / t + replicated + chunks * _chunk_params(cfg)
        if stage == 0:
            params += emb
        if stage == pp - 1:
            params += h + (emb if pp > 1 else 0)  # final norm; the tied output layer's copy on the last stage
        if full:  # keep layer inputs; rebuild one layer at a time in backward
            kept = len(layers) * act * sbh / sp_div
            one_layer = max(block(i, True) for i in layers)
            one_conn = max(connections(i, i == layers[0], "selective") for i in layers)
        else:
            kept, one_layer, one_conn = sum(block(i, recompute != "selective") for i in layers), 0.0, 0.0
        activations = in_flight * kept + one_layer
        if stage == pp - 1:
            activations += last_stage_act
        conn = in_flight * sum(connections(i, i == split[c][0], recompute) for c in mine
                               for i in split[c]) + one_conn
        sends = sum(c < pp * chunks - 1 for c in mine)
        receives = sum(c > 0 for c in mine) if cfg.is_dense else 0  # Hyper-Connections: the first layer's H
        conn += in_flight * (sends + receives) * wire
        history = (max(layers) + 1) * act * sbh / sp_div if cfg.is_dense else 0.0  # gradients of X_0..X_e
        v1_bytes = (in_flight + 1) * v1 if v1 else 0.0
        parts = dict(weights=params * w_bytes, grads=params * g_bytes, optimizer=params * o_bytes,
                     activations=activations, v1=v1_bytes, connections=conn, history_grads=history)
        total = sum(parts.values())
        gib = {k: v / GIB for k, v in parts.items()}
        gib["overhead"] = OVERHEAD_GIB
        gib["total"] = sum(gib.values())
        gib["in_flight"] = round(in_flight, 2)
        # V1 is kept once per micro-batch (SATFormer: inside layer 1's QKV output on the stage that holds layer 1)
        v1_kept = 0.0 if arch.v1_kept_on_first_layer() and 1 in layers else v1
        per_micro = (kept + (last_stage_act if stage == pp - 1 else 0.0) + v1_kept
                     + sum(connections(i, i == split[c][0], recompute) for c in mine for i in split[c]))
        out.append(dict(stage=stage, params=params, total=total, gib=gib, in_flight=in_flight,
                        per_micro_batch=per_micro, message=message, **parts))
    return out
