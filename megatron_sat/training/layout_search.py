"""Layout search: every parallel layout of a run on a named cluster, the ones the memory plan refuses dropped, the
rest ranked by the step-time model's predicted step time.

    megatron-sat-plan-layout --recipe satformer_1.3B --search --cluster 4x8xH100
    megatron-sat-plan-layout --recipe satformer_1.3B --search --cluster 2x8xH100 --tensor-model-parallel-size 2 --json

    from megatron_sat.training.layout_search import search
    from megatron_sat.training.planner import resolve_args
    result = search(resolve_args("satformer_1.3B"), "4x8xH100")
    best = result.ranked[0]; print(best.describe(), best.prediction.step_time_s)

What is searched (every combination the layout checks accept, megatron_sat.parallel.layout.validate):
  TP            divisors of the world size dividing the attention and KV heads (across nodes too: the model
                prices an inter-node TP all-reduce on the network, so such a layout ranks where it belongs)
  PP, VPP       PP dividing the layers; VPP (interleaved 1F1B) 2.. while PP x VPP divides the layers and the
                micro-batch count is a multiple of PP
  CP            divisors with the sequence divisible by 2 x CP (GPUs only: Transformer Engine's attention)
  DP            what is left of the world size
  micro-batch   powers of two that divide the global batch / DP (up to MAX_MICRO_BATCH)
  SP            on or off where TP > 1
  recompute     none, selective, full (full not for DenseFormer / MUDDFormer, which refuse it); a layout whose
                lighter recompute fits is not predicted again with a heavier one (recompute only adds forward work:
                never faster), counted as dominated
  distributed optimizer   on or off where DP > 1
Held fixed: every one of these the user gives (on the command line or in a --config file), and the precision
(--bf16 / --fp16 / --fp8-format; bf16 on GPUs by default, as the trainer decides).
Memory: megatron_sat.training.planner.stage_estimates, the plan the dry run checks against real ranks, on its worst
stage, against USABLE_FRACTION of the GPU's memory; with CP each rank holds seq / CP tokens of every activation
(Transformer Engine's context parallelism runs flash or fused attention, which keeps no seq x seq scores).
Step time, MFU, tokens/s, bubble and exposed-communication shares: megatron_sat.steptime.predict_step.
"""

from dataclasses import dataclass, field, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from megatron_sat import steptime
from megatron_sat.training import planner
from megatron_sat.training.argument_checks import argument_errors
from megatron_sat.training.arguments import build_parser
from megatron_sat.training.config_file import explicit_dests, read_config

MAX_MICRO_BATCH = 16  # larger ones only lengthen the bubble once the GEMMs are large (NeMo's auto-configurator: <= 8)
# the trainer's dests the search varies: given by the user (command line or config file), each is held fixed
SEARCHED_DESTS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "num_virtual_stages_per_pipeline_rank", "context_parallel_size", "sequence_parallel",
                  "micro_batch_size", "recompute_granularity", "use_distributed_optimizer")
PRECISION_DESTS = ("bf16", "fp16", "fp8_format")


@dataclass(frozen=True)
class Candidate:
    """One layout of the search: the parallel sizes, the micro-batch and the memory-saving switches."""

    tp: int
    pp: int
    vpp: Optional[int]
    cp: int
    dp: int
    micro_batch_size: int
    sp: bool
    recompute: Optional[str]
    distributed_optimizer: bool

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"] + ([f"VPP{self.vpp}"] if self.vpp else [])
        parts += ([f"CP{self.cp}"] if self.cp > 1 else []) + [f"DP{self.dp}"]
        return ("x".join(parts) + ("+SP" if self.sp else "") + f" mbs{self.micro_batch_size}"
                + f" rc:{self.recompute or 'none'}" + (" distopt" if self.distributed_optimizer else ""))

    def flags(self) -> List[str]:
        """The trainer flags that run this layout."""
        out = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
               "--micro-batch-size", str(self.micro_batch_size)]
        if self.vpp:
            out += ["--num-virtual-stages-per-pipeline-rank", str(self.vpp)]
        if self.cp > 1:
            out += ["--context-parallel-size", str(self.cp)]
        if self.sp:
            out.append("--sequence-parallel")
        if self.recompute:
            out += ["--recompute-granularity", self.recompute]
        out.append("--use-distributed-optimizer" if self.distributed_optimizer else "--no-use-distributed-optimizer")
        return out


