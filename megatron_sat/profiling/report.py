"""Figures, ratios and output files of tools/profile_throughput.py.

From the raw per-arch records of megatron_sat/profiling/throughput.py (merged over runs), one row
per arch:

    step_s_median / _min / _max     the slowest rank's optimizer-step time (wall clock)
    step_cpu_s_median               the process CPU time of a step (max over ranks): on a shared CPU
                                    machine a steadier comparison than wall time (not a GPU figure)
    tokens_per_s_per_gpu            global_batch x seq_length / median step / world size
    tflops_per_gpu, mfu             analytic model FLOPs (megatron_sat/model/flops.py) x tokens/s;
                                    MFU needs the device's peak (GPU table or --peak-tflops)
    gpu_peak_allocated_mib / _reserved_mib, max_rss_mib, rss_above_start_mib   (see throughput.py)
    saved_activation_mib            bytes autograd saves for one micro-batch's forward (max over ranks)
    pipeline_bytes_per_microbatch   sent by all ranks of one model replica, forward + backward (PP > 1)
    <figure>_ratio                  the figure over the baseline arch's (transformer by default)
    satformer_speedup               when SATFormer is in the run: its tokens/s over this arch's, and
    satformer_memory_saving         1 - its memory / this arch's (GPU peak allocated; CPU: RSS above
                                    start), the form of the paper's 760M claims (PAPER_SATFORMER_VS)

Written as <out>/throughput.json (settings, rows, notes), throughput.csv, throughput.png (matplotlib,
Agg backend) and printed as a table.
"""

import csv
import json
import os
import statistics

from megatron_sat import archs

MIB = 2 ** 20
RATIO_KEYS = ("step_s_median", "step_s_min", "step_cpu_s_median", "tokens_per_s_per_gpu", "mfu", "tflops_per_gpu",
              "flops_per_token", "gpu_peak_allocated_mib", "gpu_peak_reserved_mib", "max_rss_mib",
              "rss_above_start_mib", "saved_activation_mib", "pipeline_bytes_per_microbatch", "params")


# the paper's 760M figures for SATFormer against two baselines: (throughput x, memory saving), from the arch modules
PAPER_SATFORMER_VS = {a: archs.get(a).paper_satformer_vs for a in archs.ARCHS if archs.get(a).paper_satformer_vs}


def merge_runs(records: list) -> dict:
    """Raw records of several runs (per-arch processes, repeats) -> one raw record per arch."""
    merged = {}
    for rec in records:
        for arch, r in rec["archs"].items():
            if arch not in merged:
                merged[arch] = dict(r, step_s=list(r["step_s"]), cpu_s=list(r.get("cpu_s", [])))
                continue
            m = merged[arch]
            m["step_s"] += r["step_s"]
            m["cpu_s"] = m.get("cpu_s", []) + r.get("cpu_s", [])
            for key in ("gpu_peak_allocated_bytes", "gpu_peak_reserved_bytes", "max_rss_bytes",
                        "rss_above_start_bytes", "saved_activation_bytes"):
                if r.get(key) is not None:
                    m[key] = max(m.get(key) or 0, r[key])
            if m.get("deepspeed") is None:
                m["deepspeed"] = r.get("deepspeed")
    return merged


def _mib(x):
    return None if x is None else x / MIB


