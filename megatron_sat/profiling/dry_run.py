"""Dry run at scale: every rank role of a cluster layout, built for real on one CPU and checked against the plan.

    from megatron_sat.profiling.dry_run import dry_run
    report = dry_run(args, nodes=16, gpus_per_node=8, gpu="H100")   # trainer arguments (recipe_args)
    print(report.format()); assert report.ok, report.failure

One process plays each distinct rank of the world in turn on torch's fake process group (backend "fake": any world
size and rank, collectives and pipeline messages return at once and move no data) with the model on the meta device
(shapes and dtypes only; megatron_sat.compat.meta_device). For each role it runs what a cluster rank runs:
trainer.configure (the trainer's own checks and messages), the process groups (parallel.layout.initialize), the
model chunks, Float16Module, DDP and the optimizer (training.step.setup_model_and_optimizer), one step through
Megatron's pipeline schedule (forward, backward, gradient finalisation; every micro-batch of the step) and the
optimizer step (gradient norm and clipping, the distributed optimizer's shard). Then it compares what was built
with the planner (training.planner.stage_estimates):
    parameters          this rank's, exactly
    weights bytes       exactly (bf16 or fp32 as planned)
    grad buffer bytes   within `tolerance` (Megatron pads its buffers)
    optimizer bytes     within `tolerance` (fp32 main copies + Adam m, v; a 1/DP shard with the distributed optimizer)
    saved activations   bytes autograd saves in one micro-batch's forward over the rank's chunks (the SavedBytes
                        accounting tests/test_recipes.py checks the planner with), within `tolerance`, against the
                        planner's local-backend figure (what runs here: Megatron's local spec, not Transformer Engine)
    pipeline messages   every message's shape [s', b, channels], exactly
and reports the planner's predicted peak for the rank's stage on the target GPU (the plan's Transformer Engine
figure). Roles: every pipeline stage (all its virtual chunks) at TP rank 0, DP rank 0, and the last rank of the world
(last TP and DP rank of the last stage; the shards of a padded vocabulary and of the distributed optimizer).

Cannot check: numbers (a meta tensor has no values: losses, norms read as 0), speed, Transformer Engine or fused
kernels (the local spec runs), NCCL, GPU memory fragmentation. Written here because no library builds a Megatron
model per rank on a fake world and checks it against a memory model.
"""

import contextlib
import logging
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
from megatron.core import parallel_state
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_sat import compat
from megatron_sat.model import wire
from megatron_sat.parallel.layout import destroy, initialize
from megatron_sat.profiling.step_benchmark import SavedBytes
from megatron_sat.training import planner  # looked up at call time: tests substitute a wrong planner figure
from megatron_sat.training.argument_checks import argument_errors
from megatron_sat.training.arguments import recipe_args
from megatron_sat.training.setup import precision_and_layout
from megatron_sat.training.step import gpt_forward_step, run_forward_backward, setup_model_and_optimizer
from megatron_sat.training.trainer import UsageError, configure

DEFAULT_TOLERANCE = planner.DEFAULT_TOLERANCE
ACTIVATION_TOLERANCE = planner.ACTIVATION_TOLERANCE


@dataclass
class RoleReport:
    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    chunks: List[str]                       # "chunk v: layers a-b" per virtual stage
    params: int = 0
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    saved_per_micro_batch: List[int] = field(default_factory=list)  # bytes, per micro-batch (all chunks)
    messages: dict = field(default_factory=dict)  # (direction, shape, dtype) -> count
    planned: dict = field(default_factory=dict)   # stage_estimates' stage (bytes), local-backend activations
    peak_gib: float = 0.0                   # the plan's predicted peak for this stage on the target GPU
    seconds: float = 0.0

    def message_bytes(self, shape, dtype) -> int:
        return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()

    def format(self) -> str:
        mib = 2 ** 20
        p = self.planned
        saved = max(self.saved_per_micro_batch or [0])
        lines = [f"  rank {self.rank:>4} (PP {self.pp_rank}, TP {self.tp_rank}, DP {self.dp_rank}): "
                 f"{'; '.join(self.chunks)}  [{self.seconds:.1f} s]",
                 f"    params       {self.params:,} ({self.param_bytes / mib:,.1f} MiB)   plan {p['params']:,.0f}",
                 f"    grad buffer  {self.grad_bytes / mib:,.1f} MiB   plan {p['grads'] / mib:,.1f}",
                 f"    optimizer    {self.optimizer_bytes / mib:,.1f} MiB   plan {p['optimizer'] / mib:,.1f}",
                 f"    saved/micro  {saved / mib:,.1f} MiB over {len(self.saved_per_micro_batch)} micro-batch(es)   "
                 f"plan {p['per_micro_batch'] / mib:,.1f} (local backend)"]
        for (direction, shape, dtype), count in sorted(self.messages.items()):
            lines.append(f"    {direction:<12} [{', '.join(map(str, shape))}] {str(dtype).replace('torch.', '')} "
                         f"{self.message_bytes(shape, dtype) / mib:,.2f} MiB x {count}")
        lines.append(f"    peak         {self.peak_gib:.1f} GiB planned on the target GPU")
        return "\n".join(lines)


