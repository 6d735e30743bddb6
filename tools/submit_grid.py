"""Submit the scaling grid (archs x scales x seeds) to Slurm as job arrays, or print what would be submitted.

    python tools/submit_grid.py --dry-run                                   # whole grid: table + sbatch lines
    python tools/submit_grid.py --dry-run --check-layouts --scales 1.3B     # + each entry's layout dry-run on CPU
    python tools/submit_grid.py --archs satformer,resformer --scales 760M --seeds 1,2 --submit
    python tools/submit_grid.py --scales 1.3B --segments 3 --time 08:00:00 --submit   # 3 chained jobs per array
    python tools/submit_grid.py --archs transformer,satformer --scales debug --submit -- --train-iters 10
    python tools/submit_grid.py --resolve satformer_760M -- --seed 2   # run name + steps (used by slurm/launch.sh)
    python tools/submit_grid.py --resolve satformer_760M --pin P.json -- --seed 2   # the name pinned at a job's start
    python tools/submit_grid.py --archs transformer,satformer --scales ladder1,ladder2,ladder3 --sweep ladder --submit

--sweep NAME names the sweep (default grid-<date>-<time>): its runs form one wandb group (MSAT_SWEEP in the
jobs' environment), config.json records it, and <runs>/_grid/NAME.json lists its entries and job ids, so that
`python tools/collect_grid.py <runs> --sweep NAME --out OUT` (or --status) reads it back.

Everything after `--` is passed to the trainer (any `python -m megatron_sat.train` flag) for every entry.
Entries with the same cluster shape (nodes, GPUs per node, time) go into one job array (slurm/array.sbatch
over a manifest file, one entry per line); each task resumes from its run folder and requeues itself at
the time limit. --segments N instead submits each array N times, each --dependency=afterany on the one
before, with self-requeue off (for clusters that forbid requeue or cap restarts).

Site settings (account, partition, logs and runs folders, container, GPUs or not): the file named by $MSAT_SITE,
else site.sh beside the sbatch scripts (`--slurm-dir` prints their folder: slurm/ in a checkout, inside the
installed package otherwise). Relative paths (runs, logs) are relative to the current folder, where the jobs run
too. Scale `debug` maps to the tiny CPU recipes debug_<arch> (1 node, 2 processes).
Entries, run-folder names, plans and sbatch arguments: megatron_sat/sweep/plan.py; manifests, sbatch calls and the
sweep's record: megatron_sat/sweep/submit.py (this file parses and prints). GPU hours come from the step-time model's
predicted step at each entry's layout (megatron_sat/steptime; the total with the model's error band);
--mfu F replaces the prediction by an assumed MFU (FLOPs / (peak x F)) for every entry. A trainer
flag after `--` may be --config FILE: every entry is resolved as the trainer resolves it (recipe < config file <
flags), and --resolve prints the trainer's own step count (after --train-samples).
"""

import argparse
import os
import shlex
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from megatron_sat.sweep.pins import check_pin, named_values
from megatron_sat.sweep.plan import build, needs_data, resolve, site_settings, table
from megatron_sat.sweep.records import check_sweep_name
from megatron_sat.sweep.submit import check_layouts, submit
from megatron_sat.training.arguments import unnamed_dests
from recipes.paper import ARCHS, SCALES

# the sbatch scripts: inside the installed package (megatron_sat_tools/slurm), or the checkout's slurm/ folder
SLURM_DIR = next(d for d in (os.path.join(HERE, "slurm"), os.path.join(ROOT, "slurm")) if os.path.isdir(d))
CHECKOUT = os.path.isfile(os.path.join(ROOT, "megatron_sat", "train.py")) and os.path.basename(HERE) == "tools"


