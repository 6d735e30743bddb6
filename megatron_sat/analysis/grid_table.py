"""The paper's comparison of a sweep: grid rows (grid.py) -> cells, fits, multipliers (summarize) -> table.md.

Cells are the complete runs of one arch x scale on the sweep's main data (the data identity most complete runs
share: data path or blend, tokenizer, its vocabulary, the validation set's id): mean, sd and n over seeds of
the final validation loss. Runs of an arch x scale on other data are flagged and summarised apart, never mixed
in. Scales are ordered by their parameter count. Fits (scaling.py) use the cells' means: loss against the
non-embedding parameters (Kaplan's N; --fit-params total for all parameters) and against the training FLOPs.

Which differences are real (difference): each arch minus the Transformer and minus ResFormer at each scale, the
difference of the seed means with a 95 % Welch t interval (unequal variances, Welch-Satterthwaite degrees of
freedom), marked * where the interval excludes 0. Welch's t rather than a bootstrap: a sweep has 2-5 seeds per
cell, and a bootstrap of so few values is too narrow (its spread of a mean of n values is sqrt((n-1)/n) of the
truth, and it only ever sees the values it has), while the t interval covers at its stated rate for normal seed
noise at any n >= 2 (tests/test_collect_grid.py checks 95 % coverage over simulated sweeps). The seeds are not
paired across archs (the same seed gives another initialisation to another model), so no paired test.
"""

import math
import statistics
from collections import Counter
from typing import Dict, List

from megatron_sat.analysis import scaling
from megatron_sat.analysis.evaluation import SUITES
from megatron_sat.archs import ARCHS, PAPER_REFERENCES, REFERENCE

REFERENCES = PAPER_REFERENCES  # the differences the paper reports


def _arch_key(arch):
    return (ARCHS.index(arch) if arch in ARCHS else len(ARCHS), arch)  # megatron_sat.archs' order


def _mean_sd(values):
    values = [float(v) for v in values]
    return (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None, len(values))


LEVEL = 0.95  # of the difference and multiplier intervals


def difference(values: List[float], reference: List[float], level: float = LEVEL) -> dict:
    """mean(values) - mean(reference) with its Welch t interval: {diff, se, df, low, high, significant, n, n_ref};
    low/high/significant None when either side has fewer than 2 seeds (no spread to judge by)."""
    from scipy import stats  # the eval extra, and ~1 s to import: only where an interval is computed

    a, b = [float(v) for v in values], [float(v) for v in reference]
    out = dict(diff=statistics.fmean(a) - statistics.fmean(b), n=len(a), n_ref=len(b), se=None, df=None, low=None,
               high=None, significant=None, level=level)
    if len(a) < 2 or len(b) < 2:
        return out
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0.0:  # identical seeds on both sides: the difference is what it is
        return dict(out, se=0.0, low=out["diff"], high=out["diff"], significant=out["diff"] != 0.0)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = float(stats.t.ppf(0.5 + level / 2.0, df)) * se
    low, high = out["diff"] - half, out["diff"] + half
    return dict(out, se=se, df=df, low=low, high=high, significant=bool(low > 0.0 or high < 0.0))