def summarize(raw: dict, settings: dict, peak_flops=None, baseline: str = archs.REFERENCE) -> list:
    """One row per arch (in the order of settings['archs']) with the figures and their baseline ratios."""
    tokens = settings["global_batch_size"] * settings["seq_length"]
    world = settings["world_size"]
    rows = []
    for arch in settings["archs"]:
        r = raw[arch]
        med = statistics.median(r["step_s"])
        tps = tokens / med / world
        flops = r["flops_per_token"]
        br = r["flops_breakdown"]
        ds = r.get("deepspeed") or {}
        rows.append(dict(
            arch=arch, params=r["params"], steps=len(r["step_s"]),
            step_s_median=med, step_s_min=min(r["step_s"]), step_s_max=max(r["step_s"]),
            step_cpu_s_median=statistics.median(r["cpu_s"]) if r.get("cpu_s") else None,
            tokens_per_s_per_gpu=tps, flops_per_token=flops, tflops_per_gpu=tps * flops / 1e12,
            mfu=tps * flops / peak_flops if peak_flops else None,
            value_residual_flops_share=(br["gate"] + br["mixing"]) / sum(br.values()),
            gpu_peak_allocated_mib=_mib(r.get("gpu_peak_allocated_bytes")),
            gpu_peak_reserved_mib=_mib(r.get("gpu_peak_reserved_bytes")),
            max_rss_mib=_mib(r.get("max_rss_bytes")),
            rss_above_start_mib=_mib(r.get("rss_above_start_bytes")),
            saved_activation_mib=_mib(r.get("saved_activation_bytes")),
            pipeline_bytes_per_microbatch=r.get("pipeline_bytes_per_microbatch"),
            pipeline_message_bytes=r.get("pipeline_message_bytes"),
            pipeline_message_shape=r.get("pipeline_message_shape"),
            deepspeed_forward_flops_per_token=ds.get("forward_flops_per_token"),
            deepspeed_to_analytic=ds.get("ratio_to_analytic"),
            final_loss=r.get("loss"),
        ))
    base = next((row for row in rows if row["arch"] == baseline), None)
    for row in rows:
        for key in RATIO_KEYS:
            a, b = row.get(key), (base or {}).get(key)
            row[f"{key}_ratio"] = a / b if a is not None and b else None
    sat = next((row for row in rows if row["arch"] == archs.SUBJECT), None)
    if sat is not None:
        mem = _memory_key(rows)
        for row in rows:
            row["satformer_speedup"] = sat["tokens_per_s_per_gpu"] / row["tokens_per_s_per_gpu"]
            a, b = sat.get(mem) if mem else None, row.get(mem) if mem else None
            row["satformer_memory_saving"] = 1 - a / b if a is not None and b else None
    return rows


def _memory_key(rows: list):
    """The memory figure of the run: GPU peak allocated, else the CPU's RSS above start (None if neither)."""
    return next((k for k in ("gpu_peak_allocated_mib", "rss_above_start_mib") if rows[0].get(k) is not None), None)


