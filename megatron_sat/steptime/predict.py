"""One training step's time for a model, a parallel layout and a cluster: predict_step.

    from megatron_sat.model.args import ModelArgs
    from megatron_sat.steptime import Layout, cluster, predict_step
    model = ModelArgs(arch="satformer", num_layers=24, hidden_size=2048, num_attention_heads=32, ffn_hidden_size=5632)
    p = predict_step(model, Layout(tp=1, pp=1, dp=8, micro_batch_size=2, global_batch_size=512), cluster("1x8xH100"),
                     seq_length=4096, vocab_size=32000)
    print(p.format())

The step: every pipeline stage's chunks cost their layers' forward and backward passes (layer_costs.py: operators
on the roofline, exposed TP/CP communication, recompute); the pipeline schedule is simulated (schedule.py) with the
real number of micro-batches, messages of [s / CP (/ TP with SP), b, h + the arch's extra channels] between
stages; then each stage's data-parallel gradient reduce-scatter (all-reduce without the distributed optimizer) over
DP x CP ranks, hidden behind its last backward passes when overlap_grad_reduce is on (never below one bucket of
max(40M, 1M x DP) parameters, Megatron's default); the optimizer step on the stage's share; the parameter
all-gather, hidden behind the next step's first forward passes when overlap_param_gather is on; and the
calibrated fixed overhead per step. The slowest stage sets the step time.

Throughput is in model FLOPs: megatron_sat.model.flops.flops_per_token (3 x the forward, full s x s attention, no
recompute), the same definition the project's profiler and trainer log as MFU, against the GPU's dense bf16 peak
(also for FP8, as the published tables do).
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import megatron_sat.steptime.collectives as collectives
from megatron_sat.model.args import LAYER_PARTS, layer_parameters
from megatron_sat.model.flops import flops_per_token
from megatron_sat.model.wire import chunk_layers, v1_wire_channels, wire_channels
from megatron_sat.steptime.hardware import Cluster
from megatron_sat.steptime.hardware import cluster as make_cluster
from megatron_sat.steptime.layer_costs import stage_costs
from megatron_sat.steptime.roofline import memory_time
from megatron_sat.steptime.schedule import ScheduleResult, simulate

RECOMPUTE = (None, "selective", "full")
PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
OPTIMIZER_BYTES = 34  # per parameter a rank updates: Adam reads grad, fp32 param, m, v (16), writes param, m, v and
#                       the bf16 copy (14), and the gradient norm reads the grad (4)


@dataclass(frozen=True)
class Layout:
    """A parallel layout and the schedule flags, as Megatron-Core takes them. global_batch_size None:
    micro_batch_size x dp (one micro-batch per step)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None
    sequence_parallel: bool = False
    recompute: Optional[str] = None  # None | 'selective' | 'full'
    distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_comm_overlap: bool = False
    precision: str = "bf16"  # 'bf16' | 'fp16' | 'fp8' | 'fp32'
    grad_reduce_in_fp32: bool = True  # the trainer's default; Megatron-LM's is bf16 (--accumulate-allreduce-grads-in-fp32 off)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def num_microbatches(self) -> int:
        gbs = self.global_batch_size or self.micro_batch_size * self.dp
        return gbs // (self.micro_batch_size * self.dp)

    def errors(self, num_layers: int) -> List[str]:
        """What makes this layout impossible for the step-time model (one line each)."""
        out = []
        if self.recompute not in RECOMPUTE:
            out.append(f"recompute {self.recompute!r}: use None, 'selective' or 'full'")
        if self.precision not in PRECISIONS:
            out.append(f"precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        gbs = self.global_batch_size or self.micro_batch_size * self.dp
        if gbs % (self.micro_batch_size * self.dp):
            out.append(f"global batch {gbs} is not a multiple of micro-batch {self.micro_batch_size} x DP {self.dp}")
        chunks = self.pp * (self.vpp or 1)
        if num_layers < chunks:
            out.append(f"{num_layers} layers cannot fill {chunks} pipeline chunks")
        if self.vpp and self.vpp > 1 and self.num_microbatches % self.pp:
            out.append(f"interleaving needs micro-batches ({self.num_microbatches}) a multiple of PP ({self.pp})")
        return out

    def __str__(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"] + ([f"VPP{self.vpp}"] if self.vpp else [])
        parts += ([f"CP{self.cp}"] if self.cp > 1 else []) + [f"DP{self.dp}"]
        flags = ("+SP" if self.sequence_parallel else "") + (f"+rc:{self.recompute}" if self.recompute else "")
        return "x".join(parts) + f" mbs{self.micro_batch_size}" + flags


@dataclass
class StepPrediction:
    """One step, predicted. breakdown: seconds of the busiest pipeline stage by name, summing to step_time_s:
    compute groups (gemm, attention, elementwise, logits, cross_entropy, recompute, and the arch operators by name,
    arch_ops.py) over all its micro-batches, tp_comm and cp_comm (exposed), pipeline_bubble (idle time and
    messages), dp_grad_reduce and dp_param_gather (exposed), optimizer, step_overhead."""

    step_time_s: float
    tflops_per_gpu: float
    mfu: float
    tokens_per_s: float
    bubble_share: float
    exposed_comm_share: float
    breakdown: Dict[str, float] = field(default_factory=dict)
    num_microbatches: int = 1
    critical_stage: int = 0
    schedule: Optional[ScheduleResult] = None
    layout: Optional[Layout] = None
    cluster: Optional[Cluster] = None

    def format(self) -> str:
        top = sorted(self.breakdown.items(), key=lambda kv: -kv[1])
        parts = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in top if v > 0)
        return (f"{self.layout} on {self.cluster}: step {self.step_time_s:.3f} s, {self.tflops_per_gpu:.0f} TFLOP/s "
                f"per GPU (MFU {100 * self.mfu:.1f}%), {self.tokens_per_s:,.0f} tokens/s, bubble "
                f"{100 * self.bubble_share:.1f}%, exposed communication {100 * self.exposed_comm_share:.1f}%\n"
                f"  ms: {parts}")


def layout_from_args(args, world_size: int) -> Layout:
    """The Layout of parsed trainer arguments (a recipe's, a config file's or the command line's) on `world_size`
    GPUs, as the trainer resolves them on a GPU: the distributed optimizer unless --no-use-distributed-optimizer,
    bf16 unless --fp8-format (FP8) or fp32 was asked for."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = getattr(args, "context_parallel_size", None) or 1
    dist_opt = getattr(args, "use_distributed_optimizer", None)
    precision = "fp8" if getattr(args, "fp8_format", None) else "fp16" if getattr(args, "fp16", False) else "bf16"
    if getattr(args, "bf16", None) is False and precision == "bf16":
        precision = "fp32"
    return Layout(tp=tp, pp=pp, vpp=getattr(args, "num_virtual_stages_per_pipeline_rank", None), cp=cp,
                  dp=max(world_size // (tp * pp * cp), 1), micro_batch_size=args.micro_batch_size,
                  global_batch_size=args.global_batch_size, sequence_parallel=bool(getattr(args, "sequence_parallel", 0)),
                  recompute=getattr(args, "recompute_granularity", None),
                  distributed_optimizer=True if dist_opt is None else bool(dist_opt),
                  overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
                  overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
                  tp_comm_overlap=bool(getattr(args, "tp_comm_overlap", False)), precision=precision,
                  grad_reduce_in_fp32=not getattr(args, "grad_reduce_in_bf16", False))


def stage_parameters(model, layers, tp: int, *, first: bool, last: bool, vocab_size: int,
                     tied_embeddings: bool) -> float:
    """Parameters one rank of a stage holds: its layers' (model/args.py's layer_parameters, sharded / TP), the
    embedding / TP on the first stage, the final norm and the output layer / TP (untied, or tied with PP > 1: its
    copy) on the last."""
    total = 0.0
    for layer in layers:
        parts = layer_parameters(model, layer, tp)
        total += parts["sharded"] / tp + sum(parts[p] for p in LAYER_PARTS) - parts["sharded"]
    emb = vocab_size * model.hidden_size / tp
    if first:
        total += emb
    if last:
        total += model.hidden_size + (emb if (not tied_embeddings or not first) else 0.0)
    return total


def predict_step(model_args, layout: Layout, cluster, *, seq_length: int, vocab_size: int,
                 tied_embeddings: bool = True, memo: Optional[dict] = None) -> StepPrediction:
    """Predict one training step of `model_args` (a ModelArgs) under `layout` on `cluster` (a Cluster or a spec
    such as "4x8xH100"). ValueError when the layout does not fit the cluster or the model.

    memo: a dict shared by calls for the same model_args and cluster (the layout search passes one per search):
    the layers', chunks', stages' parameter counts and pipeline schedules computed for one layout are reused by
    the next that shares them; the prediction is the same as without it."""
    c = make_cluster(cluster)
    errors = layout.errors(model_args.num_layers)
    t = layout.tp
    if model_args.num_attention_heads % t or model_args.num_query_groups % t:
        errors.append(f"TP {t} does not divide the {model_args.num_attention_heads} heads and "
                      f"{model_args.num_query_groups} KV groups")
    if seq_length % (layout.cp * (t if layout.sequence_parallel else 1)):
        errors.append(f"sequence {seq_length} does not split over CP {layout.cp}"
                      + (f" x TP {t} (sequence parallelism)" if layout.sequence_parallel else ""))
    if layout.world_size != c.world_size:
        errors.append(f"layout {layout} uses {layout.world_size} GPUs, the cluster {c} has {c.world_size}")
    if errors:
        raise ValueError("; ".join(errors))
    hw, pp, chunks, m = c.gpu, layout.pp, layout.vpp or 1, layout.num_microbatches
    split = chunk_layers(model_args.num_layers, pp * chunks)
    memo = {} if memo is None else memo
    fwd, bwd = stage_costs(model_args, layout, c, seq_length, vocab_size, split, memo)

    # pipeline messages: stage r sends to stage r + 1 (the last to the first, interleaved), ranks tp cp dp apart
    a = 2 if layout.precision in ("bf16", "fp16", "fp8") else 4
    rows = seq_length // layout.cp // (layout.tp if layout.sequence_parallel else 1)
    channels = model_args.hidden_size + wire_channels(model_args, split) + v1_wire_channels(
        model_args, layout.tp, layout.sequence_parallel)
    message = rows * layout.micro_batch_size * channels * a
    stride = layout.tp * layout.cp * layout.dp
    p2p = [collectives.send(c, message, (r * stride) // c.gpus_per_node != (((r + 1) % pp) * stride) // c.gpus_per_node)
           for r in range(pp)]
    f_times = tuple(tuple(x.total for x in row) for row in fwd)
    b_times = tuple(tuple(x.total for x in row) for row in bwd)
    sched_key = ("schedule", f_times, b_times, m, tuple(p2p) if pp > 1 else None)
    if sched_key not in memo:
        memo[sched_key] = simulate(f_times, b_times, m, p2p_per_stage=p2p if pp > 1 else None)
    sched = memo[sched_key]

    # data parallelism and the optimizer, per stage
    dp_group = layout.dp * layout.cp
    bucket = max(40e6, 1e6 * layout.dp)
    tail = []
    per_stage = []
    for r in range(pp):
        layers = [i for v in range(chunks) for i in split[v * pp + r]]
        params_key = ("parameters", tuple(layers), layout.tp, r == 0, r == pp - 1, vocab_size, tied_embeddings)
        if params_key not in memo:
            memo[params_key] = stage_parameters(model_args, layers, layout.tp, first=r == 0, last=r == pp - 1,
                                                vocab_size=vocab_size, tied_embeddings=tied_embeddings)
        params = memo[params_key]
        grad_bytes = params * (4 if layout.grad_reduce_in_fp32 or a == 4 else 2)
        frac = min(1.0, bucket / params) if params else 1.0
        if layout.distributed_optimizer:
            reduce = collectives.reduce_scatter(c, grad_bytes, dp_group, layout.tp)
            gather = collectives.all_gather(c, params * a, dp_group, layout.tp)
            owned = params / dp_group
        else:
            reduce, gather, owned = collectives.all_reduce(c, grad_bytes, dp_group, layout.tp), 0.0, params
        if layout.overlap_grad_reduce and dp_group > 1:
            reduce = max(reduce - chunks * sched.last_backward[r], frac * reduce)
        if layout.overlap_param_gather and layout.distributed_optimizer and dp_group > 1:
            gather = max(gather - chunks * sched.first_forward[r], frac * gather)
        opt = memory_time(hw, owned * OPTIMIZER_BYTES + params * 4, count=8)
        per_stage.append((reduce, opt, gather))
        tail.append(sched.finish[r] + reduce + opt + gather)
    # the breakdown is the busiest stage's: its compute, communication and optimizer, and as pipeline_bubble the rest
    # of the step (its idle time in the schedule, messages, and waiting for slower stages' tails)
    crit = max(range(pp), key=lambda r: sched.busy[r])
    overhead = hw.cal("step_overhead_s")
    step = max(tail) + overhead

    breakdown: Dict[str, float] = {}
    tp_comm = cp_comm = 0.0
    for v in range(chunks):
        for cost in (fwd[crit][v], bwd[crit][v]):
            for k, s in cost.compute.items():
                breakdown[k] = breakdown.get(k, 0.0) + m * s
            tp_comm += m * cost.tp_comm
            cp_comm += m * cost.cp_comm
    reduce, opt, gather = per_stage[crit]
    breakdown.update(tp_comm=tp_comm, cp_comm=cp_comm,
                     pipeline_bubble=max(0.0, max(tail) - sched.busy[crit] - reduce - opt - gather),
                     dp_grad_reduce=reduce, optimizer=opt, dp_param_gather=gather, step_overhead=overhead)
    tokens = layout.micro_batch_size * layout.dp * m * seq_length
    flops = flops_per_token(model_args, seq_length, vocab_size, tp=layout.tp) * tokens
    tflops = flops / step / c.world_size / 1e12
    return StepPrediction(
        step_time_s=step, tflops_per_gpu=tflops, mfu=tflops * 1e12 / hw.peak("bf16"), tokens_per_s=tokens / step,
        bubble_share=breakdown["pipeline_bubble"] / step,
        exposed_comm_share=(tp_comm + cp_comm + reduce + gather) / step, breakdown=breakdown,
        num_microbatches=m, critical_stage=crit, schedule=sched, layout=layout, cluster=c)
