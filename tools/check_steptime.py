"""The step-time model against published Megatron throughput (docs/step_time.md's comparison table).

    python tools/check_steptime.py              # published, predicted, error per row; mean and worst by role
    python tools/check_steptime.py --markdown   # the table as docs/step_time.md shows it
    python tools/check_steptime.py --fit        # refit the H100 constants on the 'fit' rows and show what they give
    python tools/check_steptime.py --json
    python tools/check_steptime.py --update-docs  # rewrite docs/step_time.md's table (tests check they agree)

Sources, the assumptions each row shares and which rows fit: megatron_sat/steptime/published.py.
Goal (issue 44): mean absolute error <= 10%, worst <= 20%. Exit 0 when the goal holds over all rows, 1 when not.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat.steptime import load_gpu
from megatron_sat.steptime.published import (
    ASSUMPTION_TEXT,
    ROWS,
    compare,
    fit,
    format_table,
    replace_block,
    summary,
)

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "step_time.md")
GOAL_MEAN, GOAL_WORST = 0.10, 0.20
FIT_KEYS = ("gemm_efficiency", "attention_efficiency")
FIT_GRIDS = {"gemm_efficiency": [0.5, 0.55, 0.6, 0.65, 0.7], "attention_efficiency": [0.1, 0.15, 0.2, 0.25, 0.3, 0.4]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true", help="the Markdown table of docs/step_time.md")
    parser.add_argument("--json", action="store_true", help="every row as JSON")
    parser.add_argument("--update-docs", action="store_true", help="rewrite the table in docs/step_time.md")
    parser.add_argument("--fit", action="store_true",
                        help=f"refit {', '.join(FIT_KEYS)} on the H100 'fit' rows (a grid search, about a minute)")
    args = parser.parse_args()
    gpus = None
    if args.fit:
        best = fit(FIT_KEYS, FIT_GRIDS, [r for r in ROWS if r.role == "fit"])
        print("fitted on the 'fit' rows: " + ", ".join(f"{k} = {v:.3f}" for k, v in best.items())
              + "  (gpus.json holds them rounded to two digits)")
        gpus = {name: load_gpu(name).with_calibration(**best) for name in ("H100", "A100")}
    results = compare(gpus=gpus)
    if args.update_docs:
        replace_block(DOCS, "published-table", format_table(results))
        print(f"updated {DOCS}")
    if args.json:
        print(json.dumps(results, indent=1))
    elif args.markdown:
        print(format_table(results))
    else:
        for source, text in ASSUMPTION_TEXT.items():
            print(f"{source}: assumed {text}")
        print()
        print(f"{'source':<12} {'model':<11} {'TP':>3} {'PP':>3} {'DP':>3} {'GPUs':>5} {'role':<6} "
              f"{'published':>9} {'predicted':>9} {'error':>7}")
        for r in results:
            print(f"{r['source']:<12} {r['name']:<11} {r['tp']:>3} {r['pp']:>3} {r['dp']:>3} {r['gpus']:>5} "
                  f"{r['role']:<6} {r['published']:>9.1f} {r['predicted']:>9.1f} {100 * r['error']:>+6.1f}%")
        for role in ("fit", "check"):
            s = summary([r for r in results if r["role"] == role])
            print(f"{role} rows ({s['n']}): mean |error| {100 * s['mean']:.1f}%, worst {100 * s['worst']:.1f}%")
    s = summary(results)
    ok = s["mean"] <= GOAL_MEAN and s["worst"] <= GOAL_WORST
    print(f"all rows: mean |error| {100 * s['mean']:.1f}%, worst {100 * s['worst']:.1f}% "
          f"(goal <= {100 * GOAL_MEAN:.0f}% / <= {100 * GOAL_WORST:.0f}%): {'met' if ok else 'MISSED'}",
          file=sys.stderr if args.json else sys.stdout)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