@dataclass
class DryRunReport:
    recipe: str
    layout: str
    world: int
    gpu: str
    tolerance: float
    activation_tolerance: float
    roles: List[RoleReport] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    failure: Optional[str] = None
    usage_error: bool = False  # the failure is the trainer's refusal of the layout (its own message)
    invalid: bool = False  # the code ran, but the plan does not fit the target GPU (plan-layout's INVALID)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failure is None

    def format(self, roles: bool = True) -> str:
        lines = [f"dry run {self.recipe}: {self.layout} = {self.world} ranks (fake process group, meta device), "
                 f"{len(self.roles)} rank role(s); tolerances {100 * self.tolerance:g}% on buffer and optimizer bytes, "
                 f"{100 * self.activation_tolerance:g}% on saved activations"]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [r.format() for r in self.roles] if roles else []
        lines.append(f"  status OK ({self.seconds:.1f} s)" if self.ok else
                     f"  status INVALID: {self.failure}" if self.invalid else f"  status FAILED: {self.failure}")
        return "\n".join(lines)


def role_ranks(tp: int, pp: int, dp: int, cp: int = 1) -> List[int]:
    """Global ranks to play: each pipeline stage at TP 0, DP 0, and with TP > 1 the world's last rank (last TP and
    DP rank of the last stage: another TP shard; DP ranks hold equal shards, Megatron pads its buffers to a multiple
    of DP). Megatron's default rank order tp-cp-ep-dp-pp: rank = tp_rank + tp x (cp_rank + cp x (dp_rank + dp x
    pp_rank))."""
    ranks = [stage * tp * cp * dp for stage in range(pp)]
    last = tp * cp * dp * pp - 1
    return ranks + ([last] if tp > 1 and last not in ranks else [])


def schedule_micro_batches(num_microbatches: int, pp: int, vpp: Optional[int]) -> int:
    """The fewest micro-batches that run every phase of the step's pipeline schedule (warm-up, steady 1F1B,
    cool-down) on every stage, at most the step's own: 1 without pipelining (each further micro-batch repeats
    the first), PP for 1F1B, and for interleaving the smallest multiple of PP whose chunk passes exceed stage 0's
    warm-up (2 (PP - 1) + (VPP - 1) PP). More micro-batches only repeat the steady state: what a rank keeps
    (in flight, buffers, saved bytes per micro-batch) is the same."""
    if pp == 1:
        return 1
    if not vpp:
        return min(num_microbatches, pp)
    m = pp
    while m * vpp <= 2 * (pp - 1) + (vpp - 1) * pp:
        m += pp
    return min(num_microbatches, m)


class _MetaSavedBytes(SavedBytes):
    """SavedBytes keyed by storage identity: meta storages all have data pointer 0."""

    def pack(self, t):
        storage = t.untyped_storage()
        key = storage._cdata if t.is_meta else storage.data_ptr()
        if key not in self.seen:
            self.seen.add(key)
            self.bytes += storage.nbytes()
        return t


def _storage_key(t) -> int:
    storage = t.untyped_storage()
    return storage._cdata if t.is_meta else storage.data_ptr()


def _init_fake_world(world: int, rank: int) -> None:
    destroy()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    torch.distributed.init_process_group(compat.FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world)


