"""The pretraining loop: set up, check, then train step by step with logging, evaluation and checkpoints.

    train(args)
      1. configure     the model config and the layout, checked before anything is allocated
      2. lock          the run folder, for this job alone (run_lock.py), before anything is written
         check inputs  what --load / --pretrained-checkpoint hold (run_folder.py: never a silent restart,
                       manifest verified, the same model) and the data (data/checks.py)
      3. build         model, optimizer, scheduler (step.setup_model_and_optimizer), then restore; data,
                       monitor (config.json), saver (build_loop: the one place the run's objects are made from
                       the arguments, handed to the loop as loop.LoopSettings and loop.Parts)
      4. loop          loop.Loop: step.train_step -> log -> evaluate -> save, until done or told to stop
                       (SIGTERM/SIGUSR1/SIGINT, --exit-duration-in-mins, --exit-interval: save and exit 0),
                       watched for hangs (watchdog.py)
      5. finish        the last save, the final validation loss, where everything is

Exit codes: 0 done or stopped cleanly, 2 bad input (one line that says what to do, before anything is
built; also another job holding the run folder, or a --save that cannot be written),
3 NaN/Inf loss (the last good checkpoint stays), 4 a checkpoint could not be written, 75 a hung rank
(watchdog.HANG_EXIT), 130 a second SIGINT (signals.StopSignal).
"""

import os
import time
from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import NamedTuple, Optional

import torch

from megatron_sat import archs, compat
from megatron_sat.data.checks import DataError
from megatron_sat.model import upcycle
from megatron_sat.model.args import record as model_record
from megatron_sat.model.flops import flops_per_token, peak_flops_per_device
from megatron_sat.model.specs import te_available
from megatron_sat.parallel.layout import initialize, validate
from megatron_sat.parallel.process_group import init_from_env
from megatron_sat.training import checkpointing as ckpt
from megatron_sat.training import megatron_lm_flags, schedule
from megatron_sat.training.argument_checks import refusal, target_errors
from megatron_sat.training.arguments import Resolution, build_parser
from megatron_sat.training.config_file import config_dict
from megatron_sat.training.data import build_iterators, tokenizer_and_data
from megatron_sat.training.gate_telemetry import GateTelemetry
from megatron_sat.training.loop import Loop, LoopSettings, Parts, describe_checkpoint
from megatron_sat.training.monitor import Monitor
from megatron_sat.training.profiler import StepProfiler, TimedIterator
from megatron_sat.training.run_folder import clean_stale, model_differences
from megatron_sat.training.run_lock import LockHeld, NotWritable, RunLock
from megatron_sat.training.run_paths import record_paths
from megatron_sat.training.setup import model_config, precision_and_layout, scheduler
from megatron_sat.training.signals import StopSignal, bind_to_launcher
from megatron_sat.training.step import setup_model_and_optimizer
from megatron_sat.training.watchdog import enable_flight_recorder, timeouts


class UsageError(ValueError):
    """Bad input found before anything is built: its args are the problems, printed as one line
    (argument_checks.refusal), exit 2."""

    def __str__(self) -> str:
        return "; ".join(map(str, self.args))


@dataclass
class Setup:
    """What configure() resolves from the arguments."""

    config: object
    layout: object
    backend: str
    bf16: bool
    dist_opt: bool
    num_micro: int
    world: int
    eval_micro: int     # micro-batches per evaluation pass (--eval-samples), or num_micro (--eval-iters passes)
    eval_passes: int
    model_fields: dict = field(default_factory=dict)


def fp16_options(args) -> Optional[dict]:
    """--fp16's loss-scale flags as megatron-core's OptimizerConfig fields; None without --fp16."""
    if not args.fp16:
        return None
    return dict(loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
                min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
                hysteresis=args.hysteresis)


