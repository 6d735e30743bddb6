"""This machine as the step-time model's hardware: a short micro-benchmark measured at run time.

    from megatron_sat.profiling.cpu_hardware import measure
    m = measure(shapes=[(256, 512, 1536)], threads=1, ranks=2)   # ~20-30 s
    print(m)                                                      # GEMM FLOP/s, memory bandwidth, gloo

One rank is one "device": each rank of a CPU run gets `threads` intra-op threads (the script that checks the model
sets OMP_NUM_THREADS to it). Unlike a GPU node's devices, a CPU's ranks share the chip's caches, memory bus and
clock, so the compute rates are measured twice: by this process alone (what a 1-rank run has) and by `ranks`
processes running the same benchmark at once (what each rank of a `ranks`-rank run has):
    gemm_by_shape    FLOP/s of fp32 GEMMs at the model's shapes, each called as a linear layer calls it: the
                     forward x W^T, the data gradient g W and the weight gradient g^T x (each timed, key
                     "pass mxkxn" in the model's [m, k] x [k, n] terms); gemm_flops their median
    mem_bw           bytes/s of an elementwise add over arrays far larger than the caches (2 reads + 1 write)
    op_overhead_s    the time of one tiny elementwise op (dispatch: what a small model's step is made of)
    attention_flops  causal scaled_dot_product_attention's forward and backward at the model's [b, a, s, d]
    link_latency_s, link_bw   a fit t = latency + bytes / bw of the ring all-reduce's time per step
                     (2 (n - 1) / n x bytes) over message sizes 4 KiB .. 16 MiB, gloo between `ranks` processes
    step_overhead_s  ranks -> what a trainer step spends besides its operators, at that many ranks: not measured
                     here (it takes the trainer; tools/check_steptime_cpu.py measures it on a tiny model and
                     records it with `with_step_overhead`); 0 where not recorded
Written here: no library measures a CPU as a GPU description; the numbers go into steptime's Hardware
(cpu_hardware below; tools/check_steptime_cpu.py).
"""

import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_sat import steptime
from megatron_sat.parallel.process_group import free_port
from megatron_sat.steptime import roofline

COLLECTIVE_BYTES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
PASSES = ("fwd", "dgrad", "wgrad")  # the three GEMMs of a linear layer's forward and backward


@dataclass
class Rates:
    """What one rank computes at, alone or beside others (the module docstring)."""

    gemm_by_shape: Dict[str, float]  # "pass mxkxn" -> FLOP/s
    mem_bw: float  # bytes/s
    op_overhead_s: float
    attention_flops: float  # FLOP/s of causal SDPA forward + backward, in the model's FLOPs (attention_rate)

    @property
    def gemm_flops(self) -> float:
        return statistics.median(self.gemm_by_shape.values())

    def __str__(self) -> str:
        return (f"GEMM {self.gemm_flops / 1e9:.1f} GFLOP/s, memory {self.mem_bw / 1e9:.1f} GB/s, op "
                f"{self.op_overhead_s * 1e6:.1f} us, attention {self.attention_flops / 1e9:.1f} GFLOP/s")


@dataclass
class Measured:
    threads: int
    alone: Rates  # this process alone: a 1-rank run
    link_latency_s: float
    link_bw: float  # bytes/s, of the ring all-reduce's per-rank traffic
    busy: Dict[int, Rates] = field(default_factory=dict)  # ranks -> each rank's rates with that many running
    attention_shape: tuple = (2, 4, 256, 64)  # (b, a, s, d) it was measured at
    step_overhead_s: Dict[int, float] = field(default_factory=dict)  # ranks -> seconds a step (1: alone)

    def rates(self, ranks: int) -> Rates:
        """A rank's rates in a `ranks`-rank run on this machine (ValueError: not measured)."""
        if ranks <= 1:
            return self.alone
        if ranks not in self.busy:
            raise ValueError(f"measured alone and with {sorted(self.busy)} ranks busy, not {ranks}")
        return self.busy[ranks]

    def with_step_overhead(self, ranks: int, seconds: float) -> "Measured":
        """A copy that records a trainer step's time besides its operators at `ranks` ranks (clipped at 0)."""
        return replace(self, step_overhead_s={**self.step_overhead_s, max(ranks, 1): max(seconds, 0.0)})

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        busy = "".join(f"; {n} ranks at once: {r}" for n, r in sorted(self.busy.items()))
        steps = ", ".join(f"{n} rank(s) {v * 1e3:.0f} ms" for n, v in sorted(self.step_overhead_s.items()))
        return (f"CPU ({self.threads} thread(s) a rank): alone: {self.alone}{busy}; gloo all-reduce "
                f"{self.link_latency_s * 1e6:.0f} us + {self.link_bw / 1e9:.2f} GB/s"
                + (f"; a step besides its operators: {steps}" if steps else ""))


