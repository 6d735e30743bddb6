"""Parameter counts of every arch (megatron_sat.archs.ARCHS) at the paper's four scales.

    python tools/param_counts.py            # the table
    python tools/param_counts.py --json     # machine-readable

Counts are exact (the formula in megatron_sat/model/sizes.py is tested against built models).
"""

import argparse
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore", module="megatron")  # import-time notes about absent Apex/TE
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat.archs import ARCHS, REFERENCE
from megatron_sat.model.config import make_config
from megatron_sat.model.sizes import PAPER_SCALES, PAPER_VOCAB, count_parameters


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=PAPER_VOCAB)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for scale, sizes in PAPER_SCALES.items():
        for arch in ARCHS:
            parts = count_parameters(make_config(arch, **sizes), args.vocab_size)
            rows.append(dict(scale=scale, arch=arch, **parts))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    width = max(len(a) for a in ARCHS)
    print(f"{'scale':>6} {'arch':<{width}} {'total':>15} {'non-embedding':>15} {'value residual':>15} "
          f"{'connections':>12} {'vs transformer':>15}")
    base = {r["scale"]: r["total"] for r in rows if r["arch"] == REFERENCE}
    for r in rows:  # connections: DenseFormer / MUDDFormer / Hyper-Connections weights (0 for the others)
        print(f"{r['scale']:>6} {r['arch']:<{width}} {r['total']:>15,} {r['total'] - r['embedding']:>15,} "
              f"{r['value_residual']:>15,} {r.get('connections', 0):>12,} {r['total'] - base[r['scale']]:>+15,}")


if __name__ == "__main__":
    main()
