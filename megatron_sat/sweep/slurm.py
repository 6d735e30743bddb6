"""Slurm's view of a sweep's jobs: squeue's live states, sacct's final states (TIMEOUT, NODE_FAIL, OUT_OF_MEMORY,
CANCELLED, ...) with exit code and elapsed time, and those final states written into grid rows (add_final_states:
the status and reason of a run whose last attempt ended without the trainer's end line)."""

import re
import subprocess
from typing import Dict, Iterable, List, Optional

# squeue / sacct states of a job that is queued, running or about to run again
ACTIVE_SLURM = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING"}


def squeue_states() -> Optional[Dict[str, str]]:
    """{job id: state} of every job squeue lists ('123', '123_4' for array tasks, pending ranges expanded);
    None when squeue is absent or does not answer."""
    try:
        proc = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    out = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        job, state = parts
        for one in array_tasks(job):
            out[one] = state
    return out


def array_tasks(job: str) -> List[str]:
    """'123_[0-3,7%2]' (squeue's and sacct's way of writing array tasks that never started) -> '123_0' ... '123_7';
    any other id as it is."""
    m = re.fullmatch(r"(\d+)_\[([^\]]+)\]", job)
    if not m:
        return [job]
    out = []
    for item in m.group(2).split("%")[0].split(","):
        lo, _, hi = item.partition("-")
        out += [f"{m.group(1)}_{task}" for task in range(int(lo), int(hi or lo) + 1)]
    return out


SACCT_FIELDS = ("JobID", "State", "ExitCode", "Elapsed", "Timelimit", "End")


def sacct_states(jobs: Iterable[str]):
    """(records, note): {job id: {state, exit_code, elapsed, timelimit, end, by}} for the jobs Slurm's accounting
    knows (the latest instance of a requeued job), and None, or None and one line saying why the accounting
    cannot be asked (no sacct here, or a cluster without slurmdbd)."""
    # an array's tasks by the array's id: sacct lists tasks that never started only under it, as one range
    jobs = sorted({j.split("_")[0] for j in jobs if j})
    if not jobs:
        return {}, None
    out = {}
    for i in range(0, len(jobs), 200):
        cmd = ["sacct", "-X", "-n", "-P", "-a", "-j", ",".join(jobs[i:i + 200]), "-o", ",".join(SACCT_FIELDS)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"Slurm accounting not available (sacct: {e})"
        if proc.returncode != 0:
            why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            return None, f"Slurm accounting not available (sacct: {why})"
        for line in proc.stdout.splitlines():
            parts = line.split("|")
            if len(parts) != len(SACCT_FIELDS):
                continue
            job, state, code, elapsed, limit, end = parts
            state, _, by = state.partition(" by ")  # "CANCELLED by 0": the uid that cancelled it
            for one in array_tasks(job):  # tasks cancelled before they started: one line for the range
                out[one] = dict(state=state, exit_code=code, elapsed=elapsed, timelimit=limit, end=end, by=by or None)
    return out, None


def slurm_reason(record: dict) -> str:
    """Why an attempt ended, in Slurm's words: "TIMEOUT after 04:00:00 (limit 04:00:00), exit code 0:15"."""
    text = f"{record['state']}" + (f" by uid {record['by']}" if record.get("by") else "")
    text += f" after {record['elapsed']}"
    if record["state"] == "TIMEOUT" and record.get("timelimit"):
        text += f" (limit {record['timelimit']})"
    return text + f", exit code {record['exit_code']}"


def add_final_states(rows: List[dict], accounting: Optional[dict], note: Optional[str] = None) -> None:
    """Slurm's final state of each finished job into the rows (and grid entries that never started): state,
    exit code, elapsed time, and the reason of a run whose last attempt ended without an end line. With no
    accounting (None), a run without an end line says so in its reason (`note`)."""
    for r in rows:
        job = r.get("slurm_job")
        if not job or r.get("slurm_state") in ACTIVE_SLURM:
            continue  # no Slurm job, or squeue still shows it
        record = (accounting or {}).get(job)
        no_end = r.get("no_end_line") or r["status"] == "not started"
        if record is None:
            if accounting is None and note and no_end and r["status"] != "not started":
                r["reason"] = f"{r.get('reason')}; {note}"
            continue
        r.update(slurm_state=record["state"], slurm_exit_code=record["exit_code"], slurm_elapsed=record["elapsed"])
        if record["state"] in ACTIVE_SLURM:  # sacct knows it still runs (squeue did not answer)
            if r["status"] in ("failed", "stopped", "running"):
                r.update(status="running", reason=f"Slurm {record['state']}")
            continue
        if r["status"] == "complete":
            continue
        if r["status"] == "running":
            if not (r.get("reason") or "").startswith("metrics.jsonl changed"):
                continue  # its process runs here
            r["status"] = "failed"  # judged by how recently metrics.jsonl changed: Slurm knows better
            no_end = True
        said = slurm_reason(record)
        if r["status"] == "not started":
            r["reason"] = f"{said}, before the run wrote anything"
        elif no_end:
            saved = r.get("saved_step")
            r["reason"] = said + (f"; no save since step {saved}" if saved else "; no checkpoint saved")
        else:
            r["reason"] = f"{r.get('reason') or r['status']}; Slurm: {said}"
