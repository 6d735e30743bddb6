"""What tools/submit_grid.py does with a planned sweep (plan.build): dry-run each distinct entry's layout, write one
manifest per job array, submit the arrays with sbatch (chained segments with --segments) and record them in
<runs>/_grid/<sweep>.json (records.record_sweep), or print all of it without submitting."""

import os
import shlex
import subprocess
from typing import Callable, Dict, List, Optional

from megatron_sat.sweep.plan import resolve, sbatch_args
from megatron_sat.sweep.records import record_sweep


def check_layouts(rows: List[dict], say: Callable[[str], None] = print) -> bool:
    """Dry-run every distinct entry of `rows` (the seed does not change the layout); one line each."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # here, not at the top: it loads torch and megatron-core (seconds), which --resolve and --dry-run never need,
    # and after TORCH_CPP_LOG_LEVEL is set
    from megatron_sat.profiling.dry_run import dry_run

    seen, ok = set(), True
    for r in rows:
        c = r["cluster"]
        flags = [f for i, f in enumerate(r["flags"]) if f != "--seed" and (i == 0 or r["flags"][i - 1] != "--seed")]
        key = (r["recipe"], tuple(flags), c["nodes"], c["gpus_per_node"], c["gpu"])
        if key in seen:
            continue
        seen.add(key)
        args, _ = resolve(r["recipe"], r["flags"])
        report = dry_run(args, recipe=r["recipe"], nodes=c["nodes"], gpus_per_node=c["gpus_per_node"], gpu=c["gpu"])
        status = (f"OK ({len(report.roles)} rank role(s), {report.seconds:.0f} s)" if report.ok
                  else f"FAILED: {report.failure}")
        say(f"dry-run {r['recipe']} {report.layout} on {c['nodes']} x {c['gpus_per_node']} {c['gpu']}: {status}")
        ok &= report.ok
    return ok


def submit(groups: Dict[tuple, List[dict]], *, site: Dict[str, str], env: Dict[str, str], slurm_dir: str,
           manifest_dir: str, sweep: str, stamp: str, really: bool, segments: int = 1,
           max_parallel: Optional[int] = None, say: Callable[[str], None] = print) -> Optional[str]:
    """Each group (plan.build's job arrays) as a manifest and its sbatch call(s): submitted (really=True) with the
    sweep recorded, else printed. Returns the record's path (None when nothing was submitted); RuntimeError when
    sbatch fails (the arrays submitted before it are recorded first)."""
    submitted = []
    logs = site.get("MSAT_LOGS", "logs")
    if really:
        os.makedirs(manifest_dir, exist_ok=True)
        os.makedirs(logs, exist_ok=True)
    for i, (key, members) in enumerate(groups.items()):
        manifest = os.path.join(manifest_dir, f"{sweep}-{key[0]}-{stamp}-{i}.txt")
        lines = [shlex.join([r["recipe"], *r["flags"]]) for r in members]
        if really:
            with open(manifest, "w") as f:
                f.write("\n".join(lines) + "\n")
        else:
            say(f"# {manifest} would hold:\n" + "\n".join(f"#   {x}" for x in lines))
        previous = None
        for segment in range(segments):
            cmd = sbatch_args(key, len(members), site, slurm_dir, manifest, max_parallel=max_parallel,
                              segments=segments, dependency=previous)
            if not really:
                dep = "" if segment == 0 else "   # --dependency=afterany:<job id of the line above>"
                shown = [x if not x.startswith("--dependency") else "--dependency=afterany:$PREV" for x in cmd]
                say(shlex.join(["sbatch", *shown]) + dep)
                continue
            proc = subprocess.run(["bash", "-c", 'source "$MSAT_SITE" >/dev/null && exec sbatch --parsable "$@"',
                                   "sbatch", *cmd], env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                if submitted:
                    record_sweep(manifest_dir, sweep, submitted)
                raise RuntimeError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}")
            previous = proc.stdout.strip().split(";")[0]
            if segment == 0:
                submitted.append(dict(job=previous, jobs=[previous], manifest=manifest, entries=[
                    {k: r[k] for k in ("recipe", "arch", "scale", "seed")} | {"run": r["name"]} for r in members]))
            else:
                submitted[-1]["jobs"].append(previous)
            say(f"submitted array job {previous}: {len(members)} task(s) {key[0]}"
                f"{f' segment {segment + 1}/{segments}' if segments > 1 else ''} -> "
                f"logs {os.path.join(logs, f'msat-{key[0]}-{previous}_<task>.out')}")
    return record_sweep(manifest_dir, sweep, submitted) if submitted else None
