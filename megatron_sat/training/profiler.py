"""Profiling inside a training run, with Megatron-LM's flags (training/megatron_lm_flags.py defines them).

    --profile --use-pytorch-profiler --profile-step-start A --profile-step-end B
        torch.profiler over steps A..B (1-based, as the step line counts) on the ranks of --profile-ranks: one
        trace RUN/profile/<host>_<pid>.<time>.pt.trace.json (Chrome trace format; TensorBoard's profiler
        plugin reads the folder, Perfetto and chrome://tracing the file), each step a "ProfilerStep#N" range
    --profile (without --use-pytorch-profiler)
        the nsys capture range of Megatron-LM: cudaProfilerStart before step A, cudaProfilerStop after step B
        (run under `nsys profile --capture-range=cudaProfilerApi`); on CPU nothing is recorded, and it says so
    --record-memory-history
        CUDA allocator history (torch.cuda.memory._record_memory_history); the snapshot is written on a CUDA
        out-of-memory error and at the end (--memory-snapshot-path, default RUN/profile/memory_snapshot_rankR.pickle;
        open it at https://pytorch.org/memory_viz). GPU only: on CPU it says so once and records nothing.
"""

import contextlib
import os
import time
from typing import Iterator, Optional

import torch


class StepProfiler:
    """before_step(n) / after_step(n) around each step; oom_snapshot() around the loop; close() at the end."""

    def __init__(self, args, rank: int, log=print):
        self.args, self.rank, self.log = args, rank, log
        self.folder = os.path.join(args.save, "profile")
        self.torch_profiler: Optional[torch.profiler.profile] = None
        self.nsys_active = self.done = False
        self.wanted = bool(args.profile) and rank in args.profile_ranks
        self.memory_history = bool(args.record_memory_history) and torch.cuda.is_available()
        if args.profile and not args.use_pytorch_profiler and not torch.cuda.is_available():
            self.wanted = False
            if rank == 0:
                log("--profile without --use-pytorch-profiler marks an nsys capture range (CUDA); nothing is recorded "
                    "on CPU: add --use-pytorch-profiler for a torch profiler trace")
        if args.record_memory_history and not torch.cuda.is_available() and rank == 0:
            log("--record-memory-history records the CUDA allocator: no GPU here, nothing recorded")
        if self.memory_history:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def before_step(self, step: int) -> None:
        """Before step `step` (1-based): the torch profiler starts with this process's first step (its schedule
        records --profile-step-start..end, warming up one step before), the nsys range at the start step."""
        if not self.wanted or step > self.args.profile_step_end:
            return
        if self.args.use_pytorch_profiler and self.torch_profiler is None and not self.done:
            os.makedirs(self.folder, exist_ok=True)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.torch_profiler = torch.profiler.profile(
                activities=activities, schedule=self._schedule, record_shapes=True, profile_memory=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(self.folder))
            # its step counter is the trainer's (a resumed run starts past 1): the trace's ProfilerStep#N is step N
            self.torch_profiler.step_num = step
            self.torch_profiler.current_action = self._schedule(step)
            self.torch_profiler.start()
        elif not self.args.use_pytorch_profiler and step == self.args.profile_step_start:
            torch.cuda.cudart().cudaProfilerStart()
            self.nsys_active = True

    def _schedule(self, step: int) -> "torch.profiler.ProfilerAction":
        """torch.profiler's action for step `step`: warm up the step before the range, record it, save at its end."""
        action = torch.profiler.ProfilerAction
        first, last = self.args.profile_step_start, self.args.profile_step_end
        if step == first - 1:
            return action.WARMUP
        if first <= step < last:
            return action.RECORD
        return action.RECORD_AND_SAVE if step == last else action.NONE

    def after_step(self, step: int) -> None:
        if not self.wanted or step > self.args.profile_step_end:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.step()  # after the last step: writes the trace (on_trace_ready)
        if step == self.args.profile_step_end:
            self._stop()

    def _stop(self) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler, self.done = None, True
            self.log(f"profile: torch profiler trace of steps {self.args.profile_step_start}-"
                     f"{self.args.profile_step_end} in {self.folder} (tensorboard --logdir {self.folder}, or the "
                     ".pt.trace.json file in Perfetto)")
        if self.nsys_active:
            torch.cuda.cudart().cudaProfilerStop()
            self.nsys_active = False

    @contextlib.contextmanager
    def oom_snapshot(self):
        """Around the training loop: on a CUDA out-of-memory error write the memory snapshot, then re-raise."""
        try:
            yield
        except torch.cuda.OutOfMemoryError:
            self._dump_snapshot("CUDA out of memory")
            raise

    def _dump_snapshot(self, why: str) -> None:
        if not self.memory_history:
            return
        path = self.args.memory_snapshot_path or os.path.join(self.folder, f"memory_snapshot_rank{self.rank}.pickle")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.cuda.memory._dump_snapshot(path)
        self.log(f"memory snapshot ({why}): {path} (open it at https://pytorch.org/memory_viz)")

    def close(self) -> None:
        """The end of the run (also when it stops early): a trace still open is written, the snapshot taken."""
        if self.torch_profiler is not None or self.nsys_active:
            self._stop()
        if self.memory_history:
            self._dump_snapshot("end of training")
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory_history = False


class TimedIterator:
    """The training data iterator, timing how long each next() takes (the step's data phase, which runs inside
    forward-backward: the timers report forward-backward without it)."""

    def __init__(self, iterator: Iterator):
        self.iterator, self.seconds = iterator, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return next(self.iterator)
        finally:
            self.seconds += time.perf_counter() - t0

    def take(self) -> float:
        """Seconds spent in next() since the last take()."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def bubble_fraction(pp: int, num_microbatches: int, virtual_stages: Optional[int] = None) -> float:
    """The 1F1B schedule's idle share of forward-backward, (PP - 1) / (m x v + PP - 1) with m micro-batches and v
    virtual stages per rank (Narayanan et al. 2021): an analytic estimate, not a measurement; 0 at PP1."""
    v = virtual_stages or 1
    return (pp - 1) / (num_microbatches * v + pp - 1)
