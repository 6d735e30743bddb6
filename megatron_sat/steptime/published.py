"""Published Megatron throughput and the step-time model's predictions of it (tools/check_steptime.py prints the
table; docs/step_time.md shows it; tests/test_steptime.py checks the docs' table against this module).

Sources (transcribed, never tuned per row):
  H100_WEAK    Megatron-LM README, "Performance Benchmarking" (images/model_table.png, Megatron-Core r0.8-era runs on
               H100 SXM, 8 a node): nine GPT models, vocabulary 131,072, sequence 4,096, BF16, --overlap-grad-reduce
               --overlap-param-gather --tp-comm-overlap; TFLOP/s per GPU in model FLOPs.
  H100_STRONG  the same README's strong-scaling curve of the 177B model at batch 1,152: 47% MFU on 96 H100s, 42% on
               4,608 (MFU of the dense BF16 peak, 989.4 TFLOP/s; read as TFLOP/s = MFU x peak). Layout: TP8 PP6
               as the weak-scaling 177B row (not published for this curve).
  A100_2021    Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
               Megatron-LM" (arXiv 2104.04473), Table 1: ten GPT models on Selene (DGX A100 80GB, 8 x HDR 200 Gb/s a
               node), vocabulary 51,200, sequence 2,048, FP16, activation recomputation; TFLOP/s per GPU counted
               with the paper's formula 96 B s l h^2 (1 + s / 6h + V / (16 l h)) per step, which includes the
               recomputed forward: predictions are converted to that count before comparing.

What neither source publishes (micro-batch size, interleaving, the exact block) is ASSUMED below, once per source
and the same for every row. Rows with role 'fit' are the only data the H100 calibration constants were fitted
on (fit()); every other row only checks.
"""

import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from megatron_sat.model.args import ModelArgs
from megatron_sat.steptime.hardware import Cluster, Hardware, load_gpu
from megatron_sat.steptime.predict import Layout, predict_step


@dataclass(frozen=True)
class Row:
    source: str  # 'H100_WEAK' | 'H100_STRONG' | 'A100_2021'
    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float  # published TFLOP/s per GPU (the source's own FLOP count)
    role: str = "check"  # 'fit' | 'check'

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


