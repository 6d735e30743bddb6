"""Collective and point-to-point costs: the ring / tree formulas on a group's bus bandwidth and latency.

A group of n ranks that places k of them on each node (k = n: one node) runs its collectives as NCCL's rings do:

    bus bandwidth    B = NVLink (per GPU, per direction)                          k = n (within a node)
                     B = min(NVLink, k x network port)                            k < n (across nodes)
                     times comm_efficiency (what NCCL reaches of the link)
    all-reduce       2 (n-1)/n x S / B + latency x min(2 (n-1), 2 ceil(log2 n))   (ring bandwidth, tree latency)
    reduce-scatter   (n-1)/n x S / B + (n-1) x latency                           S: the whole (unsharded) tensor
    all-gather       (n-1)/n x S / B + (n-1) x latency
    send / receive   S / link + latency                                           (one hop, within or across nodes)

Across nodes, each of the k ranks on a node drives its own network port (rail-optimised fabric; the node's other
groups, e.g. the other TP ranks' DP groups, use the other ports at the same time), so the ring's inter-node hop
moves k ports' worth: the bus bandwidth is k ports, at most NVLink. This is what nccl-tests' busbw shows on
DGX-class nodes (one node's full ring across nodes approaches the node's total network bandwidth).

Rank order is Megatron-Core's (tp, cp, dp, pp from fastest to slowest): members_per_node gives k for a group
whose consecutive members are `stride` ranks apart.
"""

import math

from megatron_sat.steptime.hardware import Cluster


def members_per_node(size: int, stride: int, gpus_per_node: int) -> int:
    """How many of a group's `size` members (consecutive members `stride` ranks apart) share one node."""
    if size <= 1:
        return 1
    if stride >= gpus_per_node:
        return 1
    return max(1, min(size, gpus_per_node // stride))


def bus_bandwidth(c: Cluster, size: int, stride: int) -> float:
    """Bytes/s a ring over the group reaches per rank (module docstring)."""
    gpu = c.gpu
    eff = gpu.cal("comm_efficiency")
    k = members_per_node(size, stride, c.gpus_per_node)
    nvlink = gpu.intra_node_gbps * 1e9
    if k >= size:
        return eff * nvlink
    return eff * min(nvlink, k * gpu.inter_node_gbps * 1e9)


def latency(c: Cluster, size: int, stride: int) -> float:
    """Seconds per ring step: NVLink's within a node, the network's across nodes."""
    k = members_per_node(size, stride, c.gpus_per_node)
    us = c.gpu.intra_node_latency_us if k >= size else c.gpu.inter_node_latency_us
    return us * 1e-6


def all_reduce(c: Cluster, nbytes: float, size: int, stride: int = 1) -> float:
    """Seconds to all-reduce `nbytes` over a group of `size` (ring bandwidth, the cheaper of ring and tree latency)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    steps = min(2 * (size - 1), 2 * math.ceil(math.log2(size)))
    return 2 * (size - 1) / size * nbytes / bus_bandwidth(c, size, stride) + steps * latency(c, size, stride)


def reduce_scatter(c: Cluster, nbytes: float, size: int, stride: int = 1) -> float:
    """Seconds to reduce-scatter a tensor of `nbytes` (the whole, unsharded tensor) over `size` ranks."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    return (size - 1) / size * nbytes / bus_bandwidth(c, size, stride) + (size - 1) * latency(c, size, stride)


def all_gather(c: Cluster, nbytes: float, size: int, stride: int = 1) -> float:
    """Seconds to all-gather a tensor of `nbytes` in all (each rank holds nbytes / size) over `size` ranks."""
    return reduce_scatter(c, nbytes, size, stride)


def send(c: Cluster, nbytes: float, across_nodes: bool) -> float:
    """Seconds for one point-to-point message (a pipeline send) over NVLink or the network."""
    if nbytes <= 0:
        return 0.0
    gpu = c.gpu
    eff = gpu.cal("comm_efficiency")
    if across_nodes:
        return nbytes / (eff * gpu.inter_node_gbps * 1e9) + gpu.inter_node_latency_us * 1e-6
    return nbytes / (eff * gpu.intra_node_gbps * 1e9) + gpu.intra_node_latency_us * 1e-6