@dataclass
class Ranked:
    candidate: Candidate
    prediction: object  # steptime.StepPrediction
    memory: Dict[str, float]  # GiB per GPU on the worst stage, by part (planner.estimate_memory's dict)

    def as_dict(self) -> dict:
        p, c = self.prediction, self.candidate
        return dict(layout=c.describe(), tp=c.tp, pp=c.pp, vpp=c.vpp, cp=c.cp, dp=c.dp,
                    micro_batch_size=c.micro_batch_size, sequence_parallel=c.sp, recompute=c.recompute,
                    distributed_optimizer=c.distributed_optimizer, step_time_s=p.step_time_s,
                    tflops_per_gpu=p.tflops_per_gpu, mfu=p.mfu, tokens_per_s=p.tokens_per_s,
                    memory_gib=self.memory["total"], bubble_share=p.bubble_share,
                    exposed_comm_share=p.exposed_comm_share, flags=c.flags())


@dataclass
class SearchResult:
    cluster: object  # steptime.Cluster
    fixed: Dict[str, object]  # dest -> the user's value, held fixed
    precision: str
    ranked: List[Ranked] = field(default_factory=list)  # best (shortest step) first
    considered: int = 0  # layouts the checks accept
    refused_memory: int = 0  # of those, over the GPU's memory
    dominated: int = 0  # of those, a heavier recompute of a layout whose lighter one fits (not predicted)
    capacity_gib: Optional[float] = None
    layer_costs: int = 0  # layer cost evaluations (steptime's memo: once per layer and cost_key, not per layout)


def given_dests(overrides: Sequence[str]) -> Dict[str, object]:
    """{dest: value} of the layout and precision settings the user gave: on the command line or in the --config
    file among `overrides` (a recipe's values are its defaults, which the search may change)."""
    parser = build_parser()
    given = explicit_dests(parser, list(overrides))
    from_file = read_config(given["config"], parser) if given.get("config") else {}
    out = {k: v for k, v in from_file.items() if v is not None}
    out.update(given)
    return {k: v for k, v in out.items() if k in SEARCHED_DESTS + PRECISION_DESTS}


