"""A sweep's results written out: grid.csv, table.md, fits.json and the figures in one folder, and a wandb summary
run. The rows come from megatron_sat/analysis/grid.py (read_runs); tools/collect_grid.py is the command line:

    python tools/collect_grid.py runs --sweep ladder --out docs/ladder

Outputs are made in a temporary folder beside OUT and moved in only once all of them exist.
"""

import json
import os
import shutil
import tempfile
import time
from typing import Callable, List, Optional

from megatron_sat.analysis import grid, grid_figures, grid_table


def _write(out: str, files: dict, figures) -> list:
    """Everything into a temporary folder beside `out`, then moved in; returns the paths written."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".collect_grid-", dir=parent)
    try:
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        figures(tmp)
        names = sorted(os.listdir(tmp))
        if not os.path.exists(out):
            os.rename(tmp, out)
        else:
            for name in names:
                os.replace(os.path.join(tmp, name), os.path.join(out, name))
        return [os.path.join(out, n) for n in names]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def runs_named(runs: List[str], out: str) -> List[str]:
    """The runs folders as a published table names them: a relative path as given, an absolute one relative to the
    output folder (never the absolute path of the machine that collected them, e.g. a temporary folder)."""
    return [os.path.relpath(r, os.path.abspath(out)) if os.path.isabs(r) else os.path.normpath(r) for r in runs]


def write_results(out: str, rows: List[dict], pending: List[dict], note: Optional[str], *, runs: List[str],
                  sweep: Optional[str] = None, title: Optional[str] = None, fit_params: str = "non_embedding",
                  bootstrap: int = 300, log: Callable[[str], None] = lambda text: None):
    """(summary, paths written): grid.csv, table.md, fits.json and the figures of `rows` (grid.read_runs; at least
    one) into `out`, the `pending` entries listed among the runs that are not complete. fit_params: x of L(N),
    "non_embedding" (Kaplan) or "total" parameters; bootstrap: resamples over seeds for the fits."""
    counts = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    log(f"collect_grid: {len(rows)} run(s): " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        + (f"; {len(pending)} grid entr{'y' if len(pending) == 1 else 'ies'} not started" if pending else ""))
    if note:
        log(f"collect_grid: {note}: final states of finished Slurm jobs are unknown")
    log("collect_grid: fitting (scipy; bootstrap over seeds where there are 2 or more) ...")
    fit_x = "non_embedding_params" if fit_params == "non_embedding" else "params"
    summary = grid_table.summarize(rows, fit_params=fit_x, bootstrap=bootstrap)
    summary["not_complete"] += [{k: p.get(k) for k in ("run", "arch", "scale", "seed", "status", "slurm_job",
                                                        "slurm_state", "reason")} for p in pending]
    title = title or (f"Sweep {sweep}" if sweep else "Scaling grid")
    stamp = time.strftime("%Y-%m-%d %H:%M")
    table = grid_table.markdown(summary, title).replace(
        "\n", f"\n{len(rows)} run(s) collected {stamp} from {', '.join(runs_named(runs, out))}; status: "
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + "."
        + (f" {note}: final states of finished Slurm jobs are unknown." if note else "") + "\n", 1)
    fits = {k: summary[k] for k in ("fit_params", "main_data_id", "main_data", "scales", "archs", "multiplier",
                                    "differences", "conflicts")}
    fits["fits"] = {a: {k: {x: y for x, y in f.items() if x != "draws"} for k, f in v.items()}
                    for a, v in summary["fits"].items()}
    fits["cells"] = summary["cells"]
    files = {"grid.csv": grid.grid_csv(rows), "table.md": table,
             "fits.json": json.dumps(fits, indent=1, default=str, allow_nan=True)}
    log("collect_grid: figures ...")
    written = _write(out, files, lambda folder: grid_figures.write_figures(folder, rows, summary, title))
    for path in written:
        log(f"wrote {path}")
    return summary, written


def log_wandb(out: str, rows: List[dict], summary: dict, paths: List[str], *, sweep: Optional[str] = None,
              project: str = "megatron-sat", mode: Optional[str] = None,
              log: Callable[[str], None] = lambda text: None) -> None:
    """A wandb summary run in `out`/wandb (group: the sweep): the grid as a table, the figures among `paths`, and
    each cell's final validation loss in its summary. mode: online / offline (default $WANDB_MODE, else offline)."""
    import wandb  # the train extra: only --wandb needs it

    sweeps = sorted({r.get("sweep") for r in rows if r.get("sweep")})
    group = sweep or (sweeps[0] if len(sweeps) == 1 else None)
    mode = mode or os.environ.get("WANDB_MODE") or "offline"
    run = wandb.init(project=project, group=group, name=f"grid-summary-{group or 'runs'}",
                     job_type="grid-summary", mode=mode, dir=out,
                     config=dict(runs=len(rows), archs=summary["archs"], scales=summary["scales"], sweep=group))
    columns = [c for c in grid.COLUMNS if c != "path"]
    table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
    images = {f"figures/{os.path.basename(p)[:-4]}": wandb.Image(p) for p in paths if p.endswith(".png")}
    run.log(dict(grid=table, **images))
    for arch, cells in summary["cells"].items():
        for scale, c in cells.items():
            run.summary[f"final_val_loss/{arch}/{scale}"] = c["mean"]
    run.finish()
    log(f"wandb: {mode} summary run in {out}/wandb (group {group})")
