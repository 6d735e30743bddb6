"""Collect a sweep: run folders -> grid.csv, table.md, fits.json and figures (tools/collect_grid.py is the CLI).

    python tools/collect_grid.py runs --out runs_summary/grid                 # every run below runs/
    python tools/collect_grid.py runs --sweep ladder --out docs/ladder        # the runs of one sweep
    python tools/collect_grid.py runs --status                                # a sweep in progress
    python tools/collect_grid.py runs --sweep ladder --wait --out docs/ladder # once its Slurm jobs have ended

Exit codes: 0 written (or status printed), 2 bad input: one line naming the file or folder, and nothing written.
Outputs are made in a temporary folder beside OUT and moved in only once all of them exist.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from megatron_sat.analysis import grid


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="collect_grid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUNS_DIR", help="folders searched for run folders (any depth)")
    p.add_argument("--output", "--out", dest="out",
                                   help="output folder: grid.csv, table.md, fits.json, *.png (not inside a RUNS_DIR); "
                                        "--out: the older name")
    p.add_argument("--status", action="store_true",
                   help="print each run's status, step / total, ETA, last loss and Slurm job instead")
    p.add_argument("--sweep", help="only the runs of this sweep (tools/submit_grid.py --sweep)")
    p.add_argument("--wait", action="store_true",
                   help="with --sweep: first wait until none of the sweep's Slurm jobs is queued or running "
                        "(squeue polled every 5 s, backing off to 60 s)")
    p.add_argument("--fit-params", choices=["non_embedding", "total"], default="non_embedding",
                   help="x of L(N): non-embedding parameters (Kaplan) or all parameters")
    p.add_argument("--bootstrap", type=int, default=300, help="bootstrap resamples over seeds for the fits")
    p.add_argument("--stale-hours", type=float, default=1.0,
                   help="a run with no end line, whose process cannot be asked (another host, no Slurm), counts as "
                        "running while metrics.jsonl changed less than this long ago")
    p.add_argument("--title", default=None, help="title of table.md and the figure")
    p.add_argument("--wandb", action="store_true", help="also log the table and figures as a wandb summary run")
    p.add_argument("--wandb-project", default="megatron-sat")
    p.add_argument("--wandb-mode", choices=["offline", "online"], default=None,
                   help="default: $WANDB_MODE, else offline")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return p


def _select(rows, sweeps, name):
    if not name:
        return rows, sweeps
    sweeps = [s for s in sweeps if s["sweep"] == name]
    listed = {e["run"] for s in sweeps for a in s["arrays"] for e in a["entries"]}
    rows = [r for r in rows if r.get("sweep") == name or r["run"] in listed]
    if not rows and not sweeps:
        raise grid.GridError(f"no run of sweep {name!r} below the folders given")
    return rows, sweeps


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


def _wandb(opts, out, rows, summary, paths, log) -> None:
    import wandb

    sweeps = sorted({r.get("sweep") for r in rows if r.get("sweep")})
    group = opts.sweep or (sweeps[0] if len(sweeps) == 1 else None)
    mode = opts.wandb_mode or os.environ.get("WANDB_MODE") or "offline"
    run = wandb.init(project=opts.wandb_project, group=group, name=f"grid-summary-{group or 'runs'}",
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


def _wait(opts, log) -> None:
    """Return once none of the sweep's recorded Slurm jobs (array tasks, requeued jobs) is in squeue."""
    delay, since = 5.0, time.time()
    while True:
        records = [s for s in grid.sweep_records(opts.runs) if s["sweep"] == opts.sweep]
        if not records:
            raise grid.GridError(f"--wait: no record of sweep {opts.sweep!r} below {', '.join(opts.runs)} "
                                 "(<runs>/_grid/<sweep>.json, written by submit_grid --submit)")
        jobs = {str(j) for r in records for a in r["arrays"] for j in a.get("jobs") or [a["job"]]}
        queue = grid.squeue_states()
        if queue is None:
            raise grid.GridError("--wait: squeue does not answer (run this where Slurm's commands work)")
        live = sorted({j.split("_")[0] for j in queue} & jobs)
        if not live:
            log(f"collect_grid: no job of sweep {opts.sweep} is queued or running ({time.time() - since:.0f} s waited)")
            return
        log(f"collect_grid: waiting for job(s) {', '.join(live)} of sweep {opts.sweep} ...")
        time.sleep(delay)
        delay = min(60.0, delay * 1.5)