@contextmanager
def _quiet():
    """Megatron's per-model notices (deprecations, DDP layout notes) would repeat for every role."""
    logger = logging.getLogger("megatron")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logger.setLevel(level)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {text[:300]}{where}"


def _optimizer_bytes(optimizer, chunks) -> int:
    """fp32 main copies (when the model is bf16) and every optimizer state tensor of this rank."""
    total = 0
    seen = {_storage_key(p) for c in chunks for p in c.parameters()}  # the model's weights (or views of them)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if _storage_key(p) not in seen:  # a main copy, not the model's weight
                    seen.add(_storage_key(p))
                    total += p.numel() * p.element_size()
                for value in inner.state.get(p, {}).values():
                    if torch.is_tensor(value) and value.numel() > 1:  # Adam's m and v, not its step counter
                        total += value.numel() * value.element_size()
    return total


def _grad_bytes(chunks) -> int:
    total = 0
    for chunk in chunks:
        for buffer in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            total += buffer.grad_data.numel() * buffer.grad_data.element_size()
    return total


def _run_role(args, setup, plan, local_stages, world: int, rank: int, vocab_size: int, num_micro: int,
              fake: bool = True) -> RoleReport:
    """Play `rank` (fake: on the fake world and the meta device; otherwise this process's own rank of a real world,
    on real tensors: how tests/test_dry_run.py checks the dry run against a real run) and measure what it built."""
    t0 = time.time()
    if fake:
        _init_fake_world(world, rank)
    layout, config = setup.layout, setup.config
    initialize(layout, seed=args.seed)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    vpp = layout.vpp or 1
    layers = wire.chunk_layers(config.num_layers, layout.pp * vpp)
    report = RoleReport(rank=torch.distributed.get_rank(), pp_rank=pp_rank,
                        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                        dp_rank=parallel_state.get_data_parallel_rank(),
                        chunks=[f"chunk {v}: layers {layers[v * layout.pp + pp_rank][0]}-"
                                f"{layers[v * layout.pp + pp_rank][-1]}" for v in range(vpp)])
    report.planned = dict(local_stages[pp_rank], peak=plan.stages[pp_rank]["gib"]["total"])
    report.peak_gib = plan.stages[pp_rank]["gib"]["total"]
    with compat.meta_device() if fake else contextlib.nullcontext():
        chunks, _, optimizer = setup_model_and_optimizer(
            config, vocab_size=vocab_size, max_sequence_length=args.seq_length, rotary_base=args.rotary_base,
            backend=setup.backend, use_distributed_optimizer=setup.dist_opt, overlap_grad_reduce=args.overlap_grad_reduce,
            lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
            betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, weight_decay_params=args.weight_decay_params)
        params = [p for c in chunks for p in c.parameters()]
        report.params = sum(p.numel() for p in params)
        report.param_bytes = sum(p.numel() * p.element_size() for p in params)
        report.grad_bytes = _grad_bytes(chunks)
        param_storages = {_storage_key(p) for p in params}
        saved = {}

        def record(direction, tensor):
            key = (direction, tuple(tensor.shape), tensor.dtype)
            report.messages[key] = report.messages.get(key, 0) + 1

        inner = []
        for chunk in chunks:
            module = chunk
            while hasattr(module, "module"):
                module = module.module
            inner.append(module)
            original = module.set_input_tensor

            def set_input_tensor(tensor, _original=original):
                first = tensor[0] if isinstance(tensor, list) else tensor
                if first is not None:
                    record("receives", first)
                return _original(tensor)

            module.set_input_tensor = set_input_tensor

        counts = {}

        def forward_step(data_iterator, model):
            index = chunks.index(model)
            counter = _MetaSavedBytes()
            counter.seen.update(param_storages)
            with counter:
                output, loss_func = gpt_forward_step(data_iterator, model)
            micro = counts.get(index, 0)
            counts[index] = micro + 1
            saved[micro] = saved.get(micro, 0) + counter.bytes
            if not inner[index].post_process:
                record("sends", output)
            return output, loss_func

        b, s = args.micro_batch_size, args.seq_length
        tokens = torch.zeros(b, s, dtype=torch.long)
        batch = dict(tokens=tokens, labels=tokens, loss_mask=torch.ones(b, s), position_ids=torch.arange(s).expand(b, s))
        run_forward_backward(chunks, optimizer, config, iter([batch] * num_micro), num_microbatches=num_micro,
                             seq_length=s, micro_batch_size=b, forward_step_func=forward_step)
        optimizer.step()
        report.optimizer_bytes = _optimizer_bytes(optimizer, chunks)
        report.saved_per_micro_batch = [saved[m] for m in sorted(saved)]
    report.seconds = time.time() - t0
    return report


