"""The sweep's figures (matplotlib, Agg backend: no display needed), from grid rows and summarize():

    scaling.png      final validation loss against parameters and against training FLOPs (log x): each seed's
                     point, the per-scale mean, and the arch's fit as a line (one colour per arch)
    wallclock.png    validation loss against wall-clock hours, one panel per scale (the paper's "lower loss
                     sooner"), one line per run
    efficiency.png   final loss against throughput (tokens/s per GPU) and against peak memory (the trade-off)

Only complete runs on the sweep's main data are drawn (the runs the tables use).
"""

import os
from typing import Dict, List

import numpy as np

from megatron_sat import archs
from megatron_sat.analysis.scaling import predict

COLORS = {a: archs.get(a).colour for a in archs.ARCHS}  # each arch module's colour (megatron_sat/archs/)


def _plt():
    # matplotlib: optional (eval extra), and its Agg backend is chosen when a figure is drawn, not on import
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use

    return plt


def _null_formatter():
    from matplotlib.ticker import NullFormatter  # optional (eval extra), as in _plt

    return NullFormatter()


def _used(rows, summary):
    return [r for r in rows if r["status"] == "complete" and r.get("final_val_loss") is not None
            and r["data_id"] == summary["main_data_id"]]


def _color(arch):
    return archs.get(arch).colour if archs.known(arch) else "#333333"


def scaling_figure(path: str, rows: List[dict], summary: dict, title: str = "") -> None:
    plt = _plt()
    used = _used(rows, summary)
    which = "non-embedding parameters" if summary["fit_params"] == "non_embedding_params" else "parameters"
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.8))
    for ax, key, field, label in ((axes[0], "params", summary["fit_params"], which),
                                  (axes[1], "flops", "train_flops", "training FLOPs")):
        for arch in summary["archs"]:
            runs = [r for r in used if r["arch"] == arch and r.get(field)]
            if not runs:
                continue
            c = _color(arch)
            ax.scatter([r[field] for r in runs], [r["final_val_loss"] for r in runs], s=12, color=c, alpha=0.45)
            cells = [summary["cells"][arch][s] for s in summary["scales"] if s in summary["cells"][arch]]
            xs = [cell[key] for cell in cells if cell[key]]
            ys = [cell["mean"] for cell in cells if cell[key]]
            fit = summary["fits"][arch].get(key, {})
            if "error" in fit or not xs:
                ax.plot(xs, ys, "o-", color=c, label=arch, ms=4)
                continue
            ax.plot(xs, ys, "o", color=c, ms=4)
            grid = np.geomspace(min(xs) / 1.3, max(xs) * 1.3, 100)
            ax.plot(grid, predict(fit, grid), "-", color=c,
                    label=f"{arch}: {fit['E']:.2f} + {fit['A']:.3g} x^-{fit['alpha']:.3f}")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(_null_formatter())  # minor decade labels collide on short ranges
        ax.set_xlabel(label)
        ax.set_ylabel("final validation loss")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    _save(plt, fig, path)


def _save(plt, fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def wallclock_figure(path: str, rows: List[dict], summary: dict) -> None:
    plt = _plt()
    used = _used(rows, summary)
    scales = summary["scales"] or ["-"]
    fig, axes = plt.subplots(1, len(scales), figsize=(3.4 * len(scales), 3.4), squeeze=False)
    for ax, scale in zip(axes[0], scales):
        seen = set()
        for r in sorted((r for r in used if r["scale"] == scale), key=lambda r: (r["arch"], r["seed"])):
            if not r["curve"]:
                continue
            hours, losses = zip(*r["curve"])
            ax.plot(hours, losses, "-", color=_color(r["arch"]), alpha=0.8, marker=".", ms=3,
                    label=None if r["arch"] in seen else r["arch"])
            seen.add(r["arch"])
        ax.set_title(f"scale {scale}", fontsize=9)
        ax.set_xlabel("wall-clock hours")
        ax.set_ylabel("validation loss")
        ax.grid(True, alpha=0.3)
        if seen:
            ax.legend(fontsize=7)
    _save(plt, fig, path)


def efficiency_figure(path: str, rows: List[dict], summary: dict) -> None:
    plt = _plt()
    used = _used(rows, summary)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    markers = {s: m for s, m in zip(summary["scales"], "os^Dv<>p*h")}
    for ax, field, label in ((axes[0], "tokens_per_s_per_gpu", "tokens/s per GPU (median)"),
                             (axes[1], "peak_memory_gib", "peak memory, GiB")):
        for arch in summary["archs"]:
            for scale in summary["scales"]:
                runs = [r for r in used if r["arch"] == arch and r["scale"] == scale and r.get(field) is not None]
                if runs:
                    ax.scatter([r[field] for r in runs], [r["final_val_loss"] for r in runs], color=_color(arch),
                               marker=markers.get(scale, "o"), s=22, label=f"{arch} {scale}")
        ax.set_xlabel(label)
        ax.set_ylabel("final validation loss")
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[1].legend(handles, labels, fontsize=6, loc="best")
    _save(plt, fig, path)


def write_figures(folder: str, rows: List[dict], summary: dict, title: str = "") -> Dict[str, str]:
    """The three PNGs in `folder`; returns {name: path}."""
    out = {}
    for name, fn in (("scaling", lambda p: scaling_figure(p, rows, summary, title)),
                     ("wallclock", lambda p: wallclock_figure(p, rows, summary)),
                     ("efficiency", lambda p: efficiency_figure(p, rows, summary))):
        path = os.path.join(folder, f"{name}.png")
        fn(path)
        out[name] = path
    return out