def main(argv=None) -> int:
    opts = _parser().parse_args(argv)
    log = (lambda text: None) if opts.quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    if not opts.status and not opts.out:
        print("collect_grid: error: give --out OUT (or --status)", file=sys.stderr)
        return 2
    if opts.wait and not opts.sweep:
        print("collect_grid: error: --wait needs --sweep NAME (the sweep whose jobs to wait for)", file=sys.stderr)
        return 2
    try:
        if opts.out:
            from megatron_sat.outputs import check_output

            for path in opts.runs:
                check_output("--out", opts.out, {"RUNS_DIR": path})
        if opts.wait:
            _wait(opts, log)
        paths = grid.find_runs(opts.runs)
        log(f"collect_grid: {len(paths)} run folder(s) below {', '.join(opts.runs)}")
        slurm = grid.squeue_states()
        rows = []
        for i, path in enumerate(paths, start=1):
            if not opts.quiet and (i == len(paths) or i % 10 == 1):
                log(f"  reading {i}/{len(paths)}: {os.path.relpath(path)}")
            rows.append(grid.read_run(path, slurm, stale_s=3600.0 * opts.stale_hours))
        rows, sweeps = _select(rows, grid.sweep_records(opts.runs), opts.sweep)
        pending = grid.pending_entries(sweeps, rows, slurm)
        # finished jobs: Slurm's final state, exit code and elapsed time from its accounting (sacct)
        accounting, note = grid.sacct_states(r["slurm_job"] for r in rows + pending
                                             if r.get("slurm_state") not in grid.ACTIVE_SLURM)
        grid.add_final_states(rows + pending, accounting, note)
    except (grid.GridError, ValueError) as e:
        print(f"collect_grid: error: {e}", file=sys.stderr)
        return 2
    if opts.status:
        print(grid.status_table(rows, pending, note))
        return 0
    if not rows:
        print(f"collect_grid: error: no run of {f'sweep {opts.sweep}' if opts.sweep else 'the folders given'} has "
              "started yet (--status shows the queue)", file=sys.stderr)
        return 2
    from megatron_sat.analysis import grid_figures, grid_table

    counts = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    log(f"collect_grid: {len(rows)} run(s): " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        + (f"; {len(pending)} grid entr{'y' if len(pending) == 1 else 'ies'} not started" if pending else ""))
    if note:
        log(f"collect_grid: {note}: final states of finished Slurm jobs are unknown")
    log("collect_grid: fitting (scipy; bootstrap over seeds where there are 2 or more) ...")
    fit_params = "non_embedding_params" if opts.fit_params == "non_embedding" else "params"
    summary = grid_table.summarize(rows, fit_params=fit_params, bootstrap=opts.bootstrap)
    summary["not_complete"] += [{k: p.get(k) for k in ("run", "arch", "scale", "seed", "status", "slurm_job",
                                                        "slurm_state", "reason")} for p in pending]
    title = opts.title or (f"Sweep {opts.sweep}" if opts.sweep else "Scaling grid")
    stamp = time.strftime("%Y-%m-%d %H:%M")
    table = grid_table.markdown(summary, title).replace(
        "\n", f"\n{len(rows)} run(s) collected {stamp} from {', '.join(opts.runs)}; status: "
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
    written = _write(opts.out, files, lambda folder: grid_figures.write_figures(folder, rows, summary, title))
    for path in written:
        log(f"wrote {path}")
    if opts.wandb:
        _wandb(opts, opts.out, rows, summary, written, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