def write_outputs(out_dir: str, settings: dict, rows: list, notes: list, modules: dict = None) -> dict:
    """throughput.json, throughput.csv and throughput.png in out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"throughput.{k}") for k in ("json", "csv", "png")}
    with open(paths["json"], "w") as f:
        json.dump(dict(settings=settings, rows=rows, notes=notes, modules=modules or {}), f, indent=1)
    fields = [k for k in rows[0] if k != "pipeline_message_shape"]
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot(paths["png"], settings, rows)
    return paths


def _fmt(x, spec=".3f", none="n/a"):
    return none if x is None else format(x, spec)


def format_table(rows: list) -> str:
    """The console table: one line per arch, ratios to the baseline in the 'x' columns."""
    mem_key = _memory_key(rows)
    mem_name = {"gpu_peak_allocated_mib": "GPU peak MiB", "rss_above_start_mib": "RSS+ MiB"}.get(mem_key, "memory")
    pipe = rows[0].get("pipeline_bytes_per_microbatch") is not None
    cpu = rows[0].get("gpu_peak_allocated_mib") is None and rows[0].get("step_cpu_s_median") is not None
    w = max(12, *(len(r["arch"]) for r in rows))
    head = (f"{'arch':<{w}} {'params':>12} {'step ms med':>11} {'min':>8} {'max':>8} {'x':>6} "
            + (f"{'CPU ms':>8} {'x':>6} " if cpu else "") + f"{'tok/s/GPU':>10} "
            f"{'x':>6} {'MFU':>6} {mem_name:>12} {'x':>6} {'act MiB':>8} {'x':>6}")
    if pipe:
        head += f" {'p2p B/mb':>11} {'x':>6}"
    lines = [head]
    for r in rows:
        line = (f"{r['arch']:<{w}} {r['params']:>12,} {r['step_s_median'] * 1e3:>11.1f} {r['step_s_min'] * 1e3:>8.1f} "
                f"{r['step_s_max'] * 1e3:>8.1f} {_fmt(r['step_s_median_ratio']):>6} "
                + (f"{r['step_cpu_s_median'] * 1e3:>8.1f} {_fmt(r['step_cpu_s_median_ratio']):>6} " if cpu else "")
                + f"{r['tokens_per_s_per_gpu']:>10,.0f} {_fmt(r['tokens_per_s_per_gpu_ratio']):>6} "
                f"{_fmt(None if r['mfu'] is None else 100 * r['mfu'], '.1f'):>6} "
                f"{_fmt(r.get(mem_key) if mem_key else None, '.1f'):>12} "
                f"{_fmt(r.get(f'{mem_key}_ratio') if mem_key else None):>6} "
                f"{_fmt(r['saved_activation_mib'], '.2f'):>8} {_fmt(r['saved_activation_mib_ratio']):>6}")
        if pipe:
            line += f" {r['pipeline_bytes_per_microbatch']:>11,.0f} {_fmt(r['pipeline_bytes_per_microbatch_ratio']):>6}"
        lines.append(line)
    if "satformer_speedup" in rows[0] and len(rows) > 1:  # the paper's claims are SATFormer vs a baseline
        lines += ["", f"{'satformer vs':<{w}} {'tok/s x':>8} {f'{mem_name} saved':>17}   paper (760M)"]
        for r in rows:
            if r["arch"] == archs.SUBJECT:
                continue
            paper = PAPER_SATFORMER_VS.get(r["arch"])
            saving = r["satformer_memory_saving"]
            lines.append((f"{r['arch']:<{w}} {_fmt(r['satformer_speedup'], '.2f'):>8} "
                          f"{'n/a' if saving is None else f'{100 * saving:.1f}%':>17}   "
                          + (f"{paper[0]:.2f}x, {100 * paper[1]:.0f}% less memory" if paper else "")).rstrip())
    return "\n".join(lines)


def plot(path: str, settings: dict, rows: list) -> None:
    """Bar charts per figure, each bar labelled with its ratio to the baseline."""
    import matplotlib  # the eval extra; its backend is chosen before pyplot is imported

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mem_key = "gpu_peak_allocated_mib" if rows[0].get("gpu_peak_allocated_mib") is not None else "rss_above_start_mib"
    panels = [("tokens_per_s_per_gpu", "tokens/s per GPU"), ("step_s_median", "step time (s, median; min-max)"),
              (mem_key, "peak GPU memory allocated (MiB)" if mem_key.startswith("gpu")
               else "peak RSS above start (MiB)"),
              ("saved_activation_mib", "saved activations per micro-batch (MiB)")]
    if rows[0].get("gpu_peak_allocated_mib") is None and rows[0].get("step_cpu_s_median") is not None:
        panels.insert(2, ("step_cpu_s_median", "process CPU time per step (s, median)"))
    if rows[0].get("pipeline_bytes_per_microbatch") is not None:
        panels.append(("pipeline_bytes_per_microbatch", "pipeline bytes per micro-batch"))
    if rows[0].get("mfu") is not None:
        panels.append(("mfu", "MFU"))
    panels = [(k, t) for k, t in panels if any(r.get(k) is not None for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.6), squeeze=False)
    archs = [r["arch"] for r in rows]
    for ax, (key, title) in zip(axes[0], panels):
        values = [r.get(key) or 0.0 for r in rows]
        err = None
        if key == "step_s_median":
            err = [[v - r["step_s_min"] for v, r in zip(values, rows)],
                   [r["step_s_max"] - v for v, r in zip(values, rows)]]
        bars = ax.bar(archs, values, yerr=err, color=["#888888" if a == settings.get("baseline") else "#3b75af"
                                                      for a in archs], capsize=3)
        for bar, r in zip(bars, rows):
            ratio = r.get(f"{key}_ratio")
            if ratio is not None:
                ax.annotate(f"{ratio:.3f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
        ax.margins(y=0.15)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8, rotation=20)
    fig.suptitle(f"{settings.get('shape', '')} | {settings.get('layout', '')} | {settings.get('precision', '')} | "
                 f"{settings.get('device', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
