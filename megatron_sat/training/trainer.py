"""The pretraining loop: set up, check, then train step by step with logging, evaluation and checkpoints.

    train(args)
      1. configure     the model config and the layout, checked before anything is allocated
      2. lock          the run folder, for this job alone (run_lock.py), before anything is written
         check inputs  what --load / --pretrained-checkpoint hold (run_folder.py: never a silent restart,
                       manifest verified, the same model) and the data (data/checks.py)
      3. build         model, optimizer, scheduler (step.setup_model_and_optimizer), then restore
      4. loop          step.train_step -> log -> evaluate -> save, until done or told to stop
                       (SIGTERM/SIGUSR1/SIGINT, --exit-duration-in-mins, --exit-interval: save and exit 0),
                       watched for hangs (watchdog.py)
      5. finish        the last save, the final validation loss, where everything is

Exit codes: 0 done or stopped cleanly, 2 bad input (one line that says what to do, before anything is
built; also another job holding the run folder, or a --save that cannot be written),
3 NaN/Inf loss (the last good checkpoint stays), 4 a checkpoint could not be written, 75 a hung rank
(watchdog.HANG_EXIT), 130 a second SIGINT (signals.StopSignal).
"""

import contextlib
import gc
import os
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from megatron_sat import archs, compat
from megatron_sat.data.checks import DataError
from megatron_sat.model.args import record as model_record
from megatron_sat.model.flops import flops_per_token, peak_flops_per_device
from megatron_sat.model.specs import te_available
from megatron_sat.parallel.layout import initialize, validate
from megatron_sat.parallel.process_group import init_from_env
from megatron_sat.training import checkpointing as ckpt
from megatron_sat.training import megatron_lm_flags, schedule
from megatron_sat.training.argument_checks import refusal, target_errors
from megatron_sat.training.arguments import build_parser
from megatron_sat.training.config_file import config_dict
from megatron_sat.training.data import build_iterators, tokenizer_and_data
from megatron_sat.training.gate_telemetry import GateTelemetry
from megatron_sat.training.monitor import Monitor
from megatron_sat.training.profiler import StepProfiler, TimedIterator, bubble_fraction
from megatron_sat.training.run_folder import checkpoint_dir, clean_stale, latest_iteration, model_differences
from megatron_sat.training.run_lock import LockHeld, NotWritable, RunLock
from megatron_sat.training.run_paths import record_paths
from megatron_sat.training.setup import model_config, precision_and_layout, scheduler
from megatron_sat.training.signals import StopSignal, bind_to_launcher
from megatron_sat.training.step import NonFiniteLoss, evaluate, gpt_forward_step, setup_model_and_optimizer, train_step
from megatron_sat.training.watchdog import HEADROOM, Watchdog, enable_flight_recorder, is_collective_timeout, timeouts


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


@dataclass
class Window:
    """Steps since the last log line."""

    time: float = 0.0
    steps: int = 0
    loss: float = 0.0
    grad: float = 0.0
    skipped: int = 0  # fp16: steps whose gradients overflowed (no update)
    samples: int = 0    # sequences trained (the global batch per step; less while --rampup-batch-size ramps)
    phases: dict = field(default_factory=dict)  # --log-timers-to-tensorboard: seconds per phase, summed

    def add(self, dt: float, result, samples: int) -> None:
        self.time, self.steps, self.samples = self.time + dt, self.steps + 1, self.samples + samples
        self.loss, self.grad = self.loss + result.loss, self.grad + (result.grad_norm or 0.0)
        self.skipped += not result.success


def fp16_options(args) -> Optional[dict]:
    """--fp16's loss-scale flags as megatron-core's OptimizerConfig fields; None without --fp16."""
    if not args.fp16:
        return None
    return dict(loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
                min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
                hysteresis=args.hysteresis)


def train(args, stop: Optional[StopSignal] = None, task_runner=None) -> int:
    """Run the whole training job; returns the process exit code.

    task_runner: with --eval-tasks, a class called as task_runner(args, chunks, tokenizer, log) whose instances
    score lm-eval tasks: instance(iteration) -> ({'task/metric': value}, {task: error}) (megatron_sat/train.py
    passes megatron_sat.analysis.training_tasks.TaskRunner: training does not import analysis)."""
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
            loop = Loop(args, setup, inputs, stop, t_start, log, task_runner)
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

    def check(point, flag):
        differs = model_differences(point.model_fields(), setup.model_fields) if point else []
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
            check(pretrained, "--pretrained-checkpoint")
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


