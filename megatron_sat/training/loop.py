"""The training loop of a built run (trainer.build_loop builds it from the arguments): step -> log -> evaluate ->
save, until --train-iters or told to stop (signals, --exit-duration-in-mins, --exit-interval: save and exit 0),
watched for hangs (watchdog.py).

    loop = Loop(settings, setup, parts, stop, t_start, log)   # settings: LoopSettings, parts: Parts
    exit_code = loop.run()

The loop reads no argument namespace: LoopSettings holds the run's settings it reads while it trains, Parts the
built objects (model chunks, optimizer, scheduler, data, monitor, saver, ...), trainer.Setup the model config and
layout. Exit codes as trainer.train: 0 done or stopped, 3 NaN/Inf loss, 4 a checkpoint could not be written.
"""

import contextlib
import gc
import os
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch

from megatron_sat.training import checkpointing as ckpt
from megatron_sat.training.megatron_lm_flags import global_batch_at
from megatron_sat.training.profiler import bubble_fraction
from megatron_sat.training.run_folder import checkpoint_dir, latest_iteration
from megatron_sat.training.signals import StopSignal
from megatron_sat.training.step import NonFiniteLoss, evaluate, gpt_forward_step, train_step
from megatron_sat.training.watchdog import HEADROOM, Watchdog, is_collective_timeout


@dataclass(frozen=True)
class LoopSettings:
    """The run's settings the loop reads while it trains, under the flags' names (trainer.loop_settings makes it
    from the arguments, once)."""

    save: Optional[str]                       # the run folder (checkpoints, config.json, metrics.jsonl)
    train_iters: int
    global_batch_size: int
    rampup_batch_size: Optional[list]         # Megatron-LM's START INCR SAMPLES (megatron_lm_flags.global_batch_at)
    micro_batch_size: int
    seq_length: int
    log_interval: int
    eval_interval: Optional[int]
    eval_iters: int
    eval_tasks_interval: Optional[int]
    save_interval: Optional[int]
    save_final: bool
    exit_interval: Optional[int]
    exit_duration_in_mins: Optional[float]
    fp16: bool
    manual_gc: bool
    manual_gc_interval: int
    empty_unused_memory_level: int
    log_timers_to_tensorboard: bool
    debug_inject_nan_at_step: Optional[int]
    hang_minutes: float                       # the watchdog's (watchdog.timeouts)
    group_minutes: float                      # the process groups' timeout
    arguments: dict = field(default_factory=dict)  # every argument, as each checkpoint records them (vars(args))


class Parts(NamedTuple):
    """The built run the loop trains (trainer.build_loop)."""

    chunks: list                  # the model chunks (one per virtual pipeline stage)
    optimizer: object
    scheduler: object
    train_iter: object            # profiler.TimedIterator over the training batches
    valid_iters: Callable         # () -> an iterator over the validation split, or None
    test_iters: Callable          # () -> an iterator over the test split, or None
    monitor: object               # monitor.Monitor
    saver: object                 # checkpointing.Saver
    gates: Optional[object]       # gate_telemetry.GateTelemetry (gated archs), or None
    tasks: Optional[object]       # --eval-tasks' runner, or None
    profiler: object              # profiler.StepProfiler
    flops_per_token: float
    peak_flops: Optional[float]   # per device (MFU), None when unknown
    iteration: int                # where training starts (a resume's iteration, else 0)
    consumed: int                 # samples consumed before it
    resumed: bool


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


