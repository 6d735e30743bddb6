"""A sweep's record, <runs>/_grid/<sweep>.json (tools/submit_grid.py --submit writes it): the job arrays it submitted
and their entries, the entries that have no run folder yet, and waiting until none of its jobs is queued.
tools/collect_grid.py reads it back (megatron_sat/analysis/grid.py read_runs)."""

import glob
import json
import os
import re
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional

from megatron_sat.sweep.slurm import ACTIVE_SLURM, squeue_states
from megatron_sat.training.records import read_json_file, write_durably

SWEEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_sweep_name(name: str) -> str:
    if not SWEEP_NAME.fullmatch(name or ""):
        raise ValueError(f"sweep name {name!r}: use letters, digits, '.', '_' or '-' (at most 64, e.g. ladder-2026)")
    return name


def record_sweep(folder: str, sweep: str, arrays: List[dict]) -> str:
    """Add submitted job arrays to <folder>/<sweep>.json (tools/submit_grid.py --submit; a sweep submitted in
    several calls grows): {"sweep", "arrays": [{"job", "manifest", "entries": [{recipe, arch, scale, seed,
    run}]}]}. Returns its path."""
    path = os.path.join(folder, f"{check_sweep_name(sweep)}.json")
    say = lambda text: print(text, file=sys.stderr)  # noqa: E731
    record = read_json_file(path, say, what="its earlier job arrays are listed there, not in the new record") \
        or dict(sweep=sweep, arrays=[])
    record.setdefault("arrays", [])
    record["arrays"] += arrays
    record["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_durably(path, json.dumps(record, indent=1))
    return path


def sweep_records(folders: Iterable[str]) -> List[dict]:
    """The sweeps tools/submit_grid.py recorded in <runs>/_grid/<sweep>.json below the folders."""
    out = []
    for top in folders:
        for path in sorted(glob.glob(os.path.join(top, "**", "_grid", "*.json"), recursive=True)):
            try:
                with open(path) as f:
                    record = json.load(f)
            except (OSError, ValueError) as e:  # cut short by a crash: its queued entries are not listed, the runs
                print(f"warning: {path}: unreadable ({e}); its pending entries are left out (tools/submit_grid.py "
                      "sets it aside at the next submission)", file=sys.stderr)  # still are
                continue
            if isinstance(record, dict) and "sweep" in record and "arrays" in record:
                out.append(record)
    return out


def pending_entries(sweeps: List[dict], rows: List[dict], slurm: Optional[Dict[str, str]]) -> List[dict]:
    """Grid entries of the sweeps whose run folder does not exist yet (queued, or never started)."""
    have = {r["run"] for r in rows}
    out = []
    for sweep in sweeps:
        for array in sweep["arrays"]:
            for task, entry in enumerate(array["entries"]):
                if entry["run"] in have:
                    continue
                jobs = [f"{j}_{task}" for j in array.get("jobs") or [array.get("job")] if j]
                states = [(j, (slurm or {}).get(j)) for j in jobs]
                job, state = next(((j, st) for j, st in states if st in ACTIVE_SLURM), states[0] if states else (None, None))
                status = "pending" if state in ACTIVE_SLURM else "not started"
                out.append(dict(run=entry["run"], arch=entry.get("arch"), scale=entry.get("scale"),
                                seed=entry.get("seed"), status=status, slurm_job=job, slurm_state=state,
                                sweep=sweep["sweep"]))
    return out



def wait_for_sweep(folders: List[str], sweep: str, log: Callable[[str], None]) -> None:
    """Return once none of the sweep's recorded Slurm jobs (array tasks, requeued jobs) is in squeue, polling every
    5 s, backing off to 60 s; ValueError when the sweep has no record or squeue does not answer."""
    delay, since = 5.0, time.time()
    while True:
        records = [s for s in sweep_records(folders) if s["sweep"] == sweep]
        if not records:
            raise ValueError(f"--wait: no record of sweep {sweep!r} below {', '.join(folders)} "
                            "(<runs>/_grid/<sweep>.json, written by submit_grid --submit)")
        jobs = {str(j) for r in records for a in r["arrays"] for j in a.get("jobs") or [a["job"]]}
        queue = squeue_states()
        if queue is None:
            raise ValueError("--wait: squeue does not answer (run this where Slurm's commands work)")
        live = sorted({j.split("_")[0] for j in queue} & jobs)
        if not live:
            log(f"collect_grid: no job of sweep {sweep} is queued or running ({time.time() - since:.0f} s waited)")
            return
        log(f"collect_grid: waiting for job(s) {', '.join(live)} of sweep {sweep} ...")
        time.sleep(delay)
        delay = min(60.0, delay * 1.5)
