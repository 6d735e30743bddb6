"""The pipeline schedule, simulated as Megatron-Core runs it (schedules.py): every stage executes its forward and
backward passes in Megatron's order, each waiting for the pass it depends on, one point-to-point message later.

    from megatron_sat.steptime.schedule import simulate
    r = simulate(forward=[[1.0]] * 4, backward=[[2.0]] * 4, num_microbatches=8)   # PP4, 1F1B
    r.time, r.bubble_fraction   # 33.0, (4 - 1) / 8

Orders (stage r of p, m micro-batches, v model chunks per stage):
  1F1B (v = 1)      warm-up min(p - r - 1, m) forwards; then (forward, backward) pairs; then the cool-down backwards
  interleaved       m x v virtual micro-batches; virtual k runs chunk (k mod pv) // p (backward: v - 1 - that) of
                    micro-batch (k // pv) p + k mod p; warm-up (p - r - 1) x 2 + (v - 1) x p of them (all, when
                    m = p), then 1F1B pairs, then the cool-down (Megatron-Core's
                    forward_backward_pipelining_with_interleaving, microbatch_group_size_per_vp_stage = p)
Dependencies: chunk g = c p + r of the model (c: the stage's chunk) runs a micro-batch's forward after chunk g - 1's
forward of it has arrived (+ one message), its backward after chunk g + 1's backward (+ one message); the last
chunk's backward after its own forward. Messages cost `p2p` seconds on the critical path (Megatron's sends and
receives block the schedule; their bandwidth time is not overlapped with compute).

With equal passes and free messages the step is (m + (p - 1) / v) x (F + B) (Narayanan et al. 2021): the bubble
fraction (p - 1) / (v m). The simulation departs from it where stages differ (the embedding on the first, the
output layer and loss on the last), messages cost time, or m is small against p under interleaving.
"""

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple


@dataclass
class ScheduleResult:
    """time: the pipeline's makespan; busy[r]: stage r's compute; finish[r]: when stage r ended;
    last_backward[r] / first_forward[r]: the stage's last backward pass and first forward pass (seconds of compute:
    the windows the data-parallel gradient reduce-scatter and parameter all-gather hide behind)."""

    time: float
    busy: List[float]
    finish: List[float]
    last_backward: List[float]
    first_forward: List[float]

    @property
    def bubble_time(self) -> float:
        """Idle time of the busiest stage."""
        return self.time - max(self.busy)

    @property
    def bubble_fraction(self) -> float:
        """bubble time / the busiest stage's compute: the closed form's (p - 1) / (v m)."""
        return self.bubble_time / max(self.busy)

    @property
    def bubble_share(self) -> float:
        """bubble time / makespan."""
        return self.bubble_time / self.time if self.time else 0.0


def stage_order(rank: int, p: int, m: int, v: int = 1) -> List[Tuple[str, int, int]]:
    """Megatron-Core's order of ('F' | 'B', micro-batch, chunk) on pipeline stage `rank` (module docstring)."""
    return list(_stage_order(rank, p, m, v))


@lru_cache(maxsize=4096)  # the layout search simulates the same (stage, p, m, v) for many layouts
def _stage_order(rank: int, p: int, m: int, v: int) -> Tuple[Tuple[str, int, int], ...]:
    return tuple(_build_order(rank, p, m, v))


@lru_cache(maxsize=1024)
def _plans(p: int, m: int, v: int) -> tuple:
    """Every stage's order as (forward?, slot it waits for, stage whose message it waits for (-1: none), chunk,
    slot it ends): slot 0 is time 0, 1 + g m + mb chunk g's forward of micro-batch mb, 1 + (p v + g) m + mb its
    backward."""
    chunks = p * v
    plans = []
    for r in range(p):
        ops = []
        for kind, mb, c in _stage_order(r, p, m, v):
            g = c * p + r
            if kind == "F":
                dep, h = (0, -1) if g == 0 else (1 + (g - 1) * m + mb, (g - 1) % p)
                ops.append((True, dep, h, c, 1 + g * m + mb))
            else:
                dep, h = (1 + g * m + mb, -1) if g == chunks - 1 else (1 + (chunks + g + 1) * m + mb, (g + 1) % p)
                ops.append((False, dep, h, c, 1 + (chunks + g) * m + mb))
        plans.append(tuple(ops))
    return tuple(plans)


