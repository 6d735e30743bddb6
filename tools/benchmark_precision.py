"""BF16 against fp32 on the demo recipe: validation curves of the same seeds and data, and the bound they meet.

    python tools/benchmark_precision.py                                   # 3 seeds x {fp32, bf16}, the demo recipe
    python tools/benchmark_precision.py --seeds 1 --train-iters 20 --out /tmp/smoke   # a smoke run
    nice -n 10 python tools/benchmark_precision.py --figure docs/benchmark_precision.png

Trains `--recipe demo` (a small SATFormer on the embedded corpus, one process) once per seed and precision
(--no-bf16 / --bf16, everything else the recipe's: the same data order and initial weights per seed), each in
OUT/<precision>_s<seed> (a rerun resumes or finds the run done). Reads the validation loss of every evaluation
and the final one from the runs' metrics.jsonl and logs, and prints:

  * the seed-to-seed spread of each precision: max over evaluations of (max - min over seeds);
  * the bf16 - fp32 difference of the seed means at each evaluation, and the largest |difference| of a seed's
    bf16 run against its own fp32 run;
  * the bound: the fp32 seed-to-seed spread at that evaluation; PASS when every |bf16 mean - fp32 mean| is below it.

With --figure, a PNG of both precisions' curves (each seed thin, the mean thick); with --json, the numbers.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat.training.records import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRECISIONS = {"fp32": "--no-bf16", "bf16": "--bf16"}


def train(out: str, precision: str, seed: int, extra: list) -> str:
    """One demo run (resumed if its folder holds one); returns its log."""
    run = os.path.join(out, f"{precision}_s{seed}")
    log_path = run + ".log"
    cmd = [sys.executable, "-m", "megatron_sat.train", "--recipe", "demo", PRECISIONS[precision], "--seed", str(seed),
           "--save", run, "--load", run, "--embedded-data", os.path.join(out, "data"), "--no-progress-bar", *extra]
    t0 = time.time()
    with open(log_path, "a") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"benchmark_precision: {' '.join(cmd)} exited {proc.returncode}; see {log_path}")
    print(f"{precision} seed {seed}: {time.time() - t0:.0f} s", flush=True)
    return open(log_path).read()


def curve(out: str, precision: str, seed: int, log: str) -> dict:
    """{step: validation loss} of a run, the final one under 'final'."""
    points = {}
    for row in read_metrics(os.path.join(out, f"{precision}_s{seed}")):
        if "val_loss" in row:
            points[row["step"]] = row["val_loss"]
    finals = re.findall(r"final validation loss (\d+\.\d+)", log)
    if finals:
        points["final"] = float(finals[-1])
    return points


def summary(curves: dict) -> dict:
    """The spreads, differences and the verdict (see the module docstring)."""
    keys = [k for k in curves["fp32"][0] if all(k in c for p in curves.values() for c in p)]
    spread = {p: {str(k): max(c[k] for c in cs) - min(c[k] for c in cs) for k in keys} for p, cs in curves.items()}
    mean = {p: {str(k): sum(c[k] for c in cs) / len(cs) for k in keys} for p, cs in curves.items()}
    diff = {str(k): mean["bf16"][str(k)] - mean["fp32"][str(k)] for k in keys}
    paired = max(abs(b[k] - f[k]) for b, f in zip(curves["bf16"], curves["fp32"]) for k in keys)
    bound = spread["fp32"]
    ok = all(abs(diff[k]) < bound[k] for k in diff)
    return dict(points=[str(k) for k in keys], spread=spread, mean=mean, diff=diff, paired_max=paired,
                bound=bound, passed=ok)


def figure(curves: dict, path: str) -> None:
    import matplotlib  # the figure only: an optional dependency, loaded when asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for precision, color in (("fp32", "tab:blue"), ("bf16", "tab:orange")):
        runs = [{k: v for k, v in c.items() if k != "final"} for c in curves[precision]]
        steps = sorted(runs[0])
        for c in runs:
            ax.plot(steps, [c[s] for s in steps], color=color, alpha=0.35, linewidth=1)
        ax.plot(steps, [sum(c[s] for c in runs) / len(runs) for s in steps], color=color, linewidth=2.2,
                marker="o", label=f"{precision} (mean of {len(runs)} seeds)")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title("demo recipe (SATFormer, embedded corpus): bf16 vs fp32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "benchmark_precision"), help="the runs' folder")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--train-iters", type=int, default=None, help="shorter than the recipe's 400 (smoke runs)")
    p.add_argument("--figure", default=None, help="write the curves to this PNG")
    p.add_argument("--json", default=None, help="write the numbers to this file")
    args = p.parse_args(argv)
    if len(args.seeds) < 2:
        print("benchmark_precision: one seed gives no seed-to-seed spread; the bound is 0 (use 2 or more)")
    extra = []
    if args.train_iters:
        extra = ["--train-iters", str(args.train_iters), "--eval-interval", str(max(args.train_iters // 4, 1)),
                 "--lr-warmup-iters", str(max(args.train_iters // 10, 1))]
    os.makedirs(args.out, exist_ok=True)
    curves = {precision: [] for precision in PRECISIONS}
    for seed in args.seeds:  # interleaved, so that a machine's load changes hit both precisions alike
        for precision in PRECISIONS:
            curves[precision].append(curve(args.out, precision, seed, train(args.out, precision, seed, extra)))
    result = summary(curves)
    print(f"{'evaluation':>10} | {'fp32 mean':>9} | {'bf16 mean':>9} | {'bf16-fp32':>9} | {'fp32 spread':>11} | "
          f"{'bf16 spread':>11}")
    for k in result["points"]:
        print(f"{k:>10} | {result['mean']['fp32'][k]:9.4f} | {result['mean']['bf16'][k]:9.4f} | "
              f"{result['diff'][k]:+9.4f} | {result['spread']['fp32'][k]:11.4f} | {result['spread']['bf16'][k]:11.4f}")
    print(f"largest |bf16 - fp32| of one seed at one evaluation: {result['paired_max']:.4f}")
    print(f"bf16 mean within the fp32 seed-to-seed spread at every evaluation: {'PASS' if result['passed'] else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(result, curves=curves, seeds=args.seeds, train_iters=args.train_iters), f, indent=1)
    if args.figure:
        figure(curves, args.figure)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