H100_PEAK = 989.4
H100_WEAK = [
    Row("H100_WEAK", "1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8, "fit"),
    Row("H100_WEAK", "7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    Row("H100_WEAK", "16B", 48, 6144, 32, 4, 1, 192, 192, 489.1, "fit"),
    Row("H100_WEAK", "32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    Row("H100_WEAK", "70B", 64, 8192, 84, 8, 2, 768, 384, 419.7, "fit"),
    Row("H100_WEAK", "119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    Row("H100_WEAK", "177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    Row("H100_WEAK", "314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4, "fit"),
    Row("H100_WEAK", "462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
]
H100_STRONG = [
    Row("H100_STRONG", "177B @96", 96, 12288, 96, 8, 6, 96, 1152, round(0.47 * H100_PEAK, 1)),
    Row("H100_STRONG", "177B @4608", 96, 12288, 96, 8, 6, 4608, 1152, round(0.42 * H100_PEAK, 1)),
]
A100_2021 = [
    Row("A100_2021", "1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    Row("A100_2021", "3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    Row("A100_2021", "7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    Row("A100_2021", "18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row("A100_2021", "39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    Row("A100_2021", "76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row("A100_2021", "145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Row("A100_2021", "310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Row("A100_2021", "529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Row("A100_2021", "1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
ROWS = H100_WEAK + H100_STRONG + A100_2021

# What each source leaves unpublished, assumed once for all its rows (docs/step_time.md repeats it).
ASSUMPTIONS = {
    "H100_WEAK": dict(gpu="H100", seq=4096, vocab=131072, precision="bf16", micro_batch_size=1, recompute=None,
                      interleave=True,
                      distributed_optimizer=True, overlap=True, tp_comm_overlap=True, grad_reduce_in_fp32=False,
                      tied_embeddings=False, flops="model"),
    "A100_2021": dict(gpu="A100", seq=2048, vocab=51200, precision="fp16", micro_batch_size=1, recompute="full",
                      interleave=False,
                      distributed_optimizer=False, overlap=False, tp_comm_overlap=False, grad_reduce_in_fp32=True,
                      tied_embeddings=True, flops="narayanan2021"),
}
ASSUMPTIONS["H100_STRONG"] = ASSUMPTIONS["H100_WEAK"]
ASSUMPTION_TEXT = {
    "H100_WEAK": "micro-batch 1, interleaving with one layer per virtual stage wherever PP > 1 (VPP = layers / PP: the "
                 "only split every row's layer count allows besides none), no recompute, the distributed optimizer, "
                 "sequence parallelism wherever TP > 1 (--tp-comm-overlap needs it), gradients reduced in bf16 "
                 "(Megatron-LM's default), untied embeddings, GPT's block (GeLU MLP of 4h, LayerNorm, no QK norm)",
    "A100_2021": "micro-batch 1, no interleaving, full recompute, FP16, no distributed optimizer and no overlap "
                 "(2021's Megatron-LM all-reduced fp32 gradients after the backward), no sequence parallelism, "
                 "tied embeddings, GPT's block",
}


def model_of(row: Row) -> ModelArgs:
    """The published GPT model as a ModelArgs (the project's model description)."""
    return ModelArgs(arch="transformer", num_layers=row.layers, hidden_size=row.hidden, num_attention_heads=row.heads,
                     ffn_hidden_size=4 * row.hidden, gated_linear_unit=False, qk_layernorm=False)


def layout_of(row: Row) -> Layout:
    a = ASSUMPTIONS[row.source]
    vpp = row.layers // row.pp if a["interleave"] and row.pp > 1 else None
    return Layout(tp=row.tp, pp=row.pp, vpp=vpp, dp=row.dp, micro_batch_size=a["micro_batch_size"],
                  global_batch_size=row.batch,
                  sequence_parallel=a["tp_comm_overlap"] and row.tp > 1, recompute=a["recompute"],
                  distributed_optimizer=a["distributed_optimizer"], overlap_grad_reduce=a["overlap"],
                  overlap_param_gather=a["overlap"], tp_comm_overlap=a["tp_comm_overlap"] and row.tp > 1,
                  precision=a["precision"], grad_reduce_in_fp32=a["grad_reduce_in_fp32"])


def narayanan_flops(row: Row) -> float:
    """FLOPs of one step by Narayanan et al. 2021's formula (recompute included)."""
    a = ASSUMPTIONS[row.source]
    s, v, h, layers = a["seq"], a["vocab"], row.hidden, row.layers
    return 96 * row.batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def predict_row(row: Row, gpu: Optional[Hardware] = None) -> float:
    """Predicted TFLOP/s per GPU of a published row, in the source's FLOP count."""
    a = ASSUMPTIONS[row.source]
    hw = gpu or load_gpu(a["gpu"])
    c = Cluster(gpu=hw, nodes=row.gpus // hw.gpus_per_node, gpus_per_node=hw.gpus_per_node)
    p = predict_step(model_of(row), layout_of(row), c, seq_length=a["seq"], vocab_size=a["vocab"],
                     tied_embeddings=a["tied_embeddings"])
    if a["flops"] == "narayanan2021":
        return narayanan_flops(row) / p.step_time_s / row.gpus / 1e12
    return p.tflops_per_gpu


def compare(rows: Sequence[Row] = ROWS, gpus: Optional[Dict[str, Hardware]] = None) -> List[dict]:
    """Every row with its prediction and relative error (predicted / published - 1)."""
    out = []
    for row in rows:
        gpu = (gpus or {}).get(ASSUMPTIONS[row.source]["gpu"])
        pred = predict_row(row, gpu)
        out.append(dict(source=row.source, name=row.name, role=row.role, tp=row.tp, pp=row.pp, dp=row.dp,
                        gpus=row.gpus, batch=row.batch, published=row.tflops, predicted=round(pred, 1),
                        error=pred / row.tflops - 1))
    return out


def summary(results: Iterable[dict]) -> Dict[str, float]:
    """Mean and worst absolute relative error."""
    errors = [abs(r["error"]) for r in results]
    return dict(mean=sum(errors) / len(errors), worst=max(errors), n=len(errors))


@cache
def uncertainty(gpu: str = "H100") -> float:
    """The relative uncertainty of a prediction on `gpu`: the mean absolute error of the check rows published for it
    (every check row for a GPU with none: H200, B200), for GPU-hour estimates (prediction x (1 +- this))."""
    rows = [r for r in ROWS if r.role == "check" and ASSUMPTIONS[r.source]["gpu"] == gpu]
    return summary(compare(rows or [r for r in ROWS if r.role == "check"]))["mean"]


def fit(keys: Sequence[str], grids: Dict[str, Sequence[float]], rows: Sequence[Row],
        gpu: str = "H100") -> Dict[str, float]:
    """The calibration values (one per key, from its grid) that minimise the squared log error over `rows` (a grid
    search: few constants, few rows), refined once around the best point."""
    base = load_gpu(gpu)

    def loss(values: Dict[str, float]) -> float:
        hw = base.with_calibration(**values)
        return sum(math.log(predict_row(r, hw) / r.tflops) ** 2 for r in rows)

    def search(grid: Dict[str, Sequence[float]]) -> Dict[str, float]:
        best, best_loss = None, math.inf
        points: List[Dict[str, float]] = [{}]
        for k in keys:
            points = [dict(p, **{k: v}) for p in points for v in grid[k]]
        for p in points:
            val = loss(p)
            if val < best_loss:
                best, best_loss = p, val
        return best

    best = search(grids)
    fine = {}
    for k in keys:
        g = sorted(grids[k])
        step = (g[-1] - g[0]) / max(len(g) - 1, 1)
        fine[k] = [best[k] + step * f for f in (-0.5, -0.25, 0.0, 0.25, 0.5)]
    return search(fine)


def format_table(results: List[dict]) -> str:
    """The comparison as a Markdown table plus the mean / worst lines (what docs/step_time.md shows)."""
    lines = ["| source | model | TP | PP | DP | GPUs | batch | role | published | predicted | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['source']} | {r['name']} | {r['tp']} | {r['pp']} | {r['dp']} | {r['gpus']} | {r['batch']} "
                     f"| {r['role']} | {r['published']:.1f} | {r['predicted']:.1f} | {100 * r['error']:+.1f}% |")
    lines.append("")
    for label, sel in (("fit rows", [r for r in results if r["role"] == "fit"]),
                       ("check rows", [r for r in results if r["role"] == "check"]),
                       ("all rows", results)):
        if sel:
            s = summary(sel)
            lines.append(f"- {label} ({s['n']}): mean absolute error {100 * s['mean']:.1f}%, worst "
                         f"{100 * s['worst']:.1f}%")
    return "\n".join(lines)


def replace_block(path, marker: str, text: str) -> None:
    """Rewrite what docs/step_time.md holds between <!-- marker --> and <!-- /marker --> with `text`."""
    doc = Path(path).read_text()
    start, end = f"<!-- {marker} -->\n", f"\n<!-- /{marker} -->"
    i, j = doc.index(start) + len(start), doc.index(end)
    Path(path).write_text(doc[:i] + text.strip() + doc[j:])
