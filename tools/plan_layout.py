"""Print the parallel-layout plan of a recipe: validity, batch split, memory per GPU, GPU hours. No cluster needed.

    python tools/plan_layout.py --recipe satformer_760M
    python tools/plan_layout.py --recipe satformer_1.3B --nodes 1 --gpu H200 --micro-batch-size 8 \\
        --tensor-model-parallel-size 2
    python tools/plan_layout.py --recipe debug_satformer --config exp.yaml --train-iters 40
    python tools/plan_layout.py --all                  # every paper-grid recipe on its default cluster
    python tools/plan_layout.py --all --cluster 4x8xH100          # the grid's GPU hours per arch on one cluster
    python tools/plan_layout.py --recipe satformer_1.3B --search --cluster 4x8xH100          # the best layouts
    python tools/plan_layout.py --search --cluster 2x8xH100 --arch transformer --num-layers 24 --hidden-size 2048 \
        --num-attention-heads 16 --seq-length 4096 --vocab-size 131072 --global-batch-size 256 --json

The run is resolved as the trainer resolves it (recipe < --config FILE < flags, then --train-samples and
--lr-warmup-fraction): any trainer flag (python -m megatron_sat.train --help) overrides the recipe and the config
file; --nodes, --gpus-per-node and --gpu override its default cluster (recipes/paper.py CLUSTERS; a config file
without a paper recipe: 1 node x 2 CPU processes); --cluster NODESxPERxGPU (e.g. 4x8xH100) sets all three.
Exit status 1 when a plan is invalid (a divisibility error, an inconsistent batch, or more memory than the GPU
has); 2 for bad input (one line).

GPU hours: the step-time model's predicted step at the plan's layout (megatron_sat/steptime) x steps x
GPUs, with the band of its error against published throughput; --mfu F replaces the prediction by an assumed MFU
(FLOPs / (peak x F)), an explicit override for a GPU or a code path the model does not describe.

--search: every layout (TP, PP, VPP, CP, DP, micro-batch, sequence parallel, recompute, distributed optimizer) the
layout checks accept and the memory plan fits, ranked by predicted step time (megatron_sat/training/
layout_search.py); the best --top are printed with step time, TFLOP/s and MFU per GPU, tokens/s, memory, bubble
and exposed-communication shares, and why the best one wins. Every layout or precision flag given (on the command
line or in --config) is held fixed; the recipe's own layout is only its default. --json: the ranked layouts as
JSON, best first. Without --recipe or --config the model comes from the trainer's (Megatron-LM's) flags with
--arch: --num-layers --hidden-size --num-attention-heads [--ffn-hidden-size --num-query-groups] --seq-length
--vocab-size --global-batch-size (--train-iters only matters for GPU hours).

The memory model (megatron_sat/training/planner.py) counts the Llama block, V1, the logits and the baselines'
extra activations ("connections": Hyper-Connections' n residual streams, DenseFormer's kept layer outputs,
MUDDFormer's streams, weighted sums and dynamic weights, their pipeline messages and history gradients).
The baselines' formulas match the bytes autograd saves on CPU (tests/test_recipes.py); on a GPU they assume
Transformer Engine keeps the same tensors, which is not measured yet, and the plan says so under the memory line
(BASELINE_MEMORY_NOTES): check a tight layout with tools/profile_throughput.py on a GPU.
"""

import argparse
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")  # megatron-core's import-time notes about absent Apex/TE
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat import archs, steptime
from megatron_sat.training.arguments import Parser, build_parser  # Parser: one-line refusals, as the trainer's
from megatron_sat.training.config_file import explicit_dests
from megatron_sat.training.planner import GPU_MEMORY_GIB, plan_recipe, resolve_args
from recipes.paper import ARCHS, GRID  # importing the recipes package registers every recipe

# what the memory estimate counts for each baseline, and how far it is checked (printed under the plan)
BASELINE_MEMORY_NOTES = {a: archs.get(a).memory_note for a in archs.ARCHS if archs.get(a).memory_note}


def memory_note(arch: str):
    """The line printed under a baseline's plan: what its memory counts and what is not yet measured (None if
    the arch is not a baseline)."""
    if arch not in BASELINE_MEMORY_NOTES:
        return None
    return (f"  note      memory counts {arch}'s extra activations as connections ({BASELINE_MEMORY_NOTES[arch]}); "
            "checked against saved bytes on CPU, not yet on a GPU with Transformer Engine: measure a tight layout "
            "with tools/profile_throughput.py")