class Loop:
    """The built run: model, optimizer, scheduler, data, saver, monitor; run() trains it."""

    def __init__(self, args, setup: Setup, inputs: Inputs, stop: StopSignal, t_start: float, log, task_runner=None):
        """args: the run's arguments; setup: configure's model config and layout; inputs: check_inputs' resume
        point, weights, tokenizer, data and schedule; stop: the signals; t_start: when the job started
        (--exit-duration-in-mins); task_runner: see train."""
        self.args, self.setup, self.stop, self.t_start, self.log = args, setup, stop, t_start, log
        resume, pretrained, tokenizer, data = inputs.resume, inputs.pretrained, inputs.tokenizer, inputs.data
        schedule_mode = inputs.schedule_mode
        stop.kept = lambda: f"{_describe_checkpoint(args.save)}; resume with --load {args.save}"
        rank = torch.distributed.get_rank()
        if rank == 0 and os.path.isdir(args.save):
            stale = clean_stale(args.save)
            if stale:
                log(f"removed what interrupted saves left in {args.save}: {', '.join(stale)}")
        layout, config = setup.layout, setup.config
        multiple = args.make_vocab_size_divisible_by * layout.tp  # as Megatron-LM: embedding rows split over TP
        vocab_size = -(-tokenizer.vocab_size // multiple) * multiple
        self.hang_minutes, self.group_minutes = timeouts(args.hang_timeout_minutes, args.distributed_timeout_minutes)
        initialize(layout, seed=args.seed, timeout_minutes=self.group_minutes)
        self.chunks, num_params, self.optimizer = setup_model_and_optimizer(
            config, vocab_size=vocab_size, max_sequence_length=args.seq_length, rotary_base=args.rotary_base,
            backend=setup.backend, use_distributed_optimizer=setup.dist_opt,
            overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather and setup.dist_opt,
            grad_reduce_in_fp32=not args.grad_reduce_in_bf16,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr, lr=args.lr, min_lr=args.min_lr,
            weight_decay=args.weight_decay, clip_grad=args.clip_grad, betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps, weight_decay_params=args.weight_decay_params, fp16=fp16_options(args))
        self.schedule_mode = schedule_mode
        self.scheduler = scheduler(self.optimizer, args, schedule_mode)
        self.iteration, self.consumed = self._restore(resume, pretrained)
        train_iter, self.valid_iters, self.test_iters = build_iterators(args, tokenizer, data, self.consumed)
        self.train_iter = TimedIterator(train_iter)
        self.flops_tok = flops_per_token(config, args.seq_length, vocab_size)
        self.peak = peak_flops_per_device(args.peak_tflops)
        run_config = dict(vars(args), world_size=setup.world, data_parallel_size=layout.dp(setup.world),
                          num_microbatches=setup.num_micro, layout=layout.describe(setup.world), vocab_size=vocab_size,
                          tokenizer_vocab_size=tokenizer.vocab_size, bf16=setup.bf16,
                          use_distributed_optimizer=setup.dist_opt, num_parameters=num_params,
                          flops_per_token=self.flops_tok, device=str(compat.device()), data=data,
                          tokenizer=str(getattr(tokenizer, "name", tokenizer)), model=setup.model_fields,
                          arguments=run_arguments(args), **record_paths(args))  # paths that hold from any folder
        if resume is not None and schedule_mode == schedule.CHECKPOINT:
            run_config.update(followed_schedule(self.scheduler))
        self.monitor = Monitor(args, run_config, self.iteration, resumed=resume is not None, is_logger=rank == 0)
        log(f"megatron-sat: {megatron_lm_flags.describe_arch(args.arch)}, {num_params:,} parameters, "
            f"{layout.describe(setup.world)}, "
            f"{setup.num_micro} micro-batches x {args.micro_batch_size} x {args.seq_length} tokens per rank, "
            f"{'bf16' if setup.bf16 else 'fp16' if args.fp16 else 'fp32'} on {setup.world} x {compat.device().type}")
        self.monitor.start_bar()  # after the banner: the bar gets a line of its own
        self.gates = GateTelemetry(self.chunks, config.num_layers, compat.device()) if archs.get(args.arch).gated else None
        self.saver = ckpt.Saver(args.save, self.chunks, self.optimizer, self.scheduler, async_save=args.async_save,
                                retain_interval=args.save_retain_interval, log=log,
                                debug_delay_s=args.debug_save_delay, debug_fail_at=args.debug_fail_save_at)
        self.last_saved = self.iteration if resume is not None else None
        self.tasks = task_runner(args, self.chunks, tokenizer, log) if task_runner and args.eval_tasks else None
        self.profiler = StepProfiler(args, rank, log)
        if args.manual_gc:  # Megatron-LM's --manual-gc: no automatic collections, gc.collect() on our schedule
            gc.disable()

    def _restore(self, resume, pretrained):
        """(iteration, consumed samples) after loading what --load or --pretrained-checkpoint hold."""
        args, log = self.args, self.log
        if resume is not None:
            loaded = ckpt.restore(resume, self.chunks, self.optimizer, self.scheduler,
                                  align=lambda state: schedule.align_param_groups(state, self.optimizer, self.schedule_mode),
                                  load_optim=not args.no_load_optim, load_rng=not args.no_load_rng)
            if args.no_load_optim:  # the optimizer's main (fp32) copies were made from the init
                self.optimizer.reload_model_params()
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
            directory = ckpt.load_weights(pretrained, self.chunks)
            self.optimizer.reload_model_params()  # the optimizer's main (fp32) copies were made from the init
            log(f"initialised from the weights of {directory}{' (--finetune)' if args.finetune else ''}: new "
                "optimizer state, LR schedule, RNG and data order")
        return 0, 0

    # ------------------------------------------------------------------------------------------
    def run(self) -> int:
        args = self.args
        self.watchdog = Watchdog(args.save, torch.distributed.get_rank(), self.setup.world, 60 * self.hang_minutes,
                                 log=self.log).start()
        if self.watchdog.enabled and self.hang_minutes > HEADROOM * self.group_minutes * (1 + 1e-9):
            self.log(f"warning: --hang-timeout-minutes {self.hang_minutes:g} is above {HEADROOM:g} x "
                     f"--distributed-timeout-minutes {self.group_minutes:g}: a hung collective may time out first; "
                     f"under gloo the watchdog still reports it (exit 75), under NCCL the process is aborted without "
                     f"the report. Give at most {HEADROOM * self.group_minutes:g} (docs/reliability_signals.md)")
        try:
            with self.profiler.oom_snapshot():
                return self._run()
        except RuntimeError as e:  # a collective that timed out before the watchdog fired: reported as a hang
            if self.watchdog.enabled and is_collective_timeout(e):
                self.watchdog.collective_failed(e, self.group_minutes)
            raise
        finally:
            self.profiler.close()
            self.watchdog.close()

    def _run(self) -> int:
        args = self.args
        start_consumed, t_train, self.step_time_total = self.consumed, time.time(), 0.0
        try:
            exit_reason = self._train()
            train_time = time.time() - t_train
            if args.save and self.last_saved != self.iteration and (args.save_final or exit_reason):
                self._save()
            self.watchdog.beat("finishing the last save")
            self.saver.finalize()
        except NonFiniteLoss as e:
            self.monitor.close(status="failed", reason=f"{e} at iteration {self.iteration + 1}")
            self.saver.finalize()  # a pending asynchronous save holds a good step
            self.log(f"error: {e} at iteration {self.iteration + 1}; stopping without saving. Last good "
                     f"checkpoint: {_describe_checkpoint(args.save)}")
            return 3
        except ckpt.SaveFailed as e:
            self.monitor.close(status="failed", reason=str(e))
            self.log(f"megatron-sat-train: error: {e}")
            return 4
        if exit_reason:
            self.monitor.close(status="stopped", reason=exit_reason)
            self.log(f"stopping at iteration {self.iteration}/{args.train_iters} ({exit_reason}); "
                     f"resume with --load {args.save}")
            return 0
        val_loss = self._evaluate() if (args.eval_interval or args.eval_iters) else None
        self._evaluate_test()
        if self.tasks is not None:
            self._evaluate_tasks()
        self.monitor.close()
        tps = (self.consumed - start_consumed) * args.seq_length / max(self.step_time_total, 1e-9)
        self.log(f"done: {self.iteration} steps in {train_time:.0f} s | {tps:,.0f} tokens/s (training steps only) | "
                 f"final validation loss {'n/a' if val_loss is None else f'{val_loss:.4f}'}")
        if args.save:
            self.log(f"checkpoint: {_describe_checkpoint(args.save)}\nmetrics: {self.monitor.metrics_path}\n"
                     f"config: {os.path.join(args.save, 'config.json')}")
        return 0

    def _train(self) -> Optional[str]:
        """Step until --train-iters; returns why it stopped early, or None."""
        args, setup = self.args, self.setup
        window = Window()
        while self.iteration < args.train_iters:
            self.watchdog.beat(f"step {self.iteration + 1}")
            self.saver.poll()  # commits an asynchronous save whose files are written
            t0 = time.time()
            time_up = (args.exit_duration_in_mins is not None and torch.distributed.get_rank() == 0
                       and time.time() - self.t_start > 60 * args.exit_duration_in_mins)
            forward = self._nan_forward_step if args.debug_inject_nan_at_step == self.iteration + 1 else gpt_forward_step
            # --rampup-batch-size: this step's global batch (else the full one), in whole micro-batches x DP
            per_micro = args.global_batch_size // setup.num_micro  # micro-batch x data-parallel size
            num_micro = max(1, megatron_lm_flags.global_batch_at(args, self.consumed) // per_micro)
            batch = num_micro * per_micro
            self.profiler.before_step(self.iteration + 1)
            result = train_step(self.chunks, self.optimizer, setup.config, self.train_iter,
                                num_microbatches=num_micro, seq_length=args.seq_length,
                                micro_batch_size=args.micro_batch_size, scheduler=self.scheduler,
                                forward_step_func=forward, stop_requested=self.stop.received is not None,
                                time_up=time_up, sync_timers=args.log_timers_to_tensorboard,
                                scheduler_increment=1 if batch == args.global_batch_size else batch / args.global_batch_size)
            self.iteration += 1
            self.consumed += batch
            self.profiler.after_step(self.iteration)
            self._collect_memory()
            dt = time.time() - t0
            self.step_time_total += dt
            window.add(dt, result, batch)
            if args.log_timers_to_tensorboard:
                self._add_phases(window, result, num_micro)
            self.monitor.advance()
            exit_reason = None
            if result.stop_signals:
                exit_reason = "signal " + (self.stop.received or "from another rank")
            elif result.time_up:
                exit_reason = f"--exit-duration-in-mins {args.exit_duration_in_mins}"
            elif args.exit_interval and self.iteration % args.exit_interval == 0 and self.iteration < args.train_iters:
                exit_reason = f"--exit-interval {args.exit_interval}"
            if self.iteration % args.log_interval == 0 or self.iteration == args.train_iters or exit_reason:
                self._log(window, result.lr)
                window = Window()
            if args.eval_interval and self.iteration % args.eval_interval == 0 and self.iteration < args.train_iters:
                self._evaluate()
            if self.tasks is not None and args.eval_tasks_interval and self.iteration % args.eval_tasks_interval == 0 \
                    and self.iteration < args.train_iters:
                self._evaluate_tasks()
            if exit_reason:
                return exit_reason
            if args.save and args.save_interval and self.iteration % args.save_interval == 0:
                self._save()
        return None

    def _add_phases(self, window: Window, result, num_micro: int) -> None:
        """--log-timers-to-tensorboard: this step's phases (seconds, rank 0's view) into the window."""
        data = self.train_iter.take()
        fb = result.forward_backward_s - data
        layout = self.setup.layout
        phases = dict(data=data, forward_backward=fb, optimizer=result.optimizer_s,
                      pipeline_bubble_est=fb * bubble_fraction(layout.pp, num_micro, layout.vpp))
        for name, seconds in phases.items():
            window.phases[name] = window.phases.get(name, 0.0) + seconds

    def _per_device(self, tps: float) -> dict:
        """Throughput per device next to the job's, and the model TFLOP/s each device delivers."""
        world = self.setup.world
        return dict(tokens_per_s_per_device=tps / world, tflops_per_device=self.flops_tok * tps / world / 1e12)

    def _log(self, window: Window, lr: float) -> None:
        args = self.args
        step_time = window.time / window.steps
        tps = window.samples * args.seq_length / window.time
        mfu = None if self.peak is None else self.flops_tok * tps / (self.peak * self.setup.world)
        updated = window.steps - window.skipped
        record = dict(step=self.iteration, loss=window.loss / window.steps, lr=lr,
                      grad_norm=window.grad / updated if updated else None,
                      tokens_per_s=tps, mfu=mfu, step_time_s=step_time, consumed_samples=self.consumed,
                      **self._per_device(tps))
        record.update({f"timers_{k}_s": v / window.steps for k, v in window.phases.items()})
        if args.fp16:  # Megatron-LM's names: the steps skipped in this line's window, the scale after them
            record.update(skipped_iters=window.skipped, loss_scale=self.optimizer.get_loss_scale().item())
        if self.gates is not None:
            record.update(self.gates.collect() or {})
        self.monitor.log_train(record, eta_s=step_time * (args.train_iters - self.iteration))

    def _collect_memory(self) -> None:
        """--manual-gc-interval and --empty-unused-memory-level (Megatron-LM's meanings) after a step."""
        args = self.args
        if args.manual_gc and args.manual_gc_interval and self.iteration % args.manual_gc_interval == 0:
            gc.collect()
        if args.empty_unused_memory_level and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _evaluate_test(self) -> Optional[float]:
        """The test split (--split's third share or --test-data-path), scored once at the end of training as
        Megatron-LM does; metrics.jsonl gets {"step", "test_loss", "test_ppl"}."""
        return self._score(self.test_iters(), "test pass", self.monitor.log_test)

    def _evaluate(self) -> Optional[float]:
        return self._score(self.valid_iters(), "evaluation pass", self.monitor.log_eval)

    def _score(self, it, what: str, log) -> Optional[float]:
        """The mean loss of the evaluation passes over iterator `it` (None: no such split), logged with `log`."""
        if it is None:
            return None
        progress = lambda i: self.watchdog.beat(f"{what} {i + 1} after step {self.iteration}")  # noqa: E731
        with self.gates.paused() if self.gates else contextlib.nullcontext():
            loss = evaluate(self.chunks, self.optimizer, self.setup.config, it, iterations=self.setup.eval_passes,
                            num_microbatches=self.setup.eval_micro, seq_length=self.args.seq_length,
                            micro_batch_size=self.args.micro_batch_size, progress=progress)
        log(self.iteration, loss)
        return loss

    def _evaluate_tasks(self) -> None:
        """--eval-tasks: lm-eval tasks on the model as it is (a failing task is reported, training goes on)."""
        self.watchdog.pause("lm-eval tasks")  # of unknown length: the process groups' timeout still applies
        try:
            with self.gates.paused() if self.gates else contextlib.nullcontext():
                scores, failures = self.tasks(self.iteration)
        finally:
            self.watchdog.pause(None)
        self.monitor.log_tasks(self.iteration, scores, failures)

    def _save(self) -> None:
        if self.args.manual_gc:
            gc.collect()
        self.watchdog.beat(f"save of iteration {self.iteration}")
        self.saver.save(self.iteration, consumed_samples=self.consumed, args=dict(vars(self.args)),
                        model=self.setup.model_fields)
        self.last_saved = self.iteration

    @staticmethod
    def _nan_forward_step(data_iterator, model):
        """--debug-inject-nan-at-step: this step's loss is NaN (the NaN stop is tested like a feature)."""
        output, loss_func = gpt_forward_step(data_iterator, model)

        def nan_loss(output_tensor):
            total, count, report = loss_func(output_tensor)
            return total * float("nan"), count, {"lm loss": report["lm loss"] * float("nan")}

        return output, nan_loss


def run_arguments(args) -> dict:
    """The run's resolved arguments as a config file holds them (config.json's "arguments": --config reads it)."""
    return config_dict(args, build_parser())


def _describe_checkpoint(save) -> str:
    last = latest_iteration(save) if save and os.path.isdir(save) else None
    return f"{checkpoint_dir(save, last)} (iteration {last})" if last is not None else "none"
