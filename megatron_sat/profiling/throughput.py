"""Measure the real training step (forward, backward, optimizer) of several archs in one process.

This is the worker of tools/profile_throughput.py (which parses the command line, launches this
module once per arch or once for all, and writes the report: megatron_sat/profiling/report.py).
It can be run by hand on a spec file that the tool writes, e.g.

    python -m megatron_sat.profiling.throughput --spec runs/profile/spec.json --out raw.json
    torchrun --nproc-per-node 4 -m megatron_sat.profiling.throughput --spec spec.json --out raw.json

What one run does, every rank:
  1. Megatron's process groups for the layout; then per arch, in turn: the model exactly as the
     trainer builds it (training/setup.py model_config -> build_model -> Float16Module when bf16 -> Megatron DDP ->
     Megatron AdamW with clipping), `warmup` optimizer steps (Adam's state is allocated here), and
     one untimed counting step: saved-activation bytes of the first micro-batch's forward
     (autograd saved-tensor hooks) and the bytes every rank sends over the pipeline (a counting
     P2PCommunicator, so V1's extra channels are measured, not assumed).
  2. `steps` measured rounds; each round runs one optimizer step per arch in an order that
     alternates (A B C, C B A, ...), so machine drift falls on every arch alike. A step's time is
     the slowest rank's (an all-reduce MAX at the end). The process CPU time of each step is kept
     too: on a shared CPU machine it hardly moves when other jobs steal the cores, unlike wall time.
  3. Memory: GPU peak allocated / reserved (reset after warm-up, max over ranks); on CPU the peak
     RSS (VmHWM) and the RSS before any model was built. These are per process: they describe one
     arch only when the run holds one arch (the tool's default `--mode processes`). With several
     archs in one process the GPU figure is this arch's resident bytes (measured when it was built
     and warmed up) plus its largest transient peak above what was allocated before its step.
  4. Optional: DeepSpeed's flops profiler over one forward pass and torch.profiler traces of
     chosen measured steps (megatron_sat/profiling/detail.py).
Returns (on global rank 0) a dict of raw numbers per arch; the report derives the rest.
"""

import argparse
import json
import os
import resource
import time
from contextlib import contextmanager

import torch
from megatron.core import parallel_state

from megatron_sat.model.flops import flops_breakdown, flops_per_token
from megatron_sat.parallel import pipeline
from megatron_sat.parallel.layout import Layout, initialize, validate
from megatron_sat.parallel.process_group import init_from_env
from megatron_sat.profiling import detail
from megatron_sat.profiling.settings import arch_args
from megatron_sat.profiling.step_benchmark import SavedBytes, alternating_order, sync
from megatron_sat.training.checkpointing import unwrap
from megatron_sat.training.setup import model_config, precision_and_layout
from megatron_sat.training.step import gpt_forward_step, setup_model_and_optimizer, train_step

MIB = 2 ** 20


def _rss_bytes(field: str = "VmRSS") -> int:
    """VmRSS (now) or VmHWM (peak) of this process from /proc; ru_maxrss where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextmanager
def count_pipeline_bytes(counter: dict):
    """Count what every pipeline send of megatron_sat.parallel.pipeline carries (bytes, messages, widest).

    forward_backward builds a WideP2PCommunicator per step; inside this block it builds a subclass
    that adds up the tensors handed to `_communicate` (the one place where the 1F1B and the
    interleaved schedules send), after V1's channels were appended by the model.
    """
    base = pipeline.WideP2PCommunicator

    class Counting(base):
        def _communicate(self, *, tensor_send_next=None, tensor_send_prev=None, **kwargs):
            for t in (tensor_send_next, tensor_send_prev):
                if t is not None:
                    size = t.numel() * t.element_size()
                    counter["bytes"] = counter.get("bytes", 0) + size
                    counter["messages"] = counter.get("messages", 0) + 1
                    if size > counter.get("message_bytes", 0):
                        counter.update(message_bytes=size, message_shape=list(t.shape), dtype=str(t.dtype))
            return super()._communicate(tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
                                        **kwargs)

    pipeline.WideP2PCommunicator = Counting
    try:
        yield counter
    finally:
        pipeline.WideP2PCommunicator = base


def mock_batches(spec: dict, num_micro: int, seed: int) -> list:
    """This rank's micro-batches of random tokens (the same on every rank; data is not measured)."""
    g = torch.Generator().manual_seed(seed)
    mbs, seq, vocab = spec["micro_batch_size"], spec["seq_length"], spec["vocab_size"]
    out = []
    for _ in range(num_micro):
        data = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
        out.append(dict(tokens=data[:, :-1].contiguous(), labels=data[:, 1:].contiguous(),
                        loss_mask=torch.ones(mbs, seq), position_ids=torch.arange(seq).unsqueeze(0).expand(mbs, -1)))
    return out


