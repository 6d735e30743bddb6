"""A sweep of training runs (archs x scales x seeds) resolved for Slurm: each entry's trainer arguments, run-folder
name and plan, the job arrays they group into, and the sbatch arguments of each array. tools/submit_grid.py is the
command line (it prints, writes the manifests and submits); slurm/launch.sh asks it for a run's name:

    python tools/submit_grid.py --dry-run --archs satformer --scales 760M --seeds 1,2
    python tools/submit_grid.py --resolve satformer_760M -- --seed 2   # RUN_NAME, TRAIN_ITERS, NEEDS_DATA

An entry's arguments are resolved as the trainer resolves them (recipe < --config FILE < flags, then
--train-samples and --lr-warmup-fraction: arguments.recipe_args). A run folder's name is
`{recipe}_lr{lr}_gbs{global batch}_seq{seq length}_it{train iters}_s{seed}` ({recipe}: an external recipe's
function, `run` without a recipe; {train iters}: the trainer's own count), plus a short hash of every other resolved
value that names a run (training/arguments.py tags each flag: names_run) and differs from the recipe's; the flags
tagged names_run=False (layout, micro-batch, paths, cadences, logging, the config file's path) are left out, so that
a run resumes under another layout, batch split, logging or checkpoint cadence, and a moved config file is the same
run while an edited one is another.
"""

import hashlib
import os
import shlex
import subprocess
from typing import Dict, List, Optional, Sequence, Tuple

import recipes  # the repository's recipes/ package (the paper grid registers itself on import)
from megatron_sat.archs import BASELINES
from megatron_sat.training.argument_checks import arch_flag_errors
from megatron_sat.training.arguments import recipe_folder_name, resolve_layers, unnamed_dests
from megatron_sat.training.planner import format_tokens, make_plan  # light: megatron-core only inside make_plan
from recipes.paper import cluster, recipe_name

NAMED = ("lr", "global_batch_size", "seq_length", "train_iters", "seed")  # spelled out in the name
CLUSTER_KEYS = ("nodes", "gpus_per_node", "gpu", "time")  # an entry's cluster shape; the command line overrides it


def resolve(recipe: Optional[str], overrides: Sequence[str] = ()):
    """(trainer args Namespace, run name) for a recipe + trainer flags (which may hold --config FILE), resolved by
    the trainer's own layers (arguments.resolve_layers): train_iters is the trainer's figure (after --train-samples).
    The name hashes resolved values, never a config file's path: a run named by an in-repository recipe hashes what
    differs from the recipe; an external recipe (module:function, path.py:function; named by its function) or none
    (a config file alone; named `run`) hashes what differs from the trainer's defaults. ValueError: see
    recipe_args."""
    resolution = resolve_layers(recipe, overrides)  # the values, and what the defaults and the recipe said
    args = resolution.args
    recipe = args.recipe  # a config file may name it
    baseline = dict(resolution.defaults)
    if recipe and ":" not in recipe:
        baseline.update(resolution.recipe)
    skip = unnamed_dests() | set(NAMED)
    # values the resolution derived rather than was given leave the name as it was: warmup steps from the fraction
    # (set to 0), and no mock vocabulary once a data source replaced the recipe's (the tokenizer gives it)
    if args.lr_warmup_fraction is not None:
        skip.add("lr_warmup_iters")
    if args.vocab_size is None:
        skip.add("vocab_size")
    rest = {k: v for k, v in sorted(vars(args).items()) if k not in skip and v != baseline.get(k)}
    prefix = recipe_folder_name(recipe) if recipe else "run"
    name = (f"{prefix}_lr{args.lr:g}_gbs{args.global_batch_size}_seq{args.seq_length}"
            f"_it{args.train_iters}_s{args.seed}")
    if rest:
        name += "_" + hashlib.sha1(repr(rest).encode()).hexdigest()[:8]
    return args, name


def needs_data(args) -> bool:
    """Whether the run reads a dataset that slurm/launch.sh has to find (no data flag, mock or embedded data)."""
    return not (args.data_path or args.train_data_path or args.data_args_path or args.mock_data or args.embedded_data)


def site_settings(site: str) -> Dict[str, str]:
    """Values of the site file (sourced by bash): MSAT_* and SBATCH_* variables."""
    script = f'set -a && source {shlex.quote(site)} >/dev/null && env -0'  # set -a: export what it sets
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    env = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    return {k: v for k, v in env.items() if k.startswith(("MSAT_", "SBATCH_"))}


def entries(archs: Sequence[str], scales: Sequence[str], seeds: Sequence[int]) -> List[dict]:
    """The grid's entries (recipe, arch, scale, seed, its default cluster), scale by scale; ValueError for an
    arch x scale without a recipe."""
    known = recipes.RECIPES
    out = []
    for scale in scales:
        for arch in archs:
            name = recipe_name(arch, scale)
            if name not in known:
                raise ValueError(f"no recipe {name!r} (arch {arch!r} at scale {scale!r}); known: {', '.join(sorted(known))}")
            for seed in seeds:
                out.append(dict(recipe=name, arch=arch, scale=scale, seed=seed, cluster=cluster(name)))
    return out


