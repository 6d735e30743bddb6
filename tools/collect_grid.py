#!/usr/bin/env python
"""Collect a sweep's results: one table, fits and figures compared the way the paper compares them.

    python tools/collect_grid.py runs --out runs_summary/grid            # every run folder below runs/
    python tools/collect_grid.py runs --sweep ladder --out docs/ladder   # only sweep "ladder" (submit_grid --sweep)
    python tools/collect_grid.py runs --status                           # a sweep in progress: status, step, ETA, Slurm
    python tools/collect_grid.py runs --out OUT --wandb                  # also a wandb summary run (offline by default)

(also installed as `megatron-sat-collect-grid`). Writes OUT/grid.csv (one row per run), OUT/table.md (final
validation loss per arch x scale, mean ± sd over seeds, differences to the Transformer and ResFormer, eval
suites, fits, compute multipliers, and every run that is not complete), OUT/fits.json and OUT/scaling.png,
wallclock.png, efficiency.png. The columns and rules: megatron_sat/analysis/grid.py, grid_table.py, scaling.py.
Exit codes: 0 done, 2 bad input (one line naming the file; nothing written).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from megatron_sat.analysis.collect import main

    sys.exit(main())
