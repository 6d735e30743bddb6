"""Check a cluster layout on one CPU before submitting it: every rank role built for real at full size on a fake world.

    python tools/dry_run.py --recipe satformer_1.3B --nodes 16 --tensor-model-parallel-size 4 \\
        --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 --sequence-parallel
    python tools/dry_run.py --recipe hyperconnections_760M            # the recipe's default cluster and layout
    megatron-sat-dry-run --recipe satformer_1.3B --nodes 16 --gpu H200 --micro-batch-size 8
    python tools/dry_run.py --recipe debug_satformer --config exp.yaml

The run is resolved as the trainer resolves it (recipe < --config FILE < flags, then --train-samples and
--lr-warmup-fraction): any trainer flag (python -m megatron_sat.train --help) overrides the recipe and the config
file; --nodes, --gpus-per-node and --gpu override its default cluster (recipes/paper.py CLUSTERS; without a paper
recipe 1 node x 2 CPU processes), as in tools/plan_layout.py. For each distinct rank role
(every pipeline stage with its virtual chunks, and the last TP rank) the real Megatron model chunks, DDP and optimizer
are built on torch's fake process group at the full world size, on the meta device, and one training step runs
through the real pipeline schedule and the optimizer; what was built is checked against the planner
(megatron_sat/profiling/dry_run.py; docs/dry_run.md). Prints a report per role.

Exit status: 0 clean; 1 the real code failed at this layout, or what it built differs from the plan (one line
"dry-run: FAILED: ..."), or the layout does not fit the GPU (plan-layout's INVALID: "dry-run: INVALID: ..."); 2 bad
input, including a layout the trainer refuses (its own message).
"""

import argparse
import os
import sys
import warnings

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the fake groups' teardown warns once per group otherwise
warnings.filterwarnings("ignore")  # megatron-core's import-time notes about absent Apex/TE
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat.training.arguments import Parser  # one-line refusals, as the trainer's
from megatron_sat.training.planner import ACTIVATION_TOLERANCE, DEFAULT_TOLERANCE, GPU_MEMORY_GIB, load_recipes


def main(argv=None) -> int:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", help="recipe name (recipes/, or module:function)")
    parser.add_argument("--config", metavar="FILE", help="the trainer's config file (YAML or JSON), over the recipe")
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--gpus-per-node", type=int, default=None)
    parser.add_argument("--gpu", choices=[g for g in GPU_MEMORY_GIB if g != "cpu"], default=None,
                        help="the target GPU (bf16 and the distributed optimizer unless the flags say otherwise)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"relative, on gradient buffer and optimizer bytes (default {DEFAULT_TOLERANCE})")
    parser.add_argument("--activation-tolerance", type=float, default=ACTIVATION_TOLERANCE,
                        help=f"relative, on saved activation bytes (default {ACTIVATION_TOLERANCE})")
    parser.add_argument("--all-micro-batches", action="store_true",
                        help="run every micro-batch of the step, not only the fewest that run every schedule phase")
    opts, overrides = parser.parse_known_args(argv)
    if not opts.recipe and not opts.config:
        parser.error("give --recipe NAME or --config FILE (or both)")
    if opts.config:
        overrides = ["--config", opts.config, *overrides]
    load_recipes()
    from megatron_sat.profiling.dry_run import dry_run_recipe  # megatron-core and torch: after parsing (5 s)

    try:
        report = dry_run_recipe(opts.recipe, overrides, nodes=opts.nodes, gpus_per_node=opts.gpus_per_node,
                                gpu=opts.gpu, tolerance=opts.tolerance, activation_tolerance=opts.activation_tolerance,
                                all_micro_batches=opts.all_micro_batches, log=lambda line: print(line, flush=True))
    except ValueError as e:  # an unknown recipe, an unreadable config file, no model shape
        print(f"dry-run: error: {e}", file=sys.stderr)
        return 2
    print(report.format(roles=False))
    if report.usage_error:
        print(f"dry-run: error: {report.failure}", file=sys.stderr)
        return 2
    if not report.ok:  # a failed check, or a layout that does not fit the GPU (plan-layout's INVALID): exit 1
        print(f"dry-run: {'INVALID' if report.invalid else 'FAILED'}: {report.failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