class ArchRun:
    """One arch's model chunks, optimizer and measurements in this process."""

    def __init__(self, arch: str, spec: dict, layout, world: int):
        self.arch, self.spec = arch, spec  # arch: a label, e.g. 'satformer:separate' (megatron_sat.archs.arch_label)
        args = arch_args(argparse.Namespace(**spec["arguments"]), arch)  # the trainer's arguments (settings.py)
        dtype = precision_and_layout(args).dtype
        self.num_micro = spec["global_batch_size"] // (spec["micro_batch_size"] * layout.dp(world))
        self.config = model_config(args, layout, dtype, training=True)  # as the trainer builds it
        validate(layout, self.config, world, seq_length=spec["seq_length"], num_microbatches=self.num_micro,
                 backend=spec.get("backend") or "local")
        torch.manual_seed(spec["seed"])
        self.chunks, self.params, self.optimizer = setup_model_and_optimizer(  # as the trainer builds its model
            self.config, vocab_size=spec["vocab_size"], max_sequence_length=spec["seq_length"],
            backend=spec.get("backend"), rotary_base=spec.get("rotary_base", 10000),
            use_distributed_optimizer=spec["use_distributed_optimizer"], lr=spec.get("lr", 1e-4), min_lr=0.0,
            clip_grad=1.0)
        self.inner = [unwrap(c) for c in self.chunks]  # the GPTModels (for the flops profiler)
        self.flops_per_token = flops_per_token(self.config, spec["seq_length"], spec["vocab_size"])
        self.flops_breakdown = flops_breakdown(self.config, spec["seq_length"], spec["vocab_size"])
        self.data = mock_batches(spec, self.num_micro, spec["seed"])
        self.step_s, self.cpu_s, self.losses = [], [], []  # cpu_s: this process's CPU time per step
        self.resident_bytes = self.transient_bytes = 0
        self.activation_bytes, self.pipeline = 0, {}

    def step(self, forward_step_func=None) -> float:
        """One optimizer step over the step's micro-batches; returns its wall time in seconds."""
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        result = train_step(self.chunks, self.optimizer, self.config, iter(self.data),
                            num_microbatches=self.num_micro, seq_length=self.spec["seq_length"],
                            micro_batch_size=self.spec["micro_batch_size"],
                            forward_step_func=forward_step_func or gpt_forward_step)
        sync()
        self.cpu_s.append(time.process_time() - cpu_start)
        self.losses.append(result.loss)
        return time.perf_counter() - start

    def counting_step(self) -> None:
        """Untimed: saved-activation bytes of the first micro-batch's forward, pipeline bytes of the step."""
        saved = SavedBytes()
        calls = [0]

        def forward_step(data_iterator, model):
            calls[0] += 1
            if calls[0] > 1:
                return gpt_forward_step(data_iterator, model)
            with saved:
                return gpt_forward_step(data_iterator, model)

        counter = {}
        with count_pipeline_bytes(counter):
            self.step(forward_step)
        self.activation_bytes, self.pipeline = saved.bytes, counter


def _gather_max(values: list) -> list:
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()


def _gather_sum(values: list) -> list:
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return t.tolist()