def summarize(rows: List[dict], fit_params: str = "non_embedding_params", bootstrap: int = 300) -> dict:
    """Everything table.md and fits.json show (JSON-able)."""
    done = [r for r in rows if r["status"] == "complete" and r.get("final_val_loss") is not None]
    main = Counter(r["data_id"] for r in done).most_common(1)[0][0] if done else None
    used = [r for r in done if r["data_id"] == main]
    apart = [r for r in done if r["data_id"] != main]
    by_group: Dict[tuple, List[dict]] = {}
    for r in used:
        by_group.setdefault((r["arch"], r["scale"]), []).append(r)
    size = {}
    for (_arch, scale), runs in by_group.items():
        size.setdefault(scale, []).extend(r[fit_params] for r in runs if r.get(fit_params) is not None)
    scales = sorted(size, key=lambda s: (statistics.median(size[s]) if size[s] else math.inf, s))
    archs = sorted({a for a, _ in by_group}, key=_arch_key)
    cells = {}
    for (arch, scale), runs in by_group.items():
        mean, sd, n = _mean_sd(r["final_val_loss"] for r in runs)
        runs = sorted(runs, key=lambda r: (r["seed"] is None, r["seed"]))
        cells.setdefault(arch, {})[scale] = dict(
            mean=mean, sd=sd, n=n, seeds=[r["seed"] for r in runs], runs=[r["run"] for r in runs],
            losses=[float(r["final_val_loss"]) for r in runs],
            params=statistics.fmean(r[fit_params] for r in runs) if all(r.get(fit_params) for r in runs) else None,
            flops=statistics.fmean(r["train_flops"] for r in runs) if all(r.get("train_flops") for r in runs) else None,
            tokens_per_s_per_gpu=_mean_or_none(r.get("tokens_per_s_per_gpu") for r in runs),
            peak_memory_gib=_mean_or_none(r.get("peak_memory_gib") for r in runs),
            wall_hours=_mean_or_none(r.get("wall_hours") for r in runs),
            evals={k: statistics.fmean(r[k] for r in runs if r.get(k) is not None)
                   for k in sorted({k for r in runs for k in r if k.startswith(("eval:", "eval_avg:"))})})
    # arch x scale groups whose complete runs used more than one data identity
    conflicts = sorted(g for g in {(r["arch"], r["scale"]) for r in done}
                       if len({r["data_id"] for r in done if (r["arch"], r["scale"]) == g}) > 1)
    fits = {}
    for arch in archs:
        fits[arch] = {}
        for key, what in (("params", "params"), ("flops", "flops")):
            pts = {}
            for scale in scales:
                c = cells[arch].get(scale)
                if c is None or c[what] is None:
                    continue
                runs = by_group[(arch, scale)]
                pts.setdefault(c[what], []).extend(r["final_val_loss"] for r in runs)
            try:
                fits[arch][key] = scaling.fit_with_bootstrap(pts, samples=bootstrap)
            except scaling.FitError as e:
                fits[arch][key] = dict(error=str(e))
    multiplier = _multipliers(cells, fits, archs, scales)
    differences = {ref: {a: {sc: difference(cells[a][sc]["losses"], cells[ref][sc]["losses"])
                             for sc in scales if sc in cells[a] and sc in cells[ref]}
                         for a in archs if a != ref}
                   for ref in REFERENCES if ref in cells}
    return dict(fit_params=fit_params, main_data_id=main, differences=differences,
                main_data=next((r["data_identity"] for r in used), None), scales=scales, archs=archs, cells=cells,
                fits=fits, multiplier=multiplier, conflicts=[list(c) for c in conflicts],
                apart=[{k: r[k] for k in ("run", "arch", "scale", "seed", "data_id", "final_val_loss")} for r in apart],
                apart_data={r["data_id"]: r["data_identity"] for r in apart},
                not_complete=[{k: r.get(k) for k in ("run", "arch", "scale", "seed", "status", "step", "train_iters",
                                                     "reason", "slurm_job", "slurm_state")}
                              for r in rows if r not in done])


def _mean_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _multipliers(cells, fits, archs, scales) -> dict:
    ref = REFERENCE
    if ref not in cells:
        return dict(note="no complete Transformer runs: no compute multiplier")
    ref_points = [(c["flops"], c["mean"]) for c in cells[ref].values() if c["flops"]]
    ref_fit = fits.get(ref, {}).get("flops", {})
    out = {}
    for arch in archs:
        if arch == ref:
            continue
        per_scale, from_fits, spread, interval = {}, {}, {}, {}
        for scale in scales:
            c = cells[arch].get(scale)
            if c is None or not c["flops"]:
                continue
            value, extrapolated = scaling.multiplier_measured(ref_points, c["mean"], c["flops"])
            per_scale[scale] = None if value is None else dict(value=float(value), extrapolated=extrapolated)
            fit = fits[arch].get("flops", {})
            if "error" not in fit and "error" not in ref_fit and ref_fit:
                from_fits[scale] = scaling.multiplier_from_fits(fit, ref_fit, c["flops"])
                spread[scale] = scaling.multiplier_spread(fit, ref_fit, c["flops"])
                interval[scale] = scaling.multiplier_interval(fit, ref_fit, c["flops"], LEVEL)
        out[arch] = dict(per_scale=per_scale, from_fits=from_fits, from_fits_sd=spread, from_fits_interval=interval)
    if "error" in ref_fit:
        out["note"] = f"from the fits: none (Transformer: {ref_fit['error']})"
    return out