def _best_time(fn, min_s: float = 0.15, reps: int = 3) -> float:
    """The fastest of `reps` timings of fn (each the mean over enough calls to last about min_s)."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(min_s / once))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def gemm_rates(shapes: Sequence[Tuple[int, int, int]], passes: Sequence[str] = PASSES) -> dict:
    """{'pass mxkxn': FLOP/s} of fp32 GEMMs of the forward [m, k] x [k, n] shapes, each pass called as
    torch.nn.functional.linear and its autograd call them (the weight stored [n, k])."""
    out = {}
    for m, k, n in shapes:
        x, w, g = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)  # input, weight, output gradient
        calls = {"fwd": lambda x=x, w=w: torch.nn.functional.linear(x, w),  # [m, n]
                 "dgrad": lambda g=g, w=w: g.mm(w),  # [m, k]
                 "wgrad": lambda g=g, x=x: g.t().mm(x)}  # [n, k]
        for name in passes:
            out[f"{name} {m}x{k}x{n}"] = 2 * m * k * n / _best_time(calls[name])
    return out


def memory_bandwidth(mib: int = 64) -> float:
    """bytes/s of c = a + b over fp32 arrays of `mib` MiB each."""
    n = mib * (1 << 20) // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.empty(n)
    return 3 * 4 * n / _best_time(lambda: torch.add(a, b, out=c))


def attention_rate(b: int, a: int, s: int, d: int) -> float:
    """FLOP/s of causal scaled_dot_product_attention's forward and backward on [b, a, s, d] in the model's terms:
    the forward's executed FLOPs (2 x 2 b a s^2 d, half of them under the causal mask) times 1 + the backward's
    share (roofline.ATTN_BWD_FACTOR), over the measured time of both."""
    q, k, v = (torch.randn(b, a, s, d, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, a, s, d)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return 2 * b * a * s * s * d * (1 + roofline.ATTN_BWD_FACTOR) / _best_time(
        lambda: sdpa(q, k, v, is_causal=True).backward(grad))


def op_overhead() -> float:
    """Seconds of one elementwise op on a 64-value tensor: dispatch, not work."""
    x = torch.ones(64)
    return _best_time(lambda: x.mul(1.0), min_s=0.05)


def compute_rates(shapes, attention, threads: int) -> Rates:
    """This process's rates with `threads` intra-op threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return Rates(gemm_by_shape=gemm_rates(shapes), mem_bw=memory_bandwidth(), op_overhead_s=op_overhead(),
                     attention_flops=attention_rate(*attention))
    finally:
        torch.set_num_threads(old)


def _busy_worker(shapes, attention, threads, barrier, queue) -> None:
    barrier.wait()  # every rank starts at once, so that each is measured beside the others
    queue.put(compute_rates(shapes, attention, threads))


