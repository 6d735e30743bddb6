#!/usr/bin/env python
"""Collect a sweep's results: one table, fits and figures compared the way the paper compares them.

    python tools/collect_grid.py runs --out runs_summary/grid            # every run folder below runs/
    python tools/collect_grid.py runs --sweep ladder --out docs/ladder   # only sweep "ladder" (submit_grid --sweep)
    python tools/collect_grid.py runs --status                           # a sweep in progress: status, step, ETA, Slurm
    python tools/collect_grid.py runs --sweep ladder --wait --out docs/ladder   # once its Slurm jobs have ended
    python tools/collect_grid.py runs --out OUT --wandb                  # also a wandb summary run (offline by default)

(also installed as `megatron-sat-collect-grid`). Writes OUT/grid.csv (one row per run), OUT/table.md (final
validation loss per arch x scale, mean ± sd over seeds, differences to the Transformer and ResFormer, eval
suites, fits, compute multipliers, and every run that is not complete), OUT/fits.json and OUT/scaling.png,
wallclock.png, efficiency.png, made in a temporary folder beside OUT and moved in only once all of them exist.
The columns and rules: megatron_sat/analysis/grid.py (reading runs), collect.py (writing), grid_table.py, scaling.py.
Exit codes: 0 written (or status printed), 2 bad input: one line naming the file or folder, and nothing written.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat.analysis import collect, grid
from megatron_sat.outputs import check_output
from megatron_sat.sweep import records


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
            for path in opts.runs:
                check_output("--output", opts.out, {"RUNS_DIR": path})
        if opts.wait:
            records.wait_for_sweep(opts.runs, opts.sweep, log)
        rows, pending, note = grid.read_runs(opts.runs, opts.sweep, stale_s=3600.0 * opts.stale_hours, log=log)
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
    summary, written = collect.write_results(opts.out, rows, pending, note, runs=opts.runs, sweep=opts.sweep,
                                             title=opts.title, fit_params=opts.fit_params, bootstrap=opts.bootstrap,
                                             log=log)
    if opts.wandb:
        collect.log_wandb(opts.out, rows, summary, written, sweep=opts.sweep, project=opts.wandb_project,
                          mode=opts.wandb_mode, log=log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
