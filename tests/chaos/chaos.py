#!/usr/bin/env python
"""Chaos run: a small sweep on a private two-node Slurm cluster, with many faults injected while it trains.

    .venv/bin/python tests/chaos/chaos.py --faults 30 --seed 1 --out /tmp/chaos     # the long run (docs/reliability_signals.md)
    .venv/bin/python tests/chaos/chaos.py --faults 10 --seed 3 --out /tmp/chaos     # the size tests/test_chaos.py runs

A test harness, not a tool for a production cluster (it lives in tests/, not in the installed package): it kills
slurmd daemons and fills disks. It starts its own cluster, tests/slurm_cluster.py's SlurmCluster(nodes=2) (Debian's
Slurm from `make slurm`, root for the tmpfs), so it needs a source checkout. It submits a sweep with
tools/submit_grid.py (debug recipes, one rank per node: DP2 over n1 and n2), puts every run folder on a small tmpfs,
and injects --faults faults of the kinds in
tests/chaos/chaos_faults.py (every kind once before any twice), kinds and moments (steps after a run's last recovery)
drawn from random.Random(--seed), each into the ready run with the most steps left. A run whose job ends for good
is resubmitted (`sbatch --array=I slurm/array.sbatch MANIFEST`), as its owner would. The same entries also train
fault-free (torchrun, the same DP2 layout, on local disk).

At the end it checks, and exits 1 naming what failed: every run COMPLETED; its final checkpoint's tensors (weights
and optimizer state) bit-identical to the fault-free run's (the same layout, so the same reduction order: no
tolerance), which also means no step was trained twice into it; every fault named in the run's Slurm log (or, for
a node loss, by Slurm's job state; for readers, by their exit status); collect_grid's restarts equal the restarts
the faults caused. Prints one line per fault (kind, when, how detected, recovery time, steps redone) and writes
OUT/chaos.json. Exit codes: 0 all checks hold, 1 a check failed, 2 bad input or no Slurm here.
"""

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))  # tests/chaos
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE), HERE]  # the checkout, tests/, here

import chaos_sweep as cs  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=30, help="faults to inject over the sweep (default 30)")
    p.add_argument("--seed", type=int, default=1, help="seed of the random stream that draws faults, runs, moments")
    p.add_argument("--archs", default="transformer,satformer", help="debug recipes of the sweep (one run each)")
    p.add_argument("--out", required=True, help="work folder: runs, logs, references, chaos.json (created)")
    p.add_argument("--hang-timeout-s", type=float, default=24.0, help="the runs' --hang-timeout-minutes, in s (a first save on a "
                   "loaded 2-core machine took over 12 s: a false hang)")
    p.add_argument("--keep-cluster", action="store_true", help="leave the cluster's folder (logs) in OUT/slurm")
    return p


def main(argv=None) -> int:
    opts = _parser().parse_args(argv)
    if opts.faults < 1 or opts.hang_timeout_s < 6:
        print("chaos: error: --faults must be >= 1 and --hang-timeout-s >= 6 (the watchdog's floor)", file=sys.stderr)
        return 2
    if os.path.exists(opts.out) and os.listdir(opts.out):
        print(f"chaos: error: --out {opts.out} is not empty: give a new folder", file=sys.stderr)
        return 2
    try:
        from slurm_cluster import SlurmCluster, SlurmUnavailable
    except ImportError:
        print("chaos: error: tests/slurm_cluster.py not found: run it from a megatron-sat source checkout",
              file=sys.stderr)
        return 2
    archs = [a for a in opts.archs.split(",") if a]
    rng = random.Random(opts.seed)
    plan = cs.draw(rng, opts.faults, len(archs))
    os.makedirs(os.path.join(opts.out, "slurm") if opts.keep_cluster else opts.out, exist_ok=True)
    cluster = SlurmCluster(nodes=2, root=os.path.join(os.path.abspath(opts.out), "slurm") if opts.keep_cluster
                           else None, keep=opts.keep_cluster, log=lambda *a: None)
    try:
        cluster.start()
    except SlurmUnavailable as e:
        print(f"chaos: error: {e}", file=sys.stderr)
        return 2
    sweep = None
    try:
        sweep = cs.Sweep(cluster, os.path.abspath(opts.out), archs, opts.faults, opts.hang_timeout_s, rng,
                         f"chaos-s{opts.seed}")
        sweep.submit()
        sweep.run(plan)
        result = sweep.verify()
    finally:
        if sweep is not None:
            sweep.cleanup()
        cluster.stop()
    with open(os.path.join(opts.out, "chaos.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))
    for problem in result["problems"]:
        print(f"chaos: FAILED: {problem}")
    failed = len(result["problems"])
    print(f"chaos: {len(result['faults'])} faults in {result['wall_s']:.0f} s; "
          + (f"{failed} check(s) failed" if failed else "all checks hold"))
    return 1 if result["problems"] else 0


def table(result: dict) -> str:
    head = ["#", "fault", "run", "when", "detected by", "named", "recovery", "steps redone"]
    rows = []
    for i, f in enumerate(result["faults"], 1):
        rows.append([str(i), f["kind"], f["run"], f"{f['t']:.0f} s, step {f['step']}",
                     f"{f['detected_by']}{' (' + f['detail'] + ')' if f.get('detail') else ''}",
                     "yes" if f["named"] else "NO",
                     f"{f['recovery_s']:.0f} s" if f.get("recovery_s") is not None else "-",
                     str(f["redone"]) if f.get("redone") is not None else "-"])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    fmt = lambda cols: " | ".join(c.ljust(w) for c, w in zip(cols, widths))  # noqa: E731
    return "\n".join([fmt(head), "-|-".join("-" * w for w in widths)] + [fmt(r) for r in rows])


if __name__ == "__main__":
    sys.exit(main())