def measure_real_rank(args, *, gpu: str = "cpu", all_micro_batches: bool = False) -> RoleReport:
    """What this rank of a real, initialised torch.distributed world builds and saves in one step, measured exactly as
    the dry run measures a role (tests/test_dry_run.py compares the two)."""
    world = torch.distributed.get_world_size()
    setup = configure(args, lambda line: None)
    plan = planner.make_plan(args, recipe="real", nodes=1, gpus_per_node=world, gpu=gpu)
    local = planner.stage_estimates(setup.config, setup.layout, dp=plan.dp, micro_batch_size=args.micro_batch_size,
                            num_microbatches=setup.num_micro, seq_length=args.seq_length, vocab_size=plan.vocab_size,
                            bf16=setup.bf16, distributed_optimizer=setup.dist_opt, recompute=args.recompute_granularity,
                            activation_bytes=2 if setup.bf16 else 4, backend="local")
    num_micro = setup.num_micro if all_micro_batches else schedule_micro_batches(setup.num_micro, setup.layout.pp,
                                                                                 setup.layout.vpp)
    return _run_role(args, setup, plan, local, world, torch.distributed.get_rank(), plan.vocab_size, num_micro,
                     fake=False)


def check_role(role: RoleReport, tolerance: float = DEFAULT_TOLERANCE,
               activation_tolerance: float = ACTIVATION_TOLERANCE) -> Optional[str]:
    """The first difference between what `role` built and what the plan promised (one line), or None."""
    p = role.planned
    where = f"rank {role.rank} (PP {role.pp_rank}, TP {role.tp_rank})"
    if role.params != round(p["params"]):
        return f"{where}: {role.params:,} parameters built, the planner promised {p['params']:,.0f}"
    if role.param_bytes != round(p["weights"]):
        return f"{where}: {role.param_bytes:,} bytes of weights built, the planner promised {p['weights']:,.0f}"
    for what, got, want, tol in (
            ("gradient buffer", role.grad_bytes, p["grads"], tolerance),
            ("optimizer state", role.optimizer_bytes, p["optimizer"], tolerance),
            ("saved activations per micro-batch", max(role.saved_per_micro_batch), p["per_micro_batch"],
             activation_tolerance)):
        if abs(got - want) > tol * max(want, 1):
            return (f"{where}: {what} {got / 2**20:,.1f} MiB built, the planner promised {want / 2**20:,.1f} MiB "
                    f"({100 * (got / max(want, 1) - 1):+.2f}%, tolerance {100 * tol:g}%)")
    expected = tuple(p["message"])
    for (direction, shape, _), _ in role.messages.items():
        if shape != expected:
            return f"{where}: {direction} a pipeline message [{', '.join(map(str, shape))}], the planner sized " \
                   f"[{', '.join(map(str, expected))}]"
    return None


