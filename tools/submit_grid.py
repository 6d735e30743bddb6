"""Submit the scaling grid (archs x scales x seeds) to Slurm as job arrays, or print what would be submitted.

    python tools/submit_grid.py --dry-run                                   # whole grid: table + sbatch lines
    python tools/submit_grid.py --dry-run --check-layouts --scales 1.3B     # + each entry's layout dry-run on CPU
    python tools/submit_grid.py --archs satformer,resformer --scales 760M --seeds 1,2 --submit
    python tools/submit_grid.py --scales 1.3B --segments 3 --time 08:00:00 --submit   # 3 chained jobs per array
    python tools/submit_grid.py --archs transformer,satformer --scales debug --submit -- --train-iters 10
    python tools/submit_grid.py --resolve satformer_760M -- --seed 2   # run name + steps (used by slurm/launch.sh)
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
GPU hours come from the FLOPs count (megatron_sat.model.flops: 3 x forward, attention included) at an
assumed MFU (--mfu, default 0.40).
"""

import argparse
import hashlib
import os
import shlex
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
# the sbatch scripts: inside the installed package (megatron_sat_tools/slurm), or the checkout's slurm/ folder
SLURM_DIR = next(d for d in (os.path.join(HERE, "slurm"), os.path.join(ROOT, "slurm")) if os.path.isdir(d))
CHECKOUT = os.path.isfile(os.path.join(ROOT, "megatron_sat", "train.py")) and os.path.basename(HERE) == "tools"

# trainer arguments that do not change what a run computes: left out of its folder name, so that a run can
# be resumed under another layout, batch split, logging or checkpoint cadence.
NAME_IGNORES = {
    "recipe", "save", "load", "ckpt_step", "save_interval", "save_final", "exit_interval", "exit_duration_in_mins",
    "eval_interval", "eval_iters", "log_interval", "wandb_project", "wandb_exp_name", "wandb_mode", "peak_tflops",
    "progress_bar", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "num_virtual_stages_per_pipeline_rank", "sequence_parallel", "use_distributed_optimizer", "overlap_grad_reduce",
    "micro_batch_size", "recompute_granularity", "recompute_num_layers", "data_cache_path", "bf16",
    "debug_inject_nan_at_step", "data_path", "tokenizer_model", "split",
    "save_retain_interval", "async_save", "verify_checkpoint", "ckpt_fallback", "allow_tokenizer_mismatch",
    "debug_save_delay", "debug_fail_save_at", "eval_samples", "train_data_path", "valid_data_path", "test_data_path",
    "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler", "distributed_timeout_minutes",
    "hang_timeout_minutes", "tensorboard_dir",
}
NAMED = ("lr", "global_batch_size", "seq_length", "train_iters", "seed")  # spelled out in the name


def _recipes():
    from megatron_sat.training.planner import load_recipes

    return load_recipes()


def resolve(recipe: str, overrides=()):
    """(trainer args Namespace, run name) for a recipe + trainer flags, with the trainer's own parser."""
    recipes = _recipes()
    from megatron_sat.training.arguments import build_parser, recipe_args

    defaults = {a.dest: a.default for a in build_parser()._actions}
    args = recipe_args(recipe, overrides)
    rest = {k: v for k, v in sorted(vars(args).items())
            if k not in NAME_IGNORES and k not in NAMED and v != recipes.get(recipe).get(k, defaults.get(k))}
    name = (f"{recipe}_lr{args.lr:g}_gbs{args.global_batch_size}_seq{args.seq_length}"
            f"_it{args.train_iters}_s{args.seed}")
    if rest:
        name += "_" + hashlib.sha1(repr(rest).encode()).hexdigest()[:8]
    return args, name


def needs_data(args) -> bool:
    return not (args.data_path or args.train_data_path or args.mock_data or args.embedded_data)


def site_settings(site: str) -> dict:
    """Values of the site file (sourced by bash): MSAT_* and SBATCH_* variables."""
    script = f'set -a && source {shlex.quote(site)} >/dev/null && env -0'  # set -a: export what it sets
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    env = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    return {k: v for k, v in env.items() if k.startswith(("MSAT_", "SBATCH_"))}