def train(args, stop: Optional[StopSignal] = None, task_runner=None, resolution: Optional[Resolution] = None) -> int:
    """Run the whole training job; returns the process exit code.

    task_runner: with --eval-tasks, a class called as task_runner(args, chunks, tokenizer, log) whose instances
    score lm-eval tasks: instance(iteration) -> ({'task/metric': value}, {task: error}) (megatron_sat/train.py
    passes megatron_sat.analysis.training_tasks.TaskRunner: training does not import analysis). resolution: where
    each argument came from (arguments.parse_run; config.json records it), or None."""
    stop = stop or StopSignal()
    bind_to_launcher()
    t_start = time.time()
    enable_flight_recorder()  # the hang watchdog names the last collectives
    init_from_env(timeout_minutes=timeouts(args.hang_timeout_minutes, args.distributed_timeout_minutes)[1])
    rank = torch.distributed.get_rank()
    stop.is_logger = rank == 0
    log = (lambda text: print(text, flush=True)) if rank == 0 else (lambda text: None)
    lock = None
    try:
        setup = configure(args, log)
        lock = take_run_lock(args.save, log)  # before anything is written into the run folder
        inputs = check_inputs(args, setup, log)
    except UsageError as err:  # every rank sees the same error: report it once, build nothing
        log(refusal("megatron-sat-train", err.args))
        if lock is not None:
            lock.release(remove_empty_folder=True)
        return 2
    try:
        resume = inputs.resume
        if resume is not None and resume.iteration >= args.train_iters:
            log(f"nothing to do: {resume.directory} is at iteration {resume.iteration} of --train-iters "
                f"{args.train_iters} (the run is complete; raise --train-iters to train on)")
            return 0
        try:
            loop = build_loop(args, setup, inputs, stop, t_start, log, task_runner, resolution)
        except ckpt.CheckpointError as err:
            log(f"megatron-sat-train: error: {err}")
            return 2
        return loop.run()
    finally:  # every way out, errors and KeyboardInterrupt included (a kill -9 leaves a lock the next job takes over)
        if lock is not None:
            lock.release()


def take_run_lock(save: str, log):
    """Global rank 0 takes the run folder's lock (training/run_lock.py) and tells the other ranks, which write
    nothing before it; returns the lock on rank 0, None elsewhere; UsageError (on every rank) when another job
    holds the folder or it cannot be written."""
    lock, problem = None, None
    if torch.distributed.get_rank() == 0:
        try:
            lock = RunLock(save, log).acquire()
        except (LockHeld, NotWritable) as err:
            problem = str(err)
    if torch.distributed.get_world_size() > 1:
        shared = [problem]
        torch.distributed.broadcast_object_list(shared, src=0)
        problem = shared[0]
    if problem:
        raise UsageError(problem)
    return lock


