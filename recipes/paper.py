"""The paper's scaling grid as named recipes: `{arch}_{scale}` for arch in transformer / resformer / satformer and
the baselines denseformer / muddformer / hyperconnections, and scale in 130M / 340M / 760M / 1.3B (24 recipes), e.g.

    python -m megatron_sat.train --recipe satformer_760M --data-path DATA --tokenizer-model TOK  # flags override
    python tools/plan_layout.py --recipe satformer_1.3B --nodes 2 --micro-batch-size 2            # check a layout
    python tools/submit_grid.py --archs satformer,resformer --scales 760M --seeds 1,2 --dry-run    # Slurm

Everything comes from the authors' configs (arXiv 2605.03953 and their code) through two tables:
    megatron_sat.model.sizes.PAPER_SCALES   model shapes (d_model, layers, heads, KV heads, FFN)
    SCHEDULES below                          peak lr, warmup tokens and token budget per scale
and one shared base (recipes.base: AdamW 0.9/0.95, wd 0.1, clip 1.0, linear warmup + cosine to 0.1 x lr).
Context 4096, global batch 512 sequences = 2,097,152 tokens per step (the paper's "about 2M"), so
    train_iters    = ceil(tokens / (512 x 4096))        e.g. 5B -> 2385, 30B -> 14306
    lr_warmup_iters = round(warmup tokens / (512 x 4096)) e.g. 0.05B -> 24, 0.3B -> 143
A departure from the authors' counts, kept on purpose: their train.py takes int() (floor) of both, so every scale
trains one step fewer there (2384, 4768, 9536, 14305) and warms up one step fewer at 130M and 340M (23, 47; 760M
and 1.3B agree: 95, 143). The totals round up so that a run sees at least its token budget, and the step count is
part of every run-folder name (..._it2385_...): floor would rename every paper run, so that a requeued or resumed
grid no longer finds its folders, and a changed warmup would make every resume refuse the schedule. To train the
authors' exact counts, pass authors_counts(scale) as flags, e.g. `--train-iters 2384 --lr-warmup-iters 23` at 130M
(another run name: the flags are hashed into it).

The authors' config defects, fixed here (and in PAPER_SCALES):
  1. SATFormer xl says 24 heads with d_model 2048 (head dim 85.33: the QKV reshape fails). Fixed: 32 heads of
     64, as their Transformer and ResFormer xl files (so all archs have identical shapes).
  2. Transformer medium uses 4 KV heads while every other config is multi-head. Fixed: 16 KV heads (MHA), so
     that archs at one scale differ only in the arch (the value residual or the baselines' connections). The
     authors' literal Transformer medium is `--recipe transformer_340M --num-query-groups 4`.
  3. Transformer xl trains with 1024 sequences per step (batch 1 x accumulation 128 x 8 GPUs: 4.19M tokens, 7152
     steps) while every other config uses 512. Kept uniform here: 512 x 4096 tokens, 14306 steps.
  4. SATFormer xl has intermediate_size 5504 (with its 24 heads) where Transformer and ResFormer xl have 5632.
     Kept uniform here: 5632 for every arch.
  Kept as published (not a defect, an arch-specific choice): Transformer xl peak lr 5e-4 (others 8e-4).

Trained the way the authors trained (their train.py and models), each one flag away from Megatron's behaviour:
  weight_decay_params="all"     their AdamW(model.parameters(), weight_decay=0.1) decays every tensor (norms,
                                QK-norms, lambdas, connection weights); Megatron skips 1-D tensors and biases
  output_layer_init="unscaled"  attention-output and MLP-down projections N(0, 0.02) (their
                                rescale_prenorm_residual=False); Megatron scales them by 1/sqrt(2L)
  validation                    0.5% of the corpus held out (split 99.5,0.5,0), evaluated every 500 steps over
                                EVAL_SAMPLES sequences: 100 eval iterations x their per-GPU batch_size (64, 32,
                                16, 8 for small, medium, large, xl) = 6400 / 3200 / 1600 / 800; the trainer rounds
                                up to a whole number of micro-batches per rank (1.3B at 4 x 32: 896), the same
                                for every arch of a scale
Kept on purpose, unlike the authors: fp32 master weights and fp32 gradient reduction (they train pure bf16,
weights and Adam state included, where small updates to weights near 1.0 round away), and Megatron's warmup
convention (step k uses lr x (k - 1) / warmup: a one-step shift against theirs).

The baselines (megatron_sat/model/{denseformer,muddformer,hyperconnections}.py) take the same shapes, schedule
and layout as the other archs at each scale (a smaller micro-batch where memory needs it: ARCH_LAYOUTS), plus their
own switches as in the authors' configs (ARCH_OPTIONS):
  denseformer        depth-weighted average after every block, dilation 1, period 1 (the only setting built;
                     no flag)
  muddformer         4 ways (Q, K, V, R), param_realloc (FFN 0.5x -> 1.5x over depth), pre/post depth-aggregate
                     norms (ways and norms are fixed in the model; --no-muddformer-param-realloc turns realloc off)
  hyperconnections   expansion rate 4, dynamic, tanh (--hc-expansion-rate, --hc-static; tanh is fixed)
The authors have no xl (1.3B) config for these three baselines. Their 1.3B recipes exist anyway, for a uniform
grid: the xl shape above and the xl lr 8e-4 of the authors' non-Transformer archs (their Transformer alone uses
5e-4); they are this project's choice, not a published configuration.
Limits: no FP8 for the baselines, DenseFormer / MUDDFormer refuse full activation recompute (every recipe here
uses selective). All six archs convert to and from Hugging Face (tools/convert_to_hf.py) in the authors' formats.

Cluster layout: every recipe has a default `CLUSTERS[scale]` (nodes, GPUs per node, GPU kind, a time limit per
job) next to its TP/PP/micro-batch settings (trainer flags in the recipe itself). The layouts were checked with
megatron_sat.training.planner (memory estimate per H100 80 GB, the baselines' extra activations included; those
formulas match the bytes autograd saves on CPU, not yet measured on a GPU). Where a baseline does not fit the
scale's layout, ARCH_LAYOUTS gives it a smaller micro-batch with the same global batch (more accumulation, same
tokens per step): Hyper-Connections at 1.3B runs micro-batch 2. Command-line flags override both:
trainer flags (--tensor-model-parallel-size, --micro-batch-size, ...) and --nodes / --gpus-per-node / --gpu in tools/.
"""