def build(archs: Sequence[str], scales: Sequence[str], seeds: Sequence[int], trainer_flags: Sequence[str] = (),
          cluster_overrides: Optional[dict] = None, mfu: Optional[float] = None) -> Tuple[List[dict], Dict[tuple, List[dict]]]:
    """(rows, groups): every entry with its flags, run name, cluster, plan and arguments, and the entries grouped
    into job arrays by cluster shape, keyed (scale, nodes, GPUs per node, GPU kind, time limit)."""
    overrides = {k: v for k, v in (cluster_overrides or {}).items() if k in CLUSTER_KEYS and v is not None}
    rows = []
    for e in entries(archs, scales, seeds):
        flags = [*trainer_flags, "--seed", str(e["seed"])]
        args, name = resolve(e["recipe"], flags)
        c = dict(e["cluster"], **overrides)
        plan = make_plan(args, recipe=e["recipe"], nodes=c["nodes"], gpus_per_node=c["gpus_per_node"], gpu=c["gpu"],
                         mfu=mfu)
        plan.errors += arch_flag_errors(args)  # e.g. full recompute with a dense arch (the planner does not build it)
        rows.append(dict(e, flags=flags, name=name, cluster=c, plan=plan, args=args))
    groups = {}
    for r in rows:
        c = r["cluster"]
        groups.setdefault((r["scale"], c["nodes"], c["gpus_per_node"], c["gpu"], c["time"]), []).append(r)
    return rows, groups


def _hours(h: Optional[float]) -> str:
    return "-" if h is None else (f"{h:,.0f}" if h >= 10 else f"{h:.1f}")


def _total(rows: List[dict]) -> str:
    """The sweep's GPU hours: predicted by the step-time model at each entry's layout (with its error band), or at
    the assumed MFU given (--mfu)."""
    if not rows:
        return "no runs"
    plans = [r["plan"] for r in rows]
    total = sum(p.gpu_hours or 0 for p in plans)
    if any(p.mfu_given for p in plans):
        return f"{len(rows)} run(s), {total:,.0f} GPU hours in all (at an assumed {100 * plans[0].mfu:.0f}% MFU)"
    lo = sum((p.gpu_hours_band or (0, 0))[0] for p in plans)
    hi = sum((p.gpu_hours_band or (0, 0))[1] for p in plans)
    return (f"{len(rows)} run(s), {total:,.0f} GPU hours in all ({lo:,.0f}-{hi:,.0f}; predicted step times, "
            "megatron_sat/steptime)")


def table(rows: List[dict]) -> str:
    """The grid as a text table (one line per entry: size, layout, memory, GPU hours, run folder) and its total."""
    head = ["recipe", "seed", "params", "tokens", "iters", "nodes x gpus", "layout", "mem GiB", "GPU h", "wall h",
            "run folder"]
    lines = []
    for r in rows:
        p = r["plan"]
        mem = f"{p.memory['total']:.0f}" if p.memory and p.capacity_gib else "-"
        status = "" if p.ok else "  INVALID: " + "; ".join(p.errors)
        lines.append([r["recipe"], str(r["seed"]), f"{p.parameters / 1e6:,.1f}M", format_tokens(p.tokens),
                      f"{p.train_iters:,}", f"{p.nodes} x {p.gpus_per_node} {p.gpu}", p.layout, mem,
                      _hours(p.gpu_hours), _hours(p.wall_hours), r["name"] + status])
    widths = [max(len(x[i]) for x in [head] + lines) for i in range(len(head))]
    fmt = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()  # noqa: E731
    out = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(x) for x in lines]
    out.append(_total(rows))
    baselines = sorted({r["arch"] for r in rows if r["arch"] in BASELINES})
    if baselines:
        out.append(f"note: mem GiB counts the extra activations of {', '.join(baselines)} as checked on CPU, "
                   "not yet measured on a GPU (see tools/plan_layout.py --recipe NAME)")
    return "\n".join(out)


def sbatch_args(key: tuple, n: int, site: Dict[str, str], slurm_dir: str, manifest: str, *,
                max_parallel: Optional[int] = None, segments: int = 1, dependency: Optional[str] = None) -> List[str]:
    """sbatch's arguments for one job array of `n` entries of the group `key` (build's groups) over `manifest`
    (slurm_dir/array.sbatch runs it); `site`: site_settings. With segments > 1 the job does not requeue itself
    (MSAT_REQUEUE=0): the next segment, --dependency=afterany on this one, takes over."""
    scale, nodes, gpn, gpu, time_limit = key
    logs = site.get("MSAT_LOGS", "logs")
    args = [f"--job-name=msat-{scale}", f"--array=0-{n - 1}" + (f"%{max_parallel}" if max_parallel else ""),
            f"--nodes={nodes}", f"--ntasks-per-node={gpn}", f"--cpus-per-task={site.get('MSAT_CPUS_PER_TASK', '8')}",
            f"--time={time_limit}", f"--output={os.path.join(logs, '%x-%A_%a.out')}"]
    if gpu != "cpu" and site.get("MSAT_GPUS", "1") != "0":
        args.append(f"--gpus-per-node={gpn}")
    if segments > 1:
        args.append("--export=ALL,MSAT_REQUEUE=0")
    if dependency:
        args.append(f"--dependency=afterany:{dependency}")
    args += shlex.split(site.get("MSAT_SBATCH_EXTRA", ""))
    return args + [os.path.join(slurm_dir, "array.sbatch"), manifest]