def busy_rates(shapes, attention, threads: int, ranks: int) -> Rates:
    """Each rank's rates while `ranks` processes run the benchmark at once: the mean over the processes."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_busy_worker, args=(shapes, attention, threads, barrier, queue)) for _ in range(ranks)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    return Rates(gemm_by_shape={k: statistics.fmean(r.gemm_by_shape[k] for r in got) for k in got[0].gemm_by_shape},
                 mem_bw=statistics.fmean(r.mem_bw for r in got),
                 op_overhead_s=statistics.fmean(r.op_overhead_s for r in got),
                 attention_flops=statistics.fmean(r.attention_flops for r in got))


def _collective_worker(rank: int, world: int, port: int, threads: int, queue) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = []
        for size in COLLECTIVE_BYTES:
            x = torch.ones(size // 4)
            for _ in range(2):
                dist.all_reduce(x)
            times = []
            for _ in range(5 if size < (1 << 20) else 3):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(4):
                    dist.all_reduce(x)
                times.append((time.perf_counter() - t0) / 4)
            rows.append((size, min(times)))
        if rank == 0:
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def collectives(ranks: int = 2, threads: int = 1) -> Tuple[float, float]:
    """(latency s, bandwidth bytes/s) of gloo all-reduces among `ranks` local processes: least squares of
    t = latency + traffic / bw, traffic = 2 (n - 1) / n x bytes (the ring's per-rank sends)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_collective_worker, args=(r, ranks, port, threads, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    traffic = [2 * (ranks - 1) / ranks * size for size, _ in rows]
    times = [t for _, t in rows]
    mx, my = statistics.fmean(traffic), statistics.fmean(times)
    slope = sum((x - mx) * (y - my) for x, y in zip(traffic, times)) / sum((x - mx) ** 2 for x in traffic)
    latency = max(my - slope * mx, min(times) * 0.5)
    return latency, 1.0 / max(slope, 1e-15)


def model_shapes(hidden: int, ffn: int, heads: int, groups: int, tokens: int, vocab: int,
                 tp: int = 1) -> List[Tuple[int, int, int]]:
    """The forward GEMMs of one layer and the logits at `tokens` = micro-batch x sequence rows, TP-sharded."""
    d = hidden // heads
    return [(tokens, hidden, (heads + 2 * groups) * d // tp), (tokens, heads * d // tp, hidden),
            (tokens, hidden, 2 * ffn // tp), (tokens, ffn // tp, hidden), (tokens, hidden, vocab // tp)]


def measure(shapes: Sequence[Tuple[int, int, int]], threads: int = 1, ranks: int = 2,
            attention: Tuple[int, int, int, int] = (2, 4, 256, 64)) -> Measured:
    """This machine, `threads` threads a rank, alone and with `ranks` ranks busy (see the module docstring);
    attention: (b, a, s, d) of the model."""
    alone = compute_rates(shapes, attention, threads)
    busy = {ranks: busy_rates(shapes, attention, threads, ranks)} if ranks > 1 else {}
    latency, link = collectives(ranks, threads) if ranks > 1 else (0.0, float("inf"))
    return Measured(threads=threads, alone=alone, link_latency_s=latency, link_bw=link, busy=busy,
                    attention_shape=tuple(attention))


def _shape_of(key: str) -> Tuple[int, int, int]:
    """'pass mxkxn' -> the GEMM's (m, n, k) in the roofline's output-rows, output-columns, reduction terms."""
    name, shape = key.split()
    m, k, n = (int(x) for x in shape.split("x"))
    return {"fwd": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}[name]


def cpu_hardware(m: Measured, ranks: int = 2):
    """The step-time model's Hardware for a `ranks`-rank run on this machine, one rank = one device, in the
    model's own terms, so that its roofline reproduces the rates measured with that many ranks busy (nothing
    fitted to a step time):
      peak (every precision)  the median over the measured GEMMs (every shape and pass) of rate / the model's
                              shape factor there (steptime.roofline.gemm_efficiency at calibration 1: its tile
                              waves and K_FILL curve, written for GPUs), so the model's GEMM at a measured shape
                              runs at the rate measured there; gemm_efficiency 1
      attention_efficiency    the measured causal SDPA rate / (that peak x the model's head-dim and key-length
                              factors at the measured shape)
      HBM                     the measured memory bandwidth (memory_efficiency 1)
      links                   the measured gloo all-reduce: bandwidth of the ring's traffic, latency (one node: the
                              network is the same loopback)
      kernel_overhead_us      one op's dispatch
      step_overhead_s         the trainer's step besides its operators at `ranks` ranks, where recorded
                              (Measured.step_overhead_s), else 0."""
    r = m.rates(ranks)
    unit = steptime.Hardware(
        name="cpu", peak_tflops={"fp32": 1.0}, hbm_gbps=r.mem_bw / 1e9, memory_gib=_host_memory_gib(), sm_count=1,
        intra_node_gbps=m.link_bw / 1e9, intra_node_latency_us=m.link_latency_s * 1e6,
        inter_node_gbps=m.link_bw / 1e9, inter_node_latency_us=m.link_latency_s * 1e6, gpus_per_node=max(ranks, 1),
        calibration=dict(gemm_efficiency=1.0, memory_efficiency=1.0, comm_efficiency=1.0, attention_efficiency=1.0,
                         kernel_overhead_us=r.op_overhead_s * 1e6,
                         step_overhead_s=m.step_overhead_s.get(max(ranks, 1), 0.0)),
        full_name=f"this machine's CPU, {m.threads} thread(s) a rank, {ranks} rank(s) busy (measured)",
        sources={"all": "measured at run time by megatron_sat/profiling/cpu_hardware.py"})
    peak = statistics.median(rate / roofline.gemm_efficiency(unit, *_shape_of(key))
                             for key, rate in r.gemm_by_shape.items())
    b, a, s, d = m.attention_shape
    attention = r.attention_flops / (peak * roofline.attention_efficiency(unit, d, s))
    return replace(unit.with_calibration(attention_efficiency=attention),
                   peak_tflops={p: peak / 1e12 for p in ("fp32", "bf16", "fp16")})


def _host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024 ** 3


if __name__ == "__main__":  # a quick look: python -m megatron_sat.profiling.cpu_hardware
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(measure(model_shapes(256, 1024, 4, 4, 1024, 4096)))