# ---------------------------------------------------------------------------------------------- markdown
def _num(x, spec=".4f"):
    return "-" if x is None else ("inf" if isinstance(x, float) and math.isinf(x) else format(x, spec))


def _count(n):
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.3g}"


def _table(head, lines):
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return out + ["| " + " | ".join(x) + " |" for x in lines]


def _scale_head(summary, scale):
    params = [c[scale]["params"] for c in summary["cells"].values() if scale in c and c[scale]["params"]]
    return f"{scale} ({_count(statistics.median(params))})" if params else scale


def markdown(summary: dict, title: str) -> str:
    s, scales, archs, cells = summary, summary["scales"], summary["archs"], summary["cells"]
    which = "non-embedding parameters" if s["fit_params"] == "non_embedding_params" else "parameters"
    out = [f"# {title}", ""]
    if s["conflicts"] or s["apart"]:
        out += [f"**Warning:** {len(s['apart'])} complete run(s) used other data, tokenizer or validation set than "
                f"the sweep's main data (id {s['main_data_id']}): kept apart below"
                + (f"; mixed groups: {', '.join(f'{a} {sc}' for a, sc in s['conflicts'])}" if s["conflicts"] else ""),
                ""]
    if not archs:
        out += ["No complete run yet.", ""]
    else:
        out += ["## Final validation loss", "",
                f"Mean ± sd over seeds (n); columns: scale ({which}). Complete runs on the main data "
                f"(id {s['main_data_id']}).", ""]
        out += _table(["arch"] + [_scale_head(s, sc) for sc in scales],
                      [[a] + [_cell(cells[a].get(sc)) for sc in scales] for a in archs])
        for ref, diffs in s.get("differences", {}).items():
            out += ["", f"## Difference to {'the Transformer' if ref == REFERENCE else 'ResFormer'}", "",
                    f"arch minus {ref}, same scale: difference of the seed means [{LEVEL:.0%} Welch t interval] "
                    "(negative: lower loss). **\\*** the interval excludes 0: larger than the seed noise. No interval "
                    "where a side has one seed.", ""]
            out += _table(["arch"] + scales, [[a] + [_diff(diffs[a].get(sc)) for sc in scales]
                                              for a in archs if a != ref])
        out += _eval_tables(s)
        out += _fit_tables(s, which)
    if s["apart"]:
        out += ["", "## Runs on other data (kept apart)", ""]
        out += _table(["run", "arch", "scale", "seed", "data id", "final val loss"],
                      [[r["run"], r["arch"], str(r["scale"]), str(r["seed"]), r["data_id"], _num(r["final_val_loss"])]
                       for r in s["apart"]])
        for key, ident in s["apart_data"].items():
            out.append(f"\ndata {key}: {ident}")
        out.append(f"\nmain data {s['main_data_id']}: {s['main_data']}")
    if s["not_complete"]:
        out += ["", "## Runs not complete (not in the tables above)", ""]
        out += _table(["run", "arch", "scale", "seed", "status", "step", "reason", "slurm job"],
                      [[r["run"], str(r["arch"]), str(r["scale"]), str(r["seed"]), r["status"],
                        f"{r.get('step') if r.get('step') is not None else '-'}/{r.get('train_iters') or '?'}",
                        (r.get("reason") or "").replace("|", "/"),
                        f"{r['slurm_job']} {r.get('slurm_state') or ''}".strip() if r.get("slurm_job") else "-"]
                       for r in s["not_complete"]])
    return "\n".join(out) + "\n"


def _cell(c):
    if c is None:
        return "-"
    return f"{c['mean']:.4f}" + (f" ± {c['sd']:.4f}" if c["sd"] is not None else "") + f" ({c['n']})"


def _diff(d):
    if d is None:
        return "-"
    if d["low"] is None:
        return f"{d['diff']:+.4f} (n={d['n']}/{d['n_ref']})"
    return f"{d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]" + (" **\\***" if d["significant"] else "")