import math
from dataclasses import asdict, dataclass
from functools import partial
from typing import Optional

from megatron_sat.archs import ARCHS  # every arch has a recipe at every scale
from megatron_sat.model.sizes import PAPER_SCALES, PAPER_SEQ_LENGTH, PAPER_VOCAB
from recipes import RECIPES, base, register

# the baselines' switches, as in the authors' configs (trainer argument dests; equal to the defaults, set here
# so that a recipe states what it runs)
ARCH_OPTIONS = {
    "muddformer": dict(muddformer_param_realloc=True),
    "hyperconnections": dict(hc_expansion_rate=4, hc_dynamic=True),
}
SCALES = tuple(PAPER_SCALES)  # ("130M", "340M", "760M", "1.3B")
EVAL_SAMPLES = {"130M": 6400, "340M": 3200, "760M": 1600, "1.3B": 800}  # 100 x the authors' per-GPU batch
GLOBAL_BATCH = 512  # sequences per step: 512 x 4096 = 2,097,152 tokens
SEQ_LENGTH = PAPER_SEQ_LENGTH


@dataclass(frozen=True)
class Schedule:
    lr: float  # peak; min lr = 0.1 x lr
    warmup_tokens: float
    tokens: float
    arch_lr: tuple = ()  # ((arch, lr), ...) where an arch's published lr differs


SCHEDULES = {
    "130M": Schedule(lr=2e-3, warmup_tokens=0.05e9, tokens=5e9),
    "340M": Schedule(lr=1.5e-3, warmup_tokens=0.1e9, tokens=10e9),
    "760M": Schedule(lr=1e-3, warmup_tokens=0.2e9, tokens=20e9),
    "1.3B": Schedule(lr=8e-4, warmup_tokens=0.3e9, tokens=30e9, arch_lr=(("transformer", 5e-4),)),
}


@dataclass(frozen=True)
class Cluster:
    """Where a recipe runs by default. gpus_per_node = processes per node (one task per GPU; CPU: processes)."""

    nodes: int
    gpus_per_node: int
    gpu: str  # H100 / H200 / A100 / cpu (planner.GPU_MEMORY_GIB)
    time: str  # Slurm --time of one job (the run requeues itself or is chained beyond it)

    def as_dict(self) -> dict:
        return asdict(self)