def precision_of(args, gpu: bool) -> str:
    """'fp8', 'bf16', 'fp16' or 'fp32', as the trainer decides on the target (setup.precision_and_layout)."""
    if getattr(args, "fp16", False):
        return "fp16"
    bf16 = gpu if args.bf16 is None else args.bf16
    if bf16 and getattr(args, "fp8_format", None):
        return "fp8"
    return "bf16" if bf16 else "fp32"


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model, *, world: int, seq_length: int, global_batch_size: int, gpu: bool,
               fixed: Optional[Dict[str, object]] = None) -> Iterator[Candidate]:
    """Every layout of `model` (ModelArgs) on `world` ranks that the layout checks accept, with `fixed`'s dests
    (given_dests) held at the user's values."""
    from megatron_sat.parallel.layout import Layout, validate  # torch and megatron-core: only when searching

    fixed = fixed or {}

    def choices(dest, default):
        return [fixed[dest]] if dest in fixed else default

    heads, groups, layers = model.num_attention_heads, model.num_query_groups, model.num_layers
    for tp in choices("tensor_model_parallel_size", [t for t in _divisors(world) if heads % t == 0 and groups % t == 0]):
        for pp in choices("pipeline_model_parallel_size", [p for p in _divisors(world // tp) if layers % p == 0]):
            for cp in choices("context_parallel_size",
                              [c for c in _divisors(world // (tp * pp)) if gpu and seq_length % (2 * c) == 0] or [1]):
                if world % (tp * pp * cp):
                    continue
                dp = world // (tp * pp * cp)
                if global_batch_size % dp:
                    continue
                per_dp = global_batch_size // dp
                mbs_all = [b for b in _divisors(per_dp) if b & (b - 1) == 0 and b <= MAX_MICRO_BATCH]
                for mbs in choices("micro_batch_size", mbs_all):
                    m = global_batch_size // (mbs * dp) if mbs * dp and global_batch_size % (mbs * dp) == 0 else 0
                    vpps = [None] + [v for v in range(2, layers // pp + 1) if pp > 1 and layers % (pp * v) == 0]
                    for vpp in choices("num_virtual_stages_per_pipeline_rank", vpps):
                        for sp in choices("sequence_parallel", [False, True] if tp > 1 else [False]):
                            full_ok = not model.is_dense
                            rcs = [None, "selective"] + (["full"] if full_ok else [])
                            for rc in choices("recompute_granularity", rcs):
                                for dist in choices("use_distributed_optimizer", [True, False] if dp > 1 else [gpu]):
                                    layout = Layout(tp=tp, pp=pp, vpp=vpp, cp=cp, sp=bool(sp))
                                    try:
                                        validate(layout, model, world, seq_length=seq_length,
                                                 num_microbatches=m or None, backend="te" if gpu else "local",
                                                 micro_batch_size=mbs, global_batch_size=global_batch_size)
                                    except ValueError:
                                        continue
                                    yield Candidate(tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, micro_batch_size=mbs,
                                                    sp=bool(sp), recompute=rc,
                                                    distributed_optimizer=bool(dist if dist is not None else gpu))


def _memory(cfg, c: Candidate, *, seq_length: int, vocab_size: int, global_batch_size: int, precision: str,
            gpu: bool, cache: dict) -> Dict[str, float]:
    """The planner's memory per GPU (worst stage) of candidate `c`; the distributed optimizer's saving is applied
    to the cached plan without it (it only divides the optimizer state by DP). With CP each rank keeps seq / CP
    tokens of every activation: the plan at seq / CP."""
    from megatron_sat.parallel.layout import Layout

    def plan(seq: int, recompute: Optional[str]) -> Dict[str, float]:
        key = (c.tp, c.pp, c.vpp, c.cp, c.sp, c.micro_batch_size, recompute, seq)
        if key not in cache:
            m = global_batch_size // (c.micro_batch_size * c.dp)
            cache[key] = planner.estimate_memory(
                cfg, Layout(tp=c.tp, pp=c.pp, vpp=c.vpp, cp=c.cp, sp=c.sp), dp=c.dp,
                micro_batch_size=c.micro_batch_size, num_microbatches=m, seq_length=seq, vocab_size=vocab_size,
                bf16=precision in ("bf16", "fp8", "fp16"), distributed_optimizer=False, recompute=recompute,
                backend="te" if gpu else "local", memo=cache)
        return cache[key]

    mem = dict(plan(seq_length // c.cp, c.recompute))
    if c.distributed_optimizer:
        saved = mem["optimizer"] * (1 - 1 / c.dp)
        mem["optimizer"] -= saved
        mem["total"] -= saved
    return mem


def step_layout(base, c: Candidate, precision: str):
    """The step-time model's Layout of candidate `c`: the run's own (steptime.layout_from_args: overlaps, gradient
    reduction dtype) with the candidate's sizes and switches."""
    return replace(base, tp=c.tp, pp=c.pp, vpp=c.vpp, dp=c.dp, cp=c.cp, micro_batch_size=c.micro_batch_size,
                   sequence_parallel=c.sp, recompute=c.recompute, distributed_optimizer=c.distributed_optimizer,
                   precision=precision)


def search(args, cluster_spec, overrides: Sequence[str] = (), top: Optional[int] = None) -> SearchResult:
    """Rank every layout of the run `args` (trainer arguments, planner.resolve_args) on `cluster_spec` (a
    steptime.Cluster or a name such as '4x8xH100'); the layout dests given in `overrides` (given_dests) are held
    fixed. ValueError for a bad cluster or a model the config refuses."""
    from megatron_sat.model.args import model_args
    from megatron_sat.training.setup import model_config  # torch and megatron-core (see planner.make_plan)

    problems = argument_errors(args, None, inputs=False, gpu=True, te=True)  # the trainer's checks, as the planner's
    if problems:
        raise ValueError("; ".join(problems))
    cl = steptime.cluster(cluster_spec) if isinstance(cluster_spec, str) else cluster_spec
    world = cl.nodes * cl.gpus_per_node
    gpu = True  # the step-time model describes GPUs (and a measured CPU: steptime's own hardware, same search)
    fixed = given_dests(overrides)
    precision = precision_of(args, gpu)
    model = model_args(args)
    cfg = model_config(args)
    gbs, seq = args.global_batch_size, args.seq_length
    capacity = planner.gpu_memory_gib(cl.gpu.name) or getattr(cl.gpu, "memory_gib", None)
    result = SearchResult(cluster=cl, fixed=fixed, precision=precision, capacity_gib=capacity)
    cache: dict = {}
    base = steptime.layout_from_args(args, world)
    vocab_cache: Dict[int, int] = {}
    fits: set = set()  # layouts (less recompute) with a recompute that fits: heavier ones are dominated
    memo: dict = {}  # steptime.predict_step's: layer, chunk, parameter and schedule results shared by the layouts
    for c in candidates(model, world=world, seq_length=seq, global_batch_size=gbs, gpu=gpu, fixed=fixed):
        result.considered += 1
        shape = (c.tp, c.pp, c.vpp, c.cp, c.micro_batch_size, c.sp, c.distributed_optimizer)
        if shape in fits:
            result.dominated += 1
            continue
        if c.tp not in vocab_cache:
            vocab_cache[c.tp] = planner.padded_vocab_size(args.vocab_size or 32000, args, c.tp)
        vocab = vocab_cache[c.tp]
        mem = _memory(cfg, c, seq_length=seq, vocab_size=vocab, global_batch_size=gbs, precision=precision, gpu=gpu,
                      cache=cache)
        if capacity and mem["total"] > planner.USABLE_FRACTION * capacity:
            result.refused_memory += 1
            continue
        fits.add(shape)
        pred = steptime.predict_step(model, step_layout(base, c, precision), cl, seq_length=seq, vocab_size=vocab,
                                     memo=memo)
        result.ranked.append(Ranked(c, pred, mem))
    result.layer_costs = sum(1 for k in memo if k[0] == "layer")
    result.ranked.sort(key=lambda r: (r.prediction.step_time_s, r.memory["total"]))
    if top:
        result.ranked = result.ranked[:top]
    return result


def why_best(result: SearchResult) -> List[str]:
    """Lines saying why the best layout wins: against the best layout of each other TP x PP x CP shape (what
    costs it more: bubble, exposed communication or compute)."""
    if not result.ranked:
        return []
    best = result.ranked[0]
    b = best.prediction
    out = []
    seen: Dict[Tuple, Ranked] = {}
    for r in result.ranked[1:]:
        shape = (r.candidate.tp, r.candidate.pp, r.candidate.cp)
        if shape != (best.candidate.tp, best.candidate.pp, best.candidate.cp) and shape not in seen:
            seen[shape] = r
    for r in sorted(seen.values(), key=lambda r: r.prediction.step_time_s)[:3]:
        p = r.prediction
        bubble = (p.bubble_share - b.bubble_share) * p.step_time_s
        comm = (p.exposed_comm_share - b.exposed_comm_share) * p.step_time_s
        compute = p.step_time_s - b.step_time_s - bubble - comm
        parts = sorted([(bubble, "pipeline bubble"), (comm, "exposed communication"), (compute, "compute")],
                       reverse=True)
        reason = ", ".join(f"{what} {d * 1e3:+.0f} ms" for d, what in parts if abs(d) >= 0.0005) or "equal parts"
        out.append(f"  vs {r.candidate.describe()}: {p.step_time_s / b.step_time_s:.2f}x the step time "
                   f"({reason})")
    return out


def format_result(result: SearchResult, top: int = 5) -> str:
    """The search as text: what was searched and held, the best `top` layouts as a table, why the best wins."""
    fixed = ", ".join(f"{k}={v}" for k, v in result.fixed.items()) or "nothing"
    lines = [f"cluster {result.cluster} ({result.cluster.nodes * result.cluster.gpus_per_node} GPUs), "
             f"{result.precision}; held fixed: {fixed}",
             f"{result.considered} layouts pass the layout checks, {result.refused_memory} refused by the memory "
             f"plan (over {100 * planner.USABLE_FRACTION:.0f}% of {result.capacity_gib or '?'} GiB), "
             f"{result.dominated} dominated (a lighter recompute of the same layout fits), {len(result.ranked)} "
             "ranked by predicted step time"]
    if not result.ranked:
        lines.append("no layout fits: raise the GPU count, lower the global batch or free a fixed flag")
        return "\n".join(lines)
    head = ["#", "layout", "step s", "TFLOP/s/GPU", "MFU", "tokens/s", "mem GiB", "bubble", "exposed comm"]
    rows = []
    for i, r in enumerate(result.ranked[:top], 1):
        p = r.prediction
        rows.append([str(i), r.candidate.describe(), f"{p.step_time_s:.3f}", f"{p.tflops_per_gpu:.0f}",
                     f"{100 * p.mfu:.1f}%", f"{p.tokens_per_s:,.0f}", f"{r.memory['total']:.1f}",
                     f"{100 * p.bubble_share:.1f}%", f"{100 * p.exposed_comm_share:.1f}%"])
    widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in [head] + rows]
    best = result.ranked[0]
    lines.append(f"best: {best.candidate.describe()}  (flags: {' '.join(best.candidate.flags())})")
    lines += why_best(result)
    return "\n".join(lines)