def _eval_tables(s) -> List[str]:
    keys = sorted({k for a in s["cells"].values() for c in a.values() for k in c["evals"]})
    if not keys:
        return []
    out = []
    for suite, tasks in SUITES.items():
        cols = ([f"eval_avg:{suite}"] if f"eval_avg:{suite}" in keys else []) + [
            f"eval:{t}" for t in tasks if f"eval:{t}" in keys]
        if cols:
            out += _eval_table(s, f"{suite} suite", cols)
    others = [k for k in keys if k.startswith("eval:") and not any(k == f"eval:{t}" for ts in SUITES.values() for t in ts)]
    if others:
        out += _eval_table(s, "other tasks", others)
    return out


def _eval_table(s, name, cols) -> List[str]:
    out = ["", f"## Evaluation: {name}", "", "Main metric per task (evaluation.MAIN_METRICS), mean over seeds; "
           "the average column is tools/evaluate.py's suite average.", ""]
    lines = []
    for a in s["archs"]:
        for sc in s["scales"]:
            c = s["cells"][a].get(sc)
            if c and any(k in c["evals"] for k in cols):
                lines.append([a, sc] + [_num(c["evals"].get(k)) for k in cols])
    return out + _table(["arch", "scale"] + [k.split(":", 1)[1] + (" (avg)" if k.startswith("eval_avg") else "")
                                             for k in cols], lines)


def _fit_tables(s, which) -> List[str]:
    out = ["", "## Fits: L = E + A x^(-alpha)", "",
           f"x = {which} (N) or training FLOPs (C), fitted to the per-scale means (scipy, bounded least squares); "
           "± the bootstrap sd over seeds when a scale has 2 or more.", ""]
    lines = []
    for a in s["archs"]:
        for key, label in (("params", "N"), ("flops", "C")):
            f = s["fits"][a][key]
            if "error" in f:
                lines.append([a, label, f"no fit: {f['error']}", "", "", ""])
                continue
            pm = _spread(f.get("bootstrap") or {})
            lines.append([a, label, f"{f['E']:.4f}{pm['E']}", f"{f['A']:.4g}{pm['A']}",
                          f"{f['alpha']:.4f}{pm['alpha']}", f"{f['rmse']:.2g}"
                          + (" (3 points, 3 parameters: exact)" if f["n"] == 3 and not f.get("at_bound") else "")
                          + (f" (at bound: {', '.join(f['at_bound'])})" if f.get("at_bound") else "")])
    out += _table(["arch", "x", "E", "A", "alpha", "rmse"], lines)
    m = s["multiplier"]
    out += ["", "## Compute multiplier against the Transformer", "",
            "Transformer compute that reaches the arch's loss, divided by the arch's compute (> 1: the arch does "
            "as well as a Transformer given that much more compute). Measured: the Transformer's mean (FLOPs, loss) "
            "points interpolated in log-log (~: extrapolated beyond them). Fits: both FLOPs fits [the central "
            f"{LEVEL:.0%} of the paired bootstrap over seeds; with 2-3 seeds per scale narrower than the truth].", ""]
    if "note" in m and len(m) == 1:
        return out + [m["note"]]
    lines = []
    for a, v in m.items():
        if a == "note":
            continue
        lines.append([a, "measured"] + [_mult(v["per_scale"].get(sc)) for sc in s["scales"]])
        lines.append([a, "fits"] + [_num(v["from_fits"].get(sc), ".3f") + _interval(v["from_fits_interval"].get(sc))
                                    for sc in s["scales"]])
    out += _table(["arch", "from"] + s["scales"], lines)
    if "note" in m:
        out += ["", m["note"]]
    return out


def _interval(iv):
    return "" if not iv else f" [{_num(iv[0], '.3f')}, {_num(iv[1], '.3f')}]"


def _spread(bootstrap: dict) -> dict:
    return {k: f" ± {bootstrap[k]['sd']:.3g}" if k in bootstrap else "" for k in ("E", "A", "alpha")}


def _mult(v):
    if v is None:
        return "-"
    return ("~" if v["extrapolated"] else "") + _num(v["value"], ".3f")
