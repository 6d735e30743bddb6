"""Print the parallel-layout plan of a recipe: validity, batch split, memory per GPU, GPU hours. No cluster needed.

    python tools/plan_layout.py --recipe satformer_760M
    python tools/plan_layout.py --recipe satformer_1.3B --nodes 1 --gpu H200 --micro-batch-size 8 \\
        --tensor-model-parallel-size 2
    python tools/plan_layout.py --recipe debug_satformer --config exp.yaml --train-iters 40
    python tools/plan_layout.py --all                  # every paper-grid recipe on its default cluster

The run is resolved as the trainer resolves it (recipe < --config FILE < flags, then --train-samples and
--lr-warmup-fraction): any trainer flag (python -m megatron_sat.train --help) overrides the recipe and the config
file; --nodes, --gpus-per-node and --gpu override its default cluster (recipes/paper.py CLUSTERS; a config file
without a paper recipe: 1 node x 2 CPU processes). Exit status 1 when a plan is invalid (a divisibility
error, an inconsistent batch, or more memory than the GPU has).

The memory model (megatron_sat/training/planner.py) counts the Llama block, V1, the logits and the baselines'
extra activations ("connections": Hyper-Connections' n residual streams, DenseFormer's kept layer outputs,
MUDDFormer's streams, weighted sums and dynamic weights, their pipeline messages and history gradients).
The baselines' formulas match the bytes autograd saves on CPU (tests/test_recipes.py); on a GPU they assume
Transformer Engine keeps the same tensors, which is not measured yet, and the plan says so under the memory line
(BASELINE_MEMORY_NOTES): check a tight layout with tools/profile_throughput.py on a GPU.
"""

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")  # megatron-core's import-time notes about absent Apex/TE
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat import archs
from megatron_sat.training.argument_checks import arch_flag_errors
from megatron_sat.training.planner import DEFAULT_MFU, GPU_MEMORY_GIB, plan_recipe, resolve_args
from recipes.paper import GRID  # importing the recipes package registers every recipe

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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", help="recipe name (recipes/, or module:function)")
    parser.add_argument("--config", metavar="FILE", help="the trainer's config file (YAML or JSON), over the recipe")
    parser.add_argument("--all", action="store_true", help="plan every paper-grid recipe")
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--gpus-per-node", type=int, default=None)
    parser.add_argument("--gpu", choices=list(GPU_MEMORY_GIB), default=None)
    parser.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="assumed MFU for the GPU-hour estimate")
    args, overrides = parser.parse_known_args(argv)
    if not args.all and not args.recipe and not args.config:
        parser.error("give --recipe NAME, --config FILE or --all")
    if args.config:
        overrides = ["--config", args.config, *overrides]
    names = GRID if args.all else [args.recipe]
    bad = 0
    for name in names:
        try:
            plan = plan_recipe(name, overrides, nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu=args.gpu,
                               mfu=args.mfu)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        plan.errors += arch_flag_errors(resolve_args(name, overrides))  # e.g. full recompute with a dense arch
        print(plan.format())
        if plan.memory and memory_note(plan.arch):
            print(memory_note(plan.arch))
        bad += not plan.ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