# Default layouts per scale (TP/PP/micro-batch are in the recipe; see LAYOUTS). All TP1 x PP1: at <= 1.3B a
# whole replica fits one 80 GB GPU with selective recompute, so pure data parallelism with the distributed
# optimizer is the fastest layout; nodes are chosen for wall time (about 4-8 hours per run).
CLUSTERS = {
    "130M": Cluster(nodes=1, gpus_per_node=8, gpu="H100", time="12:00:00"),
    "340M": Cluster(nodes=1, gpus_per_node=8, gpu="H100", time="24:00:00"),
    "760M": Cluster(nodes=2, gpus_per_node=8, gpu="H100", time="24:00:00"),
    "1.3B": Cluster(nodes=4, gpus_per_node=8, gpu="H100", time="24:00:00"),
    "debug": Cluster(nodes=1, gpus_per_node=2, gpu="cpu", time="00:10:00"),
}
LAYOUTS = {  # trainer flags: TP, PP, micro-batch (global batch 512 -> gradient accumulation = 512 / (mbs x DP))
    "130M": dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, micro_batch_size=8),
    "340M": dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, micro_batch_size=8),
    "760M": dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, micro_batch_size=4),
    "1.3B": dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, micro_batch_size=4),
}
# Per-arch exceptions to LAYOUTS: baselines whose planned memory (their connections included) exceeds 90% of an
# H100 at the scale's micro-batch. Same global batch, so the same tokens per step and run name.
ARCH_LAYOUTS = {
    ("hyperconnections", "1.3B"): dict(micro_batch_size=2),  # planned 84.2 GiB at micro-batch 4, 47.4 at 2
}


def steps(tokens: float, global_batch: int = GLOBAL_BATCH, seq_length: int = SEQ_LENGTH) -> int:
    """Optimizer steps that cover `tokens` (rounded up: the run sees at least its budget)."""
    return math.ceil(tokens / (global_batch * seq_length))


def authors_counts(scale: str) -> dict:
    """The SATFormer authors' step counts at `scale`: int() (floor) of the tokens over the tokens per step, as their
    train.py computes them (the recipes round up the total and round the warmup; module docstring)."""
    sched = SCHEDULES[scale]
    per_step = GLOBAL_BATCH * SEQ_LENGTH
    return dict(train_iters=int(sched.tokens / per_step), lr_warmup_iters=int(sched.warmup_tokens / per_step))


def paper(arch: str, scale: str) -> dict:
    """The trainer arguments of `arch` at `scale` (the body of every grid recipe)."""
    if arch not in ARCHS:
        raise ValueError(f"no paper recipe for arch {arch!r}; implemented: {', '.join(ARCHS)}")
    sched = SCHEDULES[scale]
    lr = dict(sched.arch_lr).get(arch, sched.lr)
    tokens_per_step = GLOBAL_BATCH * SEQ_LENGTH
    out = base(lr=lr)
    layout = dict(LAYOUTS[scale], **ARCH_LAYOUTS.get((arch, scale), {}))
    out.update(arch=arch, **ARCH_OPTIONS.get(arch, {}), **PAPER_SCALES[scale], **layout,
               seq_length=SEQ_LENGTH, global_batch_size=GLOBAL_BATCH, vocab_size=PAPER_VOCAB,
               train_iters=steps(sched.tokens), lr_warmup_iters=round(sched.warmup_tokens / tokens_per_step),
               rotary_base=10000, recompute_granularity="selective",
               log_interval=10, eval_interval=500, eval_samples=EVAL_SAMPLES[scale], split="99.5,0.5,0",
               weight_decay_params="all", output_layer_init="unscaled", save_interval=250,
               # keep every 2500th checkpoint and the newest (a 1.3B run, ~18 GB a checkpoint: 7 of 57 kept,
               # ~130 GB instead of ~1 TB)
               save_retain_interval=2500)
    return out


def recipe_name(arch: str, scale: str) -> str:
    """Grid entry -> recipe name: ('satformer', '760M') -> 'satformer_760M'; scale 'debug' -> 'debug_satformer'."""
    return f"debug_{arch}" if scale == "debug" else f"{arch}_{scale}"


def scale_of(name: str) -> Optional[str]:
    """The scale a recipe name belongs to ('debug' for the debug recipes, None for others like 'demo')."""
    if name.startswith("debug_"):
        return "debug"
    for scale in SCALES:
        if name.endswith("_" + scale):
            return scale
    return None


def cluster(name: str) -> dict:
    """Default cluster layout of recipe `name`: nodes, gpus_per_node, gpu, time."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(sorted(RECIPES))}")
    return CLUSTERS.get(scale_of(name) or "debug").as_dict()


# One recipe per grid entry: transformer_130M ... hyperconnections_1.3B (the baselines' 1.3B: the xl shape and lr,
# for a uniform grid; the authors have no xl config for them)
for _arch in ARCHS:
    for _scale in SCALES:
        register(recipe_name(_arch, _scale))(partial(paper, _arch, _scale))

GRID = [recipe_name(a, s) for s in SCALES for a in ARCHS]