class Loop:
    """The built run: run() trains it."""

    def __init__(self, settings: LoopSettings, setup, parts: Parts, stop: StopSignal, t_start: float, log):
        """settings: what the loop reads of the arguments; setup: trainer.configure's model config and layout;
        parts: the built model, optimizer, scheduler, data, monitor, saver, ...; stop: the signals; t_start: when the
        job started (--exit-duration-in-mins); log: prints on global rank 0."""
        self.settings, self.setup, self.stop, self.t_start, self.log = settings, setup, stop, t_start, log
        self.chunks, self.optimizer, self.scheduler = parts.chunks, parts.optimizer, parts.scheduler
        self.train_iter, self.valid_iters, self.test_iters = parts.train_iter, parts.valid_iters, parts.test_iters
        self.monitor, self.saver, self.gates, self.tasks = parts.monitor, parts.saver, parts.gates, parts.tasks
        self.profiler, self.flops_tok, self.peak = parts.profiler, parts.flops_per_token, parts.peak_flops
        self.iteration, self.consumed = parts.iteration, parts.consumed
        self.last_saved = self.iteration if parts.resumed else None
        if settings.manual_gc:  # Megatron-LM's --manual-gc: no automatic collections, gc.collect() on our schedule
            gc.disable()

    def run(self) -> int:
        conf = self.settings
        self.watchdog = Watchdog(conf.save, torch.distributed.get_rank(), self.setup.world, 60 * conf.hang_minutes,
                                 log=self.log).start()
        if self.watchdog.enabled and conf.hang_minutes > HEADROOM * conf.group_minutes * (1 + 1e-9):
            self.log(f"warning: --hang-timeout-minutes {conf.hang_minutes:g} is above {HEADROOM:g} x "
                     f"--distributed-timeout-minutes {conf.group_minutes:g}: a hung collective may time out first; "
                     f"under gloo the watchdog still reports it (exit 75), under NCCL the process is aborted without "
                     f"the report. Give at most {HEADROOM * conf.group_minutes:g} (docs/reliability_signals.md)")
        try:
            with self.profiler.oom_snapshot():
                return self._run()
        except RuntimeError as e:  # a collective that timed out before the watchdog fired: reported as a hang
            if self.watchdog.enabled and is_collective_timeout(e):
                self.watchdog.collective_failed(e, conf.group_minutes)
            raise
        finally:
            self.profiler.close()
            self.watchdog.close()

    def _run(self) -> int:
        conf = self.settings
        start_consumed, t_train, self.step_time_total = self.consumed, time.time(), 0.0
        try:
            exit_reason = self._train()
            train_time = time.time() - t_train
            if conf.save and self.last_saved != self.iteration and (conf.save_final or exit_reason):
                self._save()
            self.watchdog.beat("finishing the last save")
            self.saver.finalize()
        except NonFiniteLoss as e:
            self.monitor.close(status="failed", reason=f"{e} at iteration {self.iteration + 1}")
            self.saver.finalize()  # a pending asynchronous save holds a good step
            self.log(f"error: {e} at iteration {self.iteration + 1}; stopping without saving. Last good "
                     f"checkpoint: {describe_checkpoint(conf.save)}")
            return 3
        except ckpt.SaveFailed as e:
            self.monitor.close(status="failed", reason=str(e))
            self.log(f"megatron-sat-train: error: {e}")
            return 4
        if exit_reason:
            self.monitor.close(status="stopped", reason=exit_reason)
            self.log(f"stopping at iteration {self.iteration}/{conf.train_iters} ({exit_reason}); "
                     f"resume with --load {conf.save}")
            return 0
        val_loss = self._evaluate() if (conf.eval_interval or conf.eval_iters) else None
        self._evaluate_test()
        if self.tasks is not None:
            self._evaluate_tasks()
        self.monitor.close()
        tps = (self.consumed - start_consumed) * conf.seq_length / max(self.step_time_total, 1e-9)
        self.log(f"done: {self.iteration} steps in {train_time:.0f} s | {tps:,.0f} tokens/s (training steps only) | "
                 f"final validation loss {'n/a' if val_loss is None else f'{val_loss:.4f}'}")
        if conf.save:
            self.log(f"checkpoint: {describe_checkpoint(conf.save)}\nmetrics: {self.monitor.metrics_path}\n"
                     f"config: {os.path.join(conf.save, 'config.json')}")
        return 0

    def _train(self) -> Optional[str]:
        """Step until --train-iters; returns why it stopped early, or None."""
        conf, setup = self.settings, self.setup
        window = Window()
        while self.iteration < conf.train_iters:
            self.watchdog.beat(f"step {self.iteration + 1}")
            self.saver.poll()  # commits an asynchronous save whose files are written
            t0 = time.time()
            time_up = (conf.exit_duration_in_mins is not None and torch.distributed.get_rank() == 0
                       and time.time() - self.t_start > 60 * conf.exit_duration_in_mins)
            forward = self._nan_forward_step if conf.debug_inject_nan_at_step == self.iteration + 1 else gpt_forward_step
            # --rampup-batch-size: this step's global batch (else the full one), in whole micro-batches x DP
            per_micro = conf.global_batch_size // setup.num_micro  # micro-batch x data-parallel size
            num_micro = max(1, global_batch_at(conf, self.consumed) // per_micro)
            batch = num_micro * per_micro
            self.profiler.before_step(self.iteration + 1)
            result = train_step(self.chunks, self.optimizer, setup.config, self.train_iter,
                                num_microbatches=num_micro, seq_length=conf.seq_length,
                                micro_batch_size=conf.micro_batch_size, scheduler=self.scheduler,
                                forward_step_func=forward, stop_requested=self.stop.received is not None,
                                time_up=time_up, sync_timers=conf.log_timers_to_tensorboard,
                                scheduler_increment=1 if batch == conf.global_batch_size else batch / conf.global_batch_size)
            self.iteration += 1
            self.consumed += batch
            self.profiler.after_step(self.iteration)
            self._collect_memory()
            dt = time.time() - t0
            self.step_time_total += dt
            window.add(dt, result, batch)
            if conf.log_timers_to_tensorboard:
                self._add_phases(window, result, num_micro)
            self.monitor.advance()
            exit_reason = None
            if result.stop_signals:
                exit_reason = "signal " + (self.stop.received or "from another rank")
            elif result.time_up:
                exit_reason = f"--exit-duration-in-mins {conf.exit_duration_in_mins}"
            elif conf.exit_interval and self.iteration % conf.exit_interval == 0 and self.iteration < conf.train_iters:
                exit_reason = f"--exit-interval {conf.exit_interval}"
            if self.iteration % conf.log_interval == 0 or self.iteration == conf.train_iters or exit_reason:
                self._log(window, result.lr)
                window = Window()
            if conf.eval_interval and self.iteration % conf.eval_interval == 0 and self.iteration < conf.train_iters:
                self._evaluate()
            if self.tasks is not None and conf.eval_tasks_interval and self.iteration % conf.eval_tasks_interval == 0 \
                    and self.iteration < conf.train_iters:
                self._evaluate_tasks()
            if exit_reason:
                return exit_reason
            if conf.save and conf.save_interval and self.iteration % conf.save_interval == 0:
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
        conf = self.settings
        step_time = window.time / window.steps
        tps = window.samples * conf.seq_length / window.time
        mfu = None if self.peak is None else self.flops_tok * tps / (self.peak * self.setup.world)
        updated = window.steps - window.skipped
        record = dict(step=self.iteration, loss=window.loss / window.steps, lr=lr,
                      grad_norm=window.grad / updated if updated else None,
                      tokens_per_s=tps, mfu=mfu, step_time_s=step_time, consumed_samples=self.consumed,
                      **self._per_device(tps))
        record.update({f"timers_{k}_s": v / window.steps for k, v in window.phases.items()})
        if conf.fp16:  # Megatron-LM's names: the steps skipped in this line's window, the scale after them
            record.update(skipped_iters=window.skipped, loss_scale=self.optimizer.get_loss_scale().item())
        if self.gates is not None:
            record.update(self.gates.collect() or {})
        self.monitor.log_train(record, eta_s=step_time * (conf.train_iters - self.iteration))

    def _collect_memory(self) -> None:
        """--manual-gc-interval and --empty-unused-memory-level (Megatron-LM's meanings) after a step."""
        conf = self.settings
        if conf.manual_gc and conf.manual_gc_interval and self.iteration % conf.manual_gc_interval == 0:
            gc.collect()
        if conf.empty_unused_memory_level and torch.cuda.is_available():
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
                            num_microbatches=self.setup.eval_micro, seq_length=self.settings.seq_length,
                            micro_batch_size=self.settings.micro_batch_size, progress=progress)
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
        if self.settings.manual_gc:
            gc.collect()
        self.watchdog.beat(f"save of iteration {self.iteration}")
        self.saver.save(self.iteration, consumed_samples=self.consumed, args=dict(self.settings.arguments),
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


def describe_checkpoint(save) -> str:
    """The newest complete checkpoint of run folder `save` and its iteration, or 'none'."""
    last = latest_iteration(save) if save and os.path.isdir(save) else None
    return f"{checkpoint_dir(save, last)} (iteration {last})" if last is not None else "none"
