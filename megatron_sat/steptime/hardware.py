"""Devices and clusters the step-time model runs on: gpus.json (the data, with its sources) read into dataclasses.

    from megatron_sat.steptime import load_gpu, cluster
    h100 = load_gpu("H100"); h100.peak("bf16")          # FLOP/s, dense
    c = cluster("4x8xH100")                             # 4 nodes of 8 H100s (also "H100", "32xH100" = 4 x 8)
"""

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, Optional, Tuple

DATA = Path(__file__).with_name("gpus.json")
# precisions the model knows and the Tensor Core peak each one's GEMMs run at
PRECISIONS = ("bf16", "fp16", "fp8", "fp32")

# calibration constants (gpus.json "calibration"; docs/step_time.md says where each value comes from):
#   gemm_efficiency       fraction of the dense peak a large, well-shaped GEMM reaches
#   memory_efficiency     fraction of the HBM bandwidth a streaming (memory-bound) kernel reaches
#   comm_efficiency       fraction of a link's bandwidth NCCL's ring reaches (bus bandwidth / link bandwidth)
#   attention_efficiency  fraction of the dense peak flash attention reaches on the FLOPs it executes (causal: half)
#   kernel_overhead_us    fixed time per kernel (launch and tail), what makes small operators inefficient
#   step_overhead_s       fixed time per step (data loading, logging, the loss's all-reduce, synchronisation)
CALIBRATION_KEYS = ("gemm_efficiency", "memory_efficiency", "comm_efficiency", "attention_efficiency",
                    "kernel_overhead_us", "step_overhead_s")


@dataclass(frozen=True)
class Hardware:
    """One device kind: dense peaks per precision (TFLOP/s), HBM bandwidth, the links within a node (NVLink) and
    between nodes (the per-GPU network port), GPUs per node, memory, and its calibration constants."""

    name: str
    peak_tflops: Dict[str, float]
    hbm_gbps: float
    memory_gib: float
    sm_count: int
    intra_node_gbps: float  # per GPU and direction
    intra_node_latency_us: float
    inter_node_gbps: float  # per GPU and direction (one network port per GPU)
    inter_node_latency_us: float
    gpus_per_node: int
    calibration: Dict[str, float] = field(default_factory=dict)
    full_name: str = ""
    sources: Dict[str, str] = field(default_factory=dict)

    def peak(self, precision: str = "bf16") -> float:
        """Dense peak FLOP/s of the GEMMs of `precision` (ValueError: the GPU has no such Tensor Core path)."""
        tflops = self.peak_tflops.get(precision)
        if tflops is None:
            raise ValueError(f"{self.name} has no {precision} peak in gpus.json; use one of "
                             f"{', '.join(sorted(self.peak_tflops))}")
        return tflops * 1e12

    def cal(self, key: str) -> float:
        """A calibration constant (CALIBRATION_KEYS)."""
        return float(self.calibration[key])

    def with_calibration(self, **values: float) -> "Hardware":
        """A copy with some calibration constants replaced (the fit in published.py)."""
        return replace(self, calibration={**self.calibration, **values})


@dataclass(frozen=True)
class Cluster:
    """nodes x gpus_per_node devices of one kind."""

    gpu: Hardware
    nodes: int = 1
    gpus_per_node: int = 8

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def __str__(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}x{self.gpu.name}"


def _table() -> dict:
    return {k: v for k, v in json.loads(DATA.read_text()).items() if not k.startswith("_")}


def gpu_names() -> Tuple[str, ...]:
    """The GPUs gpus.json describes."""
    return tuple(_table())


def load_gpu(name: str) -> Hardware:
    """The Hardware of a GPU in gpus.json (case-insensitive; ValueError naming the known ones)."""
    table = _table()
    key = next((k for k in table if k.lower() == name.lower()), None)
    if key is None:
        raise ValueError(f"unknown GPU {name!r}; gpus.json describes {', '.join(table)}")
    row = dict(table[key])
    calibration = {k: v for k, v in row.pop("calibration").items() if not k.startswith("_")}
    return Hardware(name=key, calibration=calibration, **row)


def cluster(spec, nodes: Optional[int] = None, gpus_per_node: Optional[int] = None) -> Cluster:
    """A Cluster from a spec: a Cluster (returned as is), a Hardware or GPU name (one node), "NxGPU" (N GPUs,
    whole nodes of the GPU's gpus_per_node) or "NODESxPERxGPU" ("4x8xH100"); nodes / gpus_per_node override."""
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, Hardware):
        gpu, n, per = spec, 1, spec.gpus_per_node
    else:
        m = re.fullmatch(r"(?:(\d+)x)?(?:(\d+)x)?([A-Za-z][\w-]*)", str(spec).strip())
        if not m:
            raise ValueError(f"cluster {spec!r}: write GPU, NxGPU or NODESxGPUS_PER_NODExGPU, e.g. 4x8xH100")
        gpu = load_gpu(m.group(3))
        if m.group(2):
            n, per = int(m.group(1)), int(m.group(2))
        elif m.group(1):
            total, per = int(m.group(1)), gpu.gpus_per_node
            per = min(per, total)
            if total % per:
                raise ValueError(f"cluster {spec!r}: {total} GPUs is not whole nodes of {per}; write NODESxPERxGPU")
            n = total // per
        else:
            n, per = 1, gpu.gpus_per_node
    return Cluster(gpu=gpu, nodes=nodes or n, gpus_per_node=gpus_per_node or per)