def main(argv=None) -> int:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", help="recipe name (recipes/, or module:function)")
    parser.add_argument("--config", metavar="FILE", help="the trainer's config file (YAML or JSON), over the recipe")
    parser.add_argument("--all", action="store_true", help="plan every paper-grid recipe (with --cluster: the GPU "
                        "hours per arch on that cluster)")
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--gpus-per-node", type=int, default=None)
    parser.add_argument("--gpu", choices=list(GPU_MEMORY_GIB) + [g for g in steptime.gpu_names() if g not in GPU_MEMORY_GIB],
                        default=None)
    parser.add_argument("--cluster", metavar="NODESxPERxGPU",
                        help=f"e.g. 4x8xH100 (GPUs: {', '.join(steptime.gpu_names())}); sets nodes, GPUs per node, GPU")
    parser.add_argument("--mfu", type=float, default=None,
                        help="an assumed MFU for the GPU hours, overriding the step-time model's prediction")
    parser.add_argument("--search", action="store_true", help="rank every layout that fits by predicted step time")
    parser.add_argument("--top", type=int, default=5, help="with --search: how many layouts to print (default 5)")
    parser.add_argument("--json", action="store_true", help="with --search: the ranked layouts as JSON, best first")
    args, overrides = parser.parse_known_args(argv)
    try:
        where = _cluster(args)
    except ValueError as e:
        return _bad(str(e))
    if args.config:
        overrides = ["--config", args.config, *overrides]
    if args.mfu is not None and not 0 < args.mfu <= 1:
        return _bad(f"--mfu {args.mfu} is not a fraction in (0, 1]")
    if args.search:
        return _search(args, overrides, where)
    if not args.all and not args.recipe and not args.config:
        return _bad("give --recipe NAME, --config FILE or --all (or --search with a model)")
    names = GRID if args.all else [args.recipe]
    bad = 0
    hours = {}
    for name in names:
        try:
            plan = plan_recipe(name, overrides, mfu=args.mfu, **where)
        except ValueError as e:
            return _bad(str(e))
        print(plan.format())
        if plan.memory and memory_note(plan.arch):
            print(memory_note(plan.arch))
        bad += not plan.ok
        if plan.gpu_hours is not None:
            h = hours.setdefault(plan.arch, [0.0, 0.0, 0.0])
            lo, hi = plan.gpu_hours_band or (plan.gpu_hours, plan.gpu_hours)
            h[0], h[1], h[2] = h[0] + plan.gpu_hours, h[1] + lo, h[2] + hi
    if args.all and hours:
        print(grid_hours(hours, args.mfu))
    return 1 if bad else 0


def grid_hours(hours: dict, mfu) -> str:
    """The paper grid's GPU hours per arch (and in all) with the model's band."""
    how = f"at an assumed {100 * mfu:.0f}% MFU" if mfu else "predicted by the step-time model, with its error band"
    lines = [f"paper grid GPU hours per arch ({how}):"]
    for arch in [a for a in ARCHS if a in hours]:
        h, lo, hi = hours[arch]
        lines.append(f"  {arch:<17} {h:>10,.0f}  ({lo:,.0f}-{hi:,.0f})")
    total = [sum(v[i] for v in hours.values()) for i in range(3)]
    lines.append(f"  {'all':<17} {total[0]:>10,.0f}  ({total[1]:,.0f}-{total[2]:,.0f})")
    return "\n".join(lines)


def _bad(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _cluster(args) -> dict:
    """nodes / gpus_per_node / gpu for plan_recipe from --cluster and the single flags (ValueError)."""
    where = dict(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu=args.gpu)
    if args.cluster:
        c = steptime.cluster(args.cluster)
        where = dict(nodes=args.nodes or c.nodes, gpus_per_node=args.gpus_per_node or c.gpus_per_node,
                     gpu=args.gpu or c.gpu.name)
    if where["gpu"] and where["gpu"] != "cpu" and where["gpu"] not in steptime.gpu_names():
        raise ValueError(f"GPU {where['gpu']!r} has no description for the step-time model; known: "
                         f"{', '.join(steptime.gpu_names())}")
    for k in ("nodes", "gpus_per_node"):
        if where[k] is not None and where[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1 (got {where[k]})")
    return where


def _search(args, overrides, where) -> int:
    """--search: the ranked layouts (text or JSON)."""
    from megatron_sat.training import layout_search  # torch and megatron-core when the search runs
    from megatron_sat.training.planner import default_cluster

    if args.all:
        return _bad("--search plans one model: give --recipe, --config or the model's flags, not --all")
    if not args.recipe and not args.config:
        given = explicit_dests(build_parser(), overrides)
        if "train_iters" not in given and "train_samples" not in given:
            overrides = [*overrides, "--train-iters", "1"]  # the length only sizes GPU hours, which --search omits
    try:
        run = resolve_args(args.recipe, overrides)
        default = default_cluster(run.recipe)
        nodes = where["nodes"] or default["nodes"]
        per = where["gpus_per_node"] or default["gpus_per_node"]
        gpu = where["gpu"] or default["gpu"]
        if gpu == "cpu":
            raise ValueError("--search needs a GPU cluster: give --cluster NODESxPERxGPU (e.g. 4x8xH100)")
        result = layout_search.search(run, steptime.cluster(gpu, nodes=nodes, gpus_per_node=per), overrides)
    except ValueError as e:
        return _bad(str(e).splitlines()[0])
    if args.json:
        print(json.dumps(dict(cluster=str(result.cluster), precision=result.precision, fixed=result.fixed,
                              considered=result.considered, refused_memory=result.refused_memory,
                              layouts=[r.as_dict() for r in result.ranked]), indent=1))
        return 0 if result.ranked else 1
    print(layout_search.format_result(result, top=args.top))
    return 0 if result.ranked else 1


if __name__ == "__main__":
    sys.exit(main())