def _csv(conv, what: str):
    """An argparse type for comma-separated values; its error says what a value must be."""
    def parse(text: str) -> list:
        try:
            return [conv(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated {what}, e.g. 1,2,3") from None

    parse.__name__ = f"comma-separated {what}"
    return parse


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    trainer_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", type=_csv(str, "names"), default=list(ARCHS), help="comma-separated (default: all)")
    p.add_argument("--scales", type=_csv(str, "names"), default=list(SCALES),
                   help=f"comma-separated from {SCALES} or debug")
    p.add_argument("--seeds", type=_csv(int, "integers"), default=[1234], help="comma-separated integers")
    p.add_argument("--nodes", type=int, help="override every entry's node count")
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--gpu", help="GPU kind for the memory check and GPU hours (H100, H200, A100, cpu)")
    p.add_argument("--time", help="Slurm time limit per job, e.g. 08:00:00")
    p.add_argument("--segments", type=int, default=1, help="chain N jobs per array with afterany dependencies")
    p.add_argument("--max-parallel", type=int, default=None, help="array throttle: at most K tasks at once")
    p.add_argument("--mfu", type=float, default=None,
                   help="an assumed MFU for the GPU hours, overriding the step-time model's predicted step time")
    p.add_argument("--sweep", default=None, help="the sweep's name (default grid-<date>-<time>): wandb group, "
                                                  "collect_grid.py --sweep")
    p.add_argument("--check-layouts", action="store_true",
                   help="dry-run each distinct entry (recipe, flags, cluster; not the seed) on one CPU before anything "
                        "is submitted: the real model at full size on a fake world, checked against its plan "
                        "(tools/dry_run.py); any failure stops here with exit 1")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the table and sbatch lines (default)")
    mode.add_argument("--submit", action="store_true", help="write the manifests and submit")
    mode.add_argument("--resolve", metavar="RECIPE", help="print RUN_NAME, TRAIN_ITERS, NEEDS_DATA for the shell")
    p.add_argument("--pin", metavar="FILE", help="with --resolve: the job's run pin (megatron_sat/sweep/pins.py; "
                                                 "slurm/launch.sh): written at its first start; later, a "
                                                 "configuration that names another run is refused, exit 2")
    mode.add_argument("--slurm-dir", action="store_true", help="print the folder of the sbatch scripts and site.sh")
    opts = p.parse_args(argv)

    if opts.slurm_dir:
        print(SLURM_DIR)
        return 0

    if opts.pin and not opts.resolve:
        print("error: --pin goes with --resolve (slurm/launch.sh's call)", file=sys.stderr)
        return 2
    if opts.resolve:
        try:
            args, name = resolve(opts.resolve, trainer_flags)
            if opts.pin:
                name = check_pin(opts.pin, name, named_values(args, unnamed_dests()), job=os.environ.get("MSAT_JOB"))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"RUN_NAME={shlex.quote(name)}\nTRAIN_ITERS={args.train_iters}\nNEEDS_DATA={int(needs_data(args))}")
        return 0

    warnings.filterwarnings("ignore")
    site_file = os.path.abspath(os.environ.get("MSAT_SITE", os.path.join(SLURM_DIR, "site.sh")))
    if not os.path.isfile(site_file):
        print(f"error: site settings {site_file} not found: set MSAT_SITE to your copy of "
              f"{os.path.join(SLURM_DIR, 'site.sh')}", file=sys.stderr)
        return 2
    site = site_settings(site_file)
    try:
        rows, groups = build(opts.archs, opts.scales, opts.seeds, trainer_flags, mfu=opts.mfu,
                             cluster_overrides=dict(nodes=opts.nodes, gpus_per_node=opts.gpus_per_node, gpu=opts.gpu,
                                                    time=opts.time))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    invalid = [r for r in rows if not r["plan"].ok]
    if invalid:
        print(f"\nerror: {len(invalid)} invalid plan(s); see tools/plan_layout.py --recipe NAME", file=sys.stderr)
        return 1
    if opts.check_layouts and not check_layouts(rows, say=lambda line: print(line, flush=True)):
        print("\nerror: a dry run failed; see python tools/dry_run.py --recipe NAME (with the same flags)",
              file=sys.stderr)
        return 1
    runs_dir = site.get("MSAT_RUNS", "runs")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        sweep = check_sweep_name(opts.sweep or f"grid-{stamp}")
    except ValueError as e:
        print(f"error: --sweep: {e}", file=sys.stderr)
        return 2
    print(f"\n# site settings: {site_file}; jobs run in {os.getcwd()}")
    # the jobs find launch.sh through MSAT_SLURM_DIR, this checkout's code through MSAT_REPO, and run under this
    # Python unless the site file or the environment names another (a container uses its own)
    env = dict(os.environ, MSAT_SLURM_DIR=SLURM_DIR, MSAT_SITE=site_file, MSAT_SWEEP=sweep)
    env.setdefault("MSAT_PYTHON", sys.executable)
    if CHECKOUT:
        env["MSAT_REPO"] = ROOT
    try:
        path = submit(groups, site=site, env=env, slurm_dir=SLURM_DIR, sweep=sweep, stamp=stamp, really=opts.submit,
                      manifest_dir=os.path.join(os.path.abspath(runs_dir), "_grid"), segments=opts.segments,
                      max_parallel=opts.max_parallel, say=lambda line: print(line, flush=True))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if path:
        print(f"sweep {sweep}: {path}\n  status:  python tools/collect_grid.py {runs_dir} --sweep {sweep} --status"
              f"\n  results: python tools/collect_grid.py {runs_dir} --sweep {sweep} --out OUT")
    return 0


if __name__ == "__main__":
    sys.exit(main())