def _build_order(rank: int, p: int, m: int, v: int) -> List[Tuple[str, int, int]]:
    if v == 1:
        warmup = min(p - rank - 1, m)
        order = [("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i, 0), ("B", i, 0)]
        return order + [("B", i, 0) for i in range(m - warmup, m)]
    if m % p:
        raise ValueError(f"interleaved schedule: {m} micro-batches is not a multiple of the {p} pipeline stages")
    total = m * v

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def micro(k: int) -> int:
        return (k // (p * v)) * p + k % p

    warmup = total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [("F", micro(k), chunk(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("F", micro(warmup + k), chunk(warmup + k, True)), ("B", micro(k), chunk(k, False))]
    return order + [("B", micro(k), chunk(k, False)) for k in range(total - warmup, total)]


def simulate(forward: Sequence[Sequence[float]], backward: Sequence[Sequence[float]], num_microbatches: int,
             p2p: float = 0.0, p2p_per_stage: Optional[Sequence[float]] = None) -> ScheduleResult:
    """Simulate one step's pipeline. forward[r][c] / backward[r][c]: seconds of chunk c's pass on stage r for one
    micro-batch (v = len(forward[0]) chunks per stage); p2p: seconds of one message between adjacent chunks
    (p2p_per_stage[r]: of the messages stage r sends, overriding p2p)."""
    p, v, m = len(forward), len(forward[0]), num_microbatches
    if p == 1 and v == 1:  # one stage: forward, backward, forward, ... back to back (the loop below, unrolled)
        f, b = forward[0][0], backward[0][0]
        t = 0.0
        for _ in range(m):
            t = t + f
            t = t + b
        return ScheduleResult(time=t, busy=[t], finish=[t], last_backward=[b if m else 0.0],
                              first_forward=[f if m else 0.0])
    plans = _plans(p, m, v)
    # end times by slot (_plans: 0 a constant 0.0, then every chunk's forward and backward of every micro-batch;
    # NaN: not run yet); flat lists, the hot loop of the layout search
    done = [float("nan")] * (1 + 2 * p * v * m)
    done[0] = 0.0
    free = [0.0] * p
    busy = [0.0] * p
    nxt = [0] * p
    last_backward = [0.0] * p
    first_forward = [0.0] * p
    hop = (list(p2p_per_stage) if p2p_per_stage is not None else [p2p] * p) + [0.0]  # [-1]: no message
    remaining = sum(len(o) for o in plans)
    while remaining:
        progressed = False
        for r in range(p):
            ops, t_free, spent = plans[r], free[r], busy[r]
            fwd_r, bwd_r = forward[r], backward[r]
            i = start = nxt[r]
            n = len(ops)
            while i < n:
                is_fwd, dep, h, c, out = ops[i]
                t = done[dep] + hop[h]
                if t != t:  # NaN: what it waits for has not run
                    break
                cost = fwd_r[c] if is_fwd else bwd_r[c]
                t_free = (t_free if t_free > t else t) + cost
                spent += cost
                done[out] = t_free
                if not is_fwd:
                    last_backward[r] = cost
                elif i == 0:
                    first_forward[r] = cost
                i += 1
            if i > start:
                remaining -= i - start
                progressed = True
            free[r], busy[r], nxt[r] = t_free, spent, i
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked (an order Megatron-Core would not run)")
    return ScheduleResult(time=max(free), busy=busy, finish=free, last_backward=last_backward,
                          first_forward=first_forward)


def closed_form_bubble(p: int, m: int, v: int = 1) -> float:
    """(p - 1) / (v m): the bubble over the compute with equal passes and free messages."""
    return (p - 1) / (v * m)