def _csv(conv, what: str):
    """An argparse type for comma-separated values; its error says what a value must be."""
    def parse(text: str) -> list:
        try:
            return [conv(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated {what}, e.g. 1,2,3") from None

    parse.__name__ = f"comma-separated {what}"
    return parse


def _entries(archs, scales, seeds):
    from recipes.paper import cluster, recipe_name

    recipes = _recipes()
    out = []
    for scale in scales:
        for arch in archs:
            name = recipe_name(arch, scale)
            if name not in recipes.RECIPES:
                raise SystemExit(f"error: no recipe {name!r} (arch {arch!r} at scale {scale!r}); "
                                 f"known: {', '.join(sorted(recipes.RECIPES))}")
            for seed in seeds:
                out.append(dict(recipe=name, arch=arch, scale=scale, seed=seed, cluster=cluster(name)))
    return out


def _tokens(n):
    from megatron_sat.training.planner import _tokens as fmt

    return fmt(n)


def _hours(h):
    return "-" if h is None else (f"{h:,.0f}" if h >= 10 else f"{h:.1f}")


def build(opts, trainer_flags):
    """Grid entries with plans and run names, and the array groups."""
    from megatron_sat.training.arguments import arch_flag_errors
    from megatron_sat.training.planner import make_plan

    rows = []
    for e in _entries(opts.archs, opts.scales, opts.seeds):
        flags = [*trainer_flags, "--seed", str(e["seed"])]
        args, name = resolve(e["recipe"], flags)
        c = dict(e["cluster"])
        for key in ("nodes", "gpus_per_node", "gpu", "time"):
            if getattr(opts, key) is not None:
                c[key] = getattr(opts, key)
        plan = make_plan(args, recipe=e["recipe"], nodes=c["nodes"], gpus_per_node=c["gpus_per_node"], gpu=c["gpu"],
                         mfu=opts.mfu)
        plan.errors += arch_flag_errors(args)  # e.g. full recompute with a dense arch (the planner does not build it)
        rows.append(dict(e, flags=flags, name=name, cluster=c, plan=plan, args=args))
    groups = {}
    for r in rows:
        c = r["cluster"]
        groups.setdefault((r["scale"], c["nodes"], c["gpus_per_node"], c["gpu"], c["time"]), []).append(r)
    return rows, groups


def table(rows) -> str:
    from megatron_sat.archs import BASELINES

    head = ["recipe", "seed", "params", "tokens", "iters", "nodes x gpus", "layout", "mem GiB", "GPU h", "wall h",
            "run folder"]
    lines = []
    for r in rows:
        p = r["plan"]
        mem = f"{p.memory['total']:.0f}" if p.memory and p.capacity_gib else "-"
        status = "" if p.ok else "  INVALID: " + "; ".join(p.errors)
        lines.append([r["recipe"], str(r["seed"]), f"{p.parameters / 1e6:,.1f}M", _tokens(p.tokens),
                      f"{p.train_iters:,}", f"{p.nodes} x {p.gpus_per_node} {p.gpu}", p.layout, mem,
                      _hours(p.gpu_hours), _hours(p.wall_hours), r["name"] + status])
    widths = [max(len(x[i]) for x in [head] + lines) for i in range(len(head))]
    fmt = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()  # noqa: E731
    out = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(x) for x in lines]
    total = sum(r["plan"].gpu_hours or 0 for r in rows)
    out.append(f"{len(rows)} run(s), {total:,.0f} GPU hours in all (at {100 * rows[0]['plan'].mfu:.0f}% MFU)"
               if rows else "no runs")
    baselines = sorted({r["arch"] for r in rows if r["arch"] in BASELINES})
    if baselines:
        out.append(f"note: mem GiB counts the extra activations of {', '.join(baselines)} as checked on CPU, "
                   "not yet measured on a GPU (see tools/plan_layout.py --recipe NAME)")
    return "\n".join(out)


def check_layouts(rows) -> bool:
    """Dry-run every distinct entry of `rows` (the seed does not change the layout); prints one line each."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from megatron_sat.profiling.dry_run import dry_run

    seen, ok = set(), True
    for r in rows:
        c = r["cluster"]
        flags = [f for i, f in enumerate(r["flags"]) if f != "--seed" and (i == 0 or r["flags"][i - 1] != "--seed")]
        key = (r["recipe"], tuple(flags), c["nodes"], c["gpus_per_node"], c["gpu"])
        if key in seen:
            continue
        seen.add(key)
        args, _ = resolve(r["recipe"], r["flags"])
        report = dry_run(args, recipe=r["recipe"], nodes=c["nodes"], gpus_per_node=c["gpus_per_node"], gpu=c["gpu"])
        status = (f"OK ({len(report.roles)} rank role(s), {report.seconds:.0f} s)" if report.ok
                  else f"FAILED: {report.failure}")
        print(f"dry-run {r['recipe']} {report.layout} on {c['nodes']} x {c['gpus_per_node']} {c['gpu']}: {status}",
              flush=True)
        ok &= report.ok
    if not ok:
        print("\nerror: a dry run failed; see python tools/dry_run.py --recipe NAME (with the same flags)",
              file=sys.stderr)
    return ok


def sbatch_args(key, n, site, opts, manifest, dependency=None):
    scale, nodes, gpn, gpu, time_limit = key
    logs = site.get("MSAT_LOGS", "logs")
    args = [f"--job-name=msat-{scale}", f"--array=0-{n - 1}" + (f"%{opts.max_parallel}" if opts.max_parallel else ""),
            f"--nodes={nodes}", f"--ntasks-per-node={gpn}", f"--cpus-per-task={site.get('MSAT_CPUS_PER_TASK', '8')}",
            f"--time={time_limit}", f"--output={os.path.join(logs, '%x-%A_%a.out')}"]
    if gpu != "cpu" and site.get("MSAT_GPUS", "1") != "0":
        args.append(f"--gpus-per-node={gpn}")
    if opts.segments > 1:
        args.append("--export=ALL,MSAT_REQUEUE=0")
    if dependency:
        args.append(f"--dependency=afterany:{dependency}")
    args += shlex.split(site.get("MSAT_SBATCH_EXTRA", ""))
    return args + [os.path.join(SLURM_DIR, "array.sbatch"), manifest]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    trainer_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    from recipes.paper import ARCHS, SCALES

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
    p.add_argument("--mfu", type=float, default=0.40)
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
    mode.add_argument("--slurm-dir", action="store_true", help="print the folder of the sbatch scripts and site.sh")
    opts = p.parse_args(argv)

    if opts.slurm_dir:
        print(SLURM_DIR)
        return 0

    if opts.resolve:
        try:
            args, name = resolve(opts.resolve, trainer_flags)
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
    rows, groups = build(opts, trainer_flags)
    print(table(rows))
    invalid = [r for r in rows if not r["plan"].ok]
    if invalid:
        print(f"\nerror: {len(invalid)} invalid plan(s); see tools/plan_layout.py --recipe NAME", file=sys.stderr)
        return 1
    if opts.check_layouts and not check_layouts(rows):
        return 1
    runs_dir = site.get("MSAT_RUNS", "runs")
    manifest_dir = os.path.join(os.path.abspath(runs_dir), "_grid")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    from megatron_sat.analysis.grid import check_sweep_name, record_sweep

    try:
        sweep = check_sweep_name(opts.sweep or f"grid-{stamp}")
    except ValueError as e:
        print(f"error: --sweep: {e}", file=sys.stderr)
        return 2
    submitted = []
    print(f"\n# site settings: {site_file}; jobs run in {os.getcwd()}")
    logs = site.get("MSAT_LOGS", "logs")
    if opts.submit:
        os.makedirs(manifest_dir, exist_ok=True)
        os.makedirs(logs, exist_ok=True)
    # the jobs find launch.sh through MSAT_SLURM_DIR, this checkout's code through MSAT_REPO, and run under this
    # Python unless the site file or the environment names another (a container uses its own)
    env = dict(os.environ, MSAT_SLURM_DIR=SLURM_DIR, MSAT_SITE=site_file, MSAT_SWEEP=sweep)
    env.setdefault("MSAT_PYTHON", sys.executable)
    if CHECKOUT:
        env["MSAT_REPO"] = ROOT
    for i, (key, members) in enumerate(groups.items()):
        manifest = os.path.join(manifest_dir, f"{sweep}-{key[0]}-{stamp}-{i}.txt")
        lines = [shlex.join([r["recipe"], *r["flags"]]) for r in members]
        if opts.submit:
            with open(manifest, "w") as f:
                f.write("\n".join(lines) + "\n")
        else:
            print(f"# {manifest} would hold:\n" + "\n".join(f"#   {x}" for x in lines))
        previous = None
        for segment in range(opts.segments):
            cmd = sbatch_args(key, len(members), site, opts, manifest, dependency=previous)
            if not opts.submit:
                dep = "" if segment == 0 else "   # --dependency=afterany:<job id of the line above>"
                shown = [x if not x.startswith("--dependency") else "--dependency=afterany:$PREV" for x in cmd]
                print(shlex.join(["sbatch", *shown]) + dep)
                continue
            proc = subprocess.run(["bash", "-c", 'source "$MSAT_SITE" >/dev/null && exec sbatch --parsable "$@"',
                                   "sbatch", *cmd], env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"error: sbatch failed ({proc.returncode}): {proc.stderr.strip()}", file=sys.stderr)
                if submitted:
                    record_sweep(manifest_dir, sweep, submitted)
                return 1
            previous = proc.stdout.strip().split(";")[0]
            if segment == 0:
                submitted.append(dict(job=previous, jobs=[previous], manifest=manifest, entries=[
                    {k: r[k] for k in ("recipe", "arch", "scale", "seed")} | {"run": r["name"]} for r in members]))
            else:
                submitted[-1]["jobs"].append(previous)
            print(f"submitted array job {previous}: {len(members)} task(s) {key[0]}"
                  f"{f' segment {segment + 1}/{opts.segments}' if opts.segments > 1 else ''} -> "
                  f"logs {os.path.join(logs, f'msat-{key[0]}-{previous}_<task>.out')}")
    if submitted:
        path = record_sweep(manifest_dir, sweep, submitted)
        print(f"sweep {sweep}: {path}\n  status:  python tools/collect_grid.py {runs_dir} --sweep {sweep} --status"
              f"\n  results: python tools/collect_grid.py {runs_dir} --sweep {sweep} --out OUT")
    return 0


if __name__ == "__main__":
    sys.exit(main())
