"""Print the parallel-layout plan of a recipe: validity, batch split, memory per GPU, GPU hours. No cluster needed.

    python tools/plan_layout.py --recipe satformer_760M
    python tools/plan_layout.py --recipe satformer_1.3B --nodes 1 --gpu H200 --micro-batch-size 8 \\
        --tensor-model-parallel-size 2
    python tools/plan_layout.py --all                  # every paper-grid recipe on its default cluster

Any trainer flag (python -m megatron_sat.train --help) overrides the recipe; --nodes, --gpus-per-node and --gpu
override its default cluster (recipes/paper.py CLUSTERS). Exit status 1 when a plan is invalid (a divisibility
error, an inconsistent batch, or more memory than the GPU has).

The memory model (megatron_sat/parallel/planner.py) counts the Llama block, V1 and the logits. For the baselines
it leaves out their extra activations, and says so under the plan (BASELINE_MEMORY_NOTES): Hyper-Connections
keeps n residual streams (n x the residual-stream activations), DenseFormer and MUDDFormer keep every earlier
layer's output (MUDDFormer also its 4 streams and their per-layer norms). Their real memory is higher than
printed: measure it with tools/profile_throughput.py on a GPU before trusting a tight layout.
"""

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")  # megatron-core's import-time notes about absent Apex/TE
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat.parallel.planner import (  # noqa: E402
    DEFAULT_MFU, GPU_MEMORY_GIB, load_recipes, plan_recipe, resolve_args)
from megatron_sat.training.arguments import arch_errors  # noqa: E402

# what the memory estimate leaves out, per arch (printed under the plan, so that a number is never silently low)
BASELINE_MEMORY_NOTES = {
    "denseformer": "every earlier layer's output X_0..X_i is kept for the depth-weighted averages",
    "muddformer": "every earlier layer's output, its pre-normed copies and the 4 streams (Q, K, V, R) are kept "
                  "for the depth aggregates",
    "hyperconnections": "n residual streams are kept ([s, b, n x h] per sublayer, n = --hc-expansion-rate): "
                        "about n x the residual-stream activations",
}


def memory_note(arch: str):
    """The line printed under a plan whose memory estimate misses the arch's extra activations (None if none)."""
    if arch not in BASELINE_MEMORY_NOTES:
        return None
    return (f"  note      memory excludes {arch}'s extra activations: {BASELINE_MEMORY_NOTES[arch]}; the real "
            "figure is higher (measure it with tools/profile_throughput.py)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", help="recipe name (recipes/)")
    parser.add_argument("--all", action="store_true", help="plan every paper-grid recipe")
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--gpus-per-node", type=int, default=None)
    parser.add_argument("--gpu", choices=list(GPU_MEMORY_GIB), default=None)
    parser.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="assumed MFU for the GPU-hour estimate")
    args, overrides = parser.parse_known_args(argv)
    if not args.all and not args.recipe:
        parser.error("give --recipe NAME or --all")
    load_recipes()
    from recipes.paper import GRID

    names = GRID if args.all else [args.recipe]
    bad = 0
    for name in names:
        try:
            plan = plan_recipe(name, overrides, nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu=args.gpu,
                               mfu=args.mfu)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        plan.errors += arch_errors(resolve_args(name, overrides))  # e.g. full recompute with a dense arch
        print(plan.format())
        if plan.memory and memory_note(plan.arch):
            print(memory_note(plan.arch))
        bad += not plan.ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