def run(spec: dict, log=print) -> dict:
    """Profile spec["archs"] in this process group (initialised); the raw record on rank 0, None elsewhere."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    gpu = torch.cuda.is_available()
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    layout = Layout(**spec["layout"])
    initialize(layout, seed=spec["seed"])
    rss_start = _rss_bytes()
    runs = {}
    for arch in spec["archs"]:
        before = torch.cuda.memory_allocated() if gpu else 0
        runs[arch] = r = ArchRun(arch, spec, layout, world)
        for _ in range(spec["warmup"]):
            r.step()
        r.counting_step()
        r.optimizer.zero_grad()
        if gpu:
            r.resident_bytes = torch.cuda.memory_allocated() - before
        log(f"built and warmed up {arch}: {r.params:,} parameters, {r.num_micro} micro-batches per step")
    single = len(spec["archs"]) == 1
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    trace = spec.get("trace_steps")  # [first, last] measured steps, 1-based, or None
    tracing_rank = rank == spec.get("trace_rank", 0)
    for i in range(spec["steps"]):
        for arch in alternating_order(spec["archs"], i):
            r = runs[arch]
            if gpu:
                before = torch.cuda.memory_allocated()
                if not single:
                    torch.cuda.reset_peak_memory_stats()
            if trace and trace[0] <= i + 1 <= trace[1] and tracing_rank:
                with detail.torch_trace(spec["out_dir"], f"{arch}_step{i + 1}_rank{rank}"):
                    r.step_s.append(r.step())
            else:
                r.step_s.append(r.step())
            if gpu:
                r.transient_bytes = max(r.transient_bytes, torch.cuda.max_memory_allocated() - before)
        times = "  ".join(f"{a} {runs[a].step_s[-1] * 1e3:.1f} ms" for a in spec["archs"])
        log(f"step {i + 1}/{spec['steps']}: {times}")
    mem = _gather_max([
        torch.cuda.max_memory_allocated() if gpu else 0,
        torch.cuda.max_memory_reserved() if gpu else 0,
        _rss_bytes("VmHWM"),
        float(rss_start),
        _rss_bytes("VmHWM") - rss_start,
    ])
    out = dict(world_size=world, layout=layout.describe(world), device=_device_name(), archs={})
    for arch, r in runs.items():
        flops = detail.flops_profile(r, spec["out_dir"], arch, rank == spec.get("trace_rank", 0)) \
            if spec.get("flops_profile") else None
        step_s = _gather_max(r.step_s)
        cpu_s = _gather_max(r.cpu_s[-len(r.step_s):])  # the measured steps only
        act = _gather_max([float(r.activation_bytes)])[0]
        pipe = _gather_sum([float(r.pipeline.get("bytes", 0)), float(r.pipeline.get("messages", 0))])
        widest = _gather_max([float(r.pipeline.get("message_bytes", 0))])[0]
        gpu_mem = _gather_max([float(r.resident_bytes + r.transient_bytes)])[0]
        loss = _gather_max([r.losses[-1] if r.losses else float("-inf")])[0]
        dp = parallel_state.get_data_parallel_world_size()
        out["archs"][arch] = dict(
            arch=arch, params=r.params, num_microbatches=r.num_micro, step_s=step_s, cpu_s=cpu_s,
            flops_per_token=r.flops_per_token, flops_breakdown=r.flops_breakdown, loss=loss,
            saved_activation_bytes=act,
            gpu_peak_allocated_bytes=(mem[0] if single else gpu_mem) if gpu else None,
            gpu_peak_reserved_bytes=mem[1] if gpu and single else None,
            max_rss_bytes=mem[2] if single else None,
            rss_start_bytes=mem[3] if single else None,
            rss_above_start_bytes=mem[4] if single else None,
            pipeline_bytes_per_microbatch=pipe[0] / (r.num_micro * dp) if layout.pp > 1 else None,
            pipeline_messages_per_microbatch=pipe[1] / (r.num_micro * dp) if layout.pp > 1 else None,
            pipeline_message_bytes=widest if layout.pp > 1 else None,
            pipeline_message_shape=r.pipeline.get("message_shape") if layout.pp > 1 else None,
            deepspeed=flops,
        )
    return out if rank == 0 else None


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="worker of tools/profile_throughput.py (see the module docstring)")
    p.add_argument("--spec", required=True, help="JSON spec written by tools/profile_throughput.py")
    p.add_argument("--out", required=True, help="write the raw record here (global rank 0)")
    args = p.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    init_from_env()
    rank = torch.distributed.get_rank()
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    try:
        record = run(spec, log)
    except ValueError as e:  # an invalid layout for this model: say so plainly
        if rank == 0:
            print(f"error: {e}", flush=True)
        return 2
    if record is not None:
        with open(args.out + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(args.out + ".tmp", args.out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
