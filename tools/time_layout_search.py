"""How long the layout search takes over the whole paper grid (docs/step_time.md, docs/benchmarks.md).

    python tools/time_layout_search.py             # every recipes.paper.GRID recipe on its default cluster
    python tools/time_layout_search.py --json out.json   # also every recipe's ranked layouts (to compare runs)

Times only the loop of layout_search.search (CPU seconds of this process and wall seconds); the imports and each
recipe's argument resolution come before the clock starts. Prints one line per recipe: layouts considered,
refused by memory, dominated, predicted, and layer cost evaluations.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat import steptime  # noqa: E402
from megatron_sat.training import layout_search  # noqa: E402
from megatron_sat.training.planner import default_cluster, resolve_args  # noqa: E402
from recipes.paper import GRID  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="write every recipe's ranked layouts (as_dict) to FILE")
    args = parser.parse_args()
    runs = {name: resolve_args(name, []) for name in GRID}
    from megatron_sat.training import setup  # noqa: F401  (torch and megatron-core: imported before the clock)

    out, lines = {}, []
    cpu, wall = time.process_time(), time.perf_counter()
    for name in GRID:
        d = default_cluster(name)
        cl = steptime.cluster(d["gpu"], nodes=d["nodes"], gpus_per_node=d["gpus_per_node"])
        r = layout_search.search(runs[name], cl)
        lines.append(f"{name:<22} {str(cl):<10} {r.considered:>6} considered {r.refused_memory:>5} refused "
                     f"{r.dominated:>5} dominated {len(r.ranked):>5} predicted {r.layer_costs:>6} layer costs")
        out[name] = [x.as_dict() for x in r.ranked]
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print("\n".join(lines))
    print(f"{len(GRID)} recipes: {cpu:.1f} CPU s, {wall:.1f} wall s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=0, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