def configure(args, log) -> Setup:
    """The model config and layout, checked against the world size and the backend (UsageError with every problem:
    argument_checks.argument_errors' checks that need the GPU and Transformer Engine, and the layout's)."""
    world = torch.distributed.get_world_size()
    gpu, te = torch.cuda.is_available(), te_available()
    errors = target_errors(args, gpu=gpu, te=te)
    if errors:
        raise UsageError(*errors)
    bf16, dist_opt, dtype, layout = precision_and_layout(args, gpu=gpu)
    backend = {"local": "local", "transformer_engine": "te"}.get(args.transformer_impl) or ("te" if te else "local")
    dp = layout.dp(world)
    num_micro = args.global_batch_size // (args.micro_batch_size * dp) if dp else None  # None: validate says why
    try:
        config = model_config(args, layout, dtype, training=True)
        validate(layout, config, world, seq_length=args.seq_length, num_microbatches=num_micro, backend=backend)
    except ValueError as err:
        raise UsageError(str(err)) from None
    eval_micro, eval_passes = num_micro, args.eval_iters
    if args.eval_samples:  # one pass over at least that many sequences, a whole number of micro-batches per rank
        eval_micro, eval_passes = -(-args.eval_samples // (args.micro_batch_size * dp)), 1
    args.eval_samples_effective = eval_micro * eval_passes * args.micro_batch_size * dp  # recorded in config.json
    return Setup(config, layout, backend, bf16, dist_opt, num_micro, world, eval_micro, eval_passes,
                 model_record(config))  # config.json and every checkpoint record the model's ModelArgs


class Inputs(NamedTuple):
    """What a run starts from, checked (check_inputs): the checkpoint to resume or the weights to start from, the
    tokenizer and the data, and whose LR schedule a resume follows."""

    resume: Optional[object]      # checkpointing.ResumePoint of --load, or None
    pretrained: Optional[object]  # the ResumePoint whose weights start the run (--pretrained-checkpoint, --finetune)
    tokenizer: object
    data: object
    schedule_mode: str = schedule.OVERRIDE  # schedule.OVERRIDE or schedule.CHECKPOINT (choose_schedule)


def check_inputs(args, setup: Setup, log) -> Inputs:
    """What --load and --pretrained-checkpoint hold, checked against the model asked for, the data against the
    tokenizer, and whose LR schedule a resume follows (UsageError)."""
    resume, pretrained, tokenizer, data = _points_and_data(args, setup, log)
    return Inputs(resume, pretrained, tokenizer, data, choose_schedule(args, resume, log))


def _points_and_data(args, setup: Setup, log):
    def find(root, step=None, reader=None):
        return ckpt.find_resume_point(root, step, verify=args.verify_checkpoint, fallback=args.ckpt_fallback, log=log,
                                      reader=reader)

    def check(point, flag, grow=False):
        saved = point.model_fields() if point else {}
        source = saved.get("arch", args.arch)
        if grow and source != args.arch:  # a Transformer's weights start another arch (model/upcycle.py)
            errors = archs.upcycle_errors(source, SimpleNamespace(**setup.model_fields), f"{flag} {point.directory}")
            if errors:
                raise UsageError("; ".join(errors))
            switch = archs.get(args.arch).upcycle_switch  # the new arch's own switches: the command's
            saved = {k: v for k, v in saved.items() if k != "arch" and not switch(k)}
        differs = model_differences(saved, setup.model_fields) if point else []
        if differs:
            raise UsageError(f"{flag} {point.directory} holds another model: {'; '.join(differs)}. Pass the "
                             "checkpoint's model flags (or its recipe), or a new --save to start afresh")
        return point

    try:
        if args.finetune:  # Megatron-LM's --finetune: --load's weights only, from iteration 0
            pretrained = find(args.load, args.ckpt_step)
            if pretrained is None:
                raise UsageError(f"--finetune --load {args.load} holds no complete checkpoint")
            tokenizer, data = tokenizer_and_data(args, log)
            return None, check(pretrained, "--finetune --load"), tokenizer, data
        resume = check(find(args.load, args.ckpt_step), "--load") if args.load else None
        pretrained = None
        if resume is None and args.pretrained_checkpoint:
            pretrained = find(args.pretrained_checkpoint, reader="--pretrained-checkpoint load")
            if pretrained is None:
                raise UsageError(f"--pretrained-checkpoint {args.pretrained_checkpoint} holds no complete checkpoint")
            check(pretrained, "--pretrained-checkpoint", grow=True)
        tokenizer, data = tokenizer_and_data(args, log)
    except (ckpt.CheckpointError, DataError) as err:
        raise UsageError(str(err)) from None
    return resume, pretrained, tokenizer, data


def choose_schedule(args, resume, log) -> str:
    """Whose LR schedule a resumed run follows (schedule.py): the checkpoint's or the command's (UsageError when
    they differ and no flag says which)."""
    if resume is None:
        return schedule.OVERRIDE
    try:
        return schedule.choose(resume.common.get("opt_param_scheduler"), args, resume.iteration, log)
    except schedule.ScheduleChanged as err:
        raise UsageError(str(err)) from None


def followed_schedule(scheduler) -> dict:
    """The LR schedule a resume that keeps the checkpoint's follows, under the flags' names (config.json records
    it in place of the command's --lr, --min-lr, ...; lr_schedule_from says whose it is)."""
    return dict(lr=scheduler.max_lr, min_lr=scheduler.min_lr, lr_warmup_iters=scheduler.lr_warmup_steps,
                lr_decay_iters=scheduler.lr_decay_steps, lr_decay_style=scheduler.lr_decay_style,
                weight_decay=scheduler.start_wd, lr_schedule_from="checkpoint")


def loop_settings(args, hang_minutes: float, group_minutes: float) -> LoopSettings:
    """What the loop reads of the arguments (loop.LoopSettings), taken once; `arguments` is every argument as
    each checkpoint records them."""
    names = [f.name for f in fields(LoopSettings) if f.name not in ("hang_minutes", "group_minutes", "arguments")]
    return LoopSettings(**{name: getattr(args, name) for name in names}, hang_minutes=hang_minutes,
                        group_minutes=group_minutes, arguments=dict(vars(args)))


def build_loop(args, setup: Setup, inputs: Inputs, stop: StopSignal, t_start: float, log, task_runner=None,
               resolution: Optional[Resolution] = None) -> Loop:
    """The run built from the arguments, in the one place that reads them: model, optimizer, scheduler (restored
    from inputs' checkpoint), data, monitor (config.json), saver, profiler; handed to loop.Loop as its settings and
    parts. setup: configure's model config and layout; inputs: check_inputs' resume point, weights, tokenizer,
    data and schedule; stop: the signals; t_start: when the job started (--exit-duration-in-mins); task_runner:
    see train; resolution: where each argument came from (arguments.parse_run), recorded in config.json."""
    resume, tokenizer, data = inputs.resume, inputs.tokenizer, inputs.data
    stop.kept = lambda: f"{describe_checkpoint(args.save)}; resume with --load {args.save}"
    rank = torch.distributed.get_rank()
    if rank == 0 and os.path.isdir(args.save):
        stale = clean_stale(args.save)
        if stale:
            log(f"removed what interrupted saves left in {args.save}: {', '.join(stale)}")
    layout, config = setup.layout, setup.config
    multiple = args.make_vocab_size_divisible_by * layout.tp  # as Megatron-LM: embedding rows split over TP
    vocab_size = -(-tokenizer.vocab_size // multiple) * multiple
    hang_minutes, group_minutes = timeouts(args.hang_timeout_minutes, args.distributed_timeout_minutes)
    initialize(layout, seed=args.seed, timeout_minutes=group_minutes)
    chunks, num_params, optimizer = setup_model_and_optimizer(
        config, vocab_size=vocab_size, max_sequence_length=args.seq_length, rotary_base=args.rotary_base,
        backend=setup.backend, use_distributed_optimizer=setup.dist_opt,
        overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather and setup.dist_opt,
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr, lr=args.lr, min_lr=args.min_lr,
        weight_decay=args.weight_decay, clip_grad=args.clip_grad, betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps, weight_decay_params=args.weight_decay_params, fp16=fp16_options(args))
    sched = scheduler(optimizer, args, inputs.schedule_mode)
    iteration, consumed = restore(args, inputs, chunks, optimizer, sched, log, setup.model_fields)
    train_iter, valid_iters, test_iters = build_iterators(args, tokenizer, data, consumed)
    flops_tok = flops_per_token(config, args.seq_length, vocab_size)
    run_config = dict(vars(args), world_size=setup.world, data_parallel_size=layout.dp(setup.world),
                      num_microbatches=setup.num_micro, layout=layout.describe(setup.world), vocab_size=vocab_size,
                      tokenizer_vocab_size=tokenizer.vocab_size, bf16=setup.bf16,
                      use_distributed_optimizer=setup.dist_opt, num_parameters=num_params,
                      flops_per_token=flops_tok, device=str(compat.device()), data=data,
                      tokenizer=str(getattr(tokenizer, "name", tokenizer)), model=setup.model_fields,
                      arguments=run_arguments(args), **record_paths(args),  # paths that hold from any folder
                      **(resolution.record() if resolution else {}))  # where each value came from
    if resume is not None and inputs.schedule_mode == schedule.CHECKPOINT:
        run_config.update(followed_schedule(sched))
    monitor = Monitor(args, run_config, iteration, resumed=resume is not None, is_logger=rank == 0)
    log(f"megatron-sat: {megatron_lm_flags.describe_arch(args.arch)}, {num_params:,} parameters, "
        f"{layout.describe(setup.world)}, "
        f"{setup.num_micro} micro-batches x {args.micro_batch_size} x {args.seq_length} tokens per rank, "
        f"{'bf16' if setup.bf16 else 'fp16' if args.fp16 else 'fp32'} on {setup.world} x {compat.device().type}")
    monitor.start_bar()  # after the banner: the bar gets a line of its own
    gates = GateTelemetry(chunks, config.num_layers, compat.device()) if archs.get(args.arch).gated else None
    saver = ckpt.Saver(args.save, chunks, optimizer, sched, async_save=args.async_save,
                       retain_interval=args.save_retain_interval, log=log,
                       debug_delay_s=args.debug_save_delay, debug_fail_at=args.debug_fail_save_at)
    tasks = task_runner(args, chunks, tokenizer, log) if task_runner and args.eval_tasks else None
    parts = Parts(chunks, optimizer, sched, TimedIterator(train_iter), valid_iters, test_iters, monitor, saver, gates,
                  tasks, StepProfiler(args, rank, log), flops_tok, peak_flops_per_device(args.peak_tflops),
                  iteration, consumed, resumed=resume is not None)
    return Loop(loop_settings(args, hang_minutes, group_minutes), setup, parts, stop, t_start, log)


def restore(args, inputs: Inputs, chunks, optimizer, sched, log, model_fields: Optional[dict] = None):
    """(iteration, consumed samples) after loading what --load or --pretrained-checkpoint hold (model_fields: the
    model's, for a start of another arch from a Transformer's weights)."""
    resume, pretrained = inputs.resume, inputs.pretrained
    if resume is not None:
        loaded = ckpt.restore(resume, chunks, optimizer, sched,
                              align=lambda state: schedule.align_param_groups(state, optimizer, inputs.schedule_mode),
                              load_optim=not args.no_load_optim, load_rng=not args.no_load_rng)
        if args.no_load_optim:  # the optimizer's main (fp32) copies were made from the init
            optimizer.reload_model_params()
        saved = loaded["layout"]
        unverified = "; files not verified: no manifest" if args.verify_checkpoint and not resume.verified else ""
        rng = "" if loaded["rng_restored"] else (
            "; RNG state not loaded (--no-load-rng)" if args.no_load_rng else "; RNG state not restored: layout changed")
        log(f"resumed from {loaded['directory']} (iteration {loaded['iteration']}, saved at TP{saved['tp']} x "
            f"PP{saved['pp']}{rng}{unverified}"
            f"{'; optimizer and LR schedule not loaded (--no-load-optim)' if args.no_load_optim else ''})")
        return loaded["iteration"], loaded["consumed_train_samples"]
    if args.load and not args.finetune:
        log(f"no checkpoint in {args.load}: starting {'anew' if pretrained else 'from scratch'}")
    if pretrained is not None:
        source = pretrained.model_fields().get("arch", args.arch)
        grown = ""
        if source != args.arch:  # a Transformer's weights start this arch: its own parameters by its hooks
            arch, model = archs.get(args.arch), SimpleNamespace(**model_fields)
            directory = ckpt.load_weights(pretrained, chunks, own=arch.own_fields(model))
            upcycle.fill([ckpt.unwrap(c) for c in chunks], arch, model, args.upcycle_gate_std, args.seed)
            grown = f"; a {args.arch} started from its {source}: {upcycle.note(arch, args.upcycle_gate_std)}"
        else:
            directory = ckpt.load_weights(pretrained, chunks)
        optimizer.reload_model_params()  # the optimizer's main (fp32) copies were made from the init
        log(f"initialised from the weights of {directory}{' (--finetune)' if args.finetune else ''}: new "
            f"optimizer state, LR schedule, RNG and data order{grown}")
    return 0, 0


def run_arguments(args) -> dict:
    """The run's resolved arguments as a config file holds them (config.json's "arguments": --config reads it)."""
    return config_dict(args, build_parser())
