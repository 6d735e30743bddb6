"""Print the parallel-layout plan of a recipe: validity, batch split, memory per GPU, GPU hours. No cluster needed.

    python tools/plan_layout.py --recipe satformer_760M
    python tools/plan_layout.py --recipe satformer_1.3B --nodes 1 --gpu H200 --micro-batch-size 8 \\
        --tensor-model-parallel-size 2
    python tools/plan_layout.py --all                  # every paper-grid recipe on its default cluster

Any trainer flag (python -m megatron_sat.train --help) overrides the recipe; --nodes, --gpus-per-node and --gpu
override its default cluster (recipes/paper.py CLUSTERS). Exit status 1 when a plan is invalid (a divisibility
error, an inconsistent batch, or more memory than the GPU has).
"""

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")  # megatron-core's import-time notes about absent Apex/TE
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat.parallel.planner import DEFAULT_MFU, GPU_MEMORY_GIB, load_recipes, plan_recipe  # noqa: E402


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
        print(plan.format())
        bad += not plan.ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