def dry_run(args, *, recipe: str, nodes: int, gpus_per_node: int, gpu: str, tolerance: float = DEFAULT_TOLERANCE,
            activation_tolerance: float = ACTIVATION_TOLERANCE, ranks: Optional[List[int]] = None,
            all_micro_batches: bool = False,
            log: Callable[[str], None] = lambda line: None) -> DryRunReport:
    """Dry-run trainer arguments `args` on nodes x gpus_per_node `gpu`s (see the module docstring).

    all_micro_batches: run the step's every micro-batch, not only the fewest that run every phase of its schedule
    (schedule_micro_batches; the rest repeat the steady state).

    Never raises for the run's own errors: report.failure holds the one-line reason (the trainer's message for a
    layout it refuses, the real code's error, or the first difference from the plan)."""
    t0 = time.time()
    world = nodes * gpus_per_node
    compat.ensure_cpu_compat()
    target = precision_and_layout(args, gpu=gpu != "cpu")  # as the trainer decides on the target (a GPU: bf16 and
    args.bf16, args.use_distributed_optimizer = target.bf16, target.distributed_optimizer  # the distributed optimizer)
    report = DryRunReport(recipe=recipe, layout="?", world=world, gpu=gpu, tolerance=tolerance,
                          activation_tolerance=activation_tolerance)
    problems = argument_errors(args, None, inputs=False, gpu=gpu != "cpu", te=gpu != "cpu")  # as parse_args does
    if problems:  # the layout's problems come from the trainer's configure below, in its words
        report.failure, report.usage_error = "; ".join(problems), True
        return report
    with _quiet():
        try:
            _init_fake_world(world, 0)
            try:
                setup = configure(args, log)
            except UsageError as err:
                report.failure, report.usage_error = str(err).replace("\n ", "").replace("\n", "; "), True
                return report
            report.layout = setup.layout.describe(world)
            plan = planner.make_plan(args, recipe=recipe, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu)
            if not plan.stages:
                report.failure = "the planner refuses this layout: " + "; ".join(plan.errors)
                return report
            act_bytes = 2 if setup.bf16 else 4
            local = planner.stage_estimates(setup.config, setup.layout, dp=plan.dp, micro_batch_size=args.micro_batch_size,
                                    num_microbatches=setup.num_micro, seq_length=args.seq_length,
                                    vocab_size=plan.vocab_size, bf16=setup.bf16, distributed_optimizer=setup.dist_opt,
                                    recompute=args.recompute_granularity, activation_bytes=act_bytes,
                                    backend="local")
            report.notes.append(f"{'bf16' if setup.bf16 else 'fp32'}, "
                                f"{'distributed' if setup.dist_opt else 'plain'} optimizer, recompute "
                                f"{args.recompute_granularity or 'none'}, micro-batches of {args.micro_batch_size} x "
                                f"{args.seq_length} (the full sequence: every kernel ran on the meta device), "
                                f"Megatron's local spec (backend {setup.backend})")
            layout = setup.layout
            num_micro = setup.num_micro if all_micro_batches else schedule_micro_batches(setup.num_micro, layout.pp,
                                                                                         layout.vpp)
            report.notes.append(f"ran {num_micro} of the step's {setup.num_micro} micro-batches per rank"
                                + ("" if num_micro == setup.num_micro else
                                   " (every phase of the schedule; the others repeat its steady state)"))
            for rank in ranks if ranks is not None else role_ranks(layout.tp, layout.pp, plan.dp, layout.cp):
                try:
                    role = _run_role(args, setup, plan, local, world, rank, plan.vocab_size, num_micro)
                except Exception as err:  # noqa: BLE001 - any error of the real code at this layout is the finding
                    report.failure = f"rank {rank}: {_one_line(err)}"
                    return report
                report.roles.append(role)
                log(role.format())
                report.failure = check_role(role, tolerance, activation_tolerance)
                if report.failure:
                    return report
            if plan.errors:  # every role ran as planned, and the plan does not fit: plan-layout's verdict, exit 1
                report.failure, report.invalid = f"the plan on {gpu} is INVALID: " + "; ".join(plan.errors), True
        finally:
            destroy()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            report.seconds = time.time() - t0
    return report


def dry_run_recipe(recipe: Optional[str], overrides=(), *, nodes: Optional[int] = None,
                   gpus_per_node: Optional[int] = None, gpu: Optional[str] = None, **kwargs) -> DryRunReport:
    """dry_run of `recipe` with trainer flags `overrides` (--config FILE among them), resolved as the trainer
    resolves them (arguments.recipe_args), on its default cluster (planner.default_cluster), any part of it
    overridden (as planner.plan_recipe). ValueError for an unknown recipe, an unreadable config file or no model
    shape."""
    args = recipe_args(recipe, list(overrides))
    c = planner.default_cluster(args.recipe)
    return dry_run(args, recipe=args.recipe or "none", nodes=nodes or c["nodes"],
                   gpus_per_node=gpus_per_node or c["gpus_per_node"], gpu=gpu or c["gpu"], **kwargs)
