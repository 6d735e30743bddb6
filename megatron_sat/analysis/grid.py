"""A sweep's results read back: every run folder below some folders, one row per run (grid.csv).

A run folder holds config.json and metrics.jsonl (megatron_sat/training/monitor.py describes both). From them:

    run, arch, scale, seed        folder name; config.json (scale: training/monitor.py scale_name); --seed
    params, non_embedding_params  config.json num_parameters (this model's, counted once), minus vocab x d_model
    tokens, train_flops           consumed samples x seq length at the last logged step; x flops_per_token
                                  (the trainer's analytic count, megatron_sat/model/flops.py, 3 x forward)
    final_val_loss, best_val_loss the validation loss at the last step (final_val_step says which step it was)
                                  and the lowest one logged
    tokens_per_s_per_gpu, mfu,    medians over the logged intervals, the first left out (warm-up) when there are
    step_time_s                   more; tokens/s divided by the world size
    wall_hours, gpu_hours         wall_time_s of the last line (all attempts, from each process start); x world size
    peak_memory_gib               the GPU's peak reserved memory if the run had one, else the CPU peak RSS (rank 0)
    status                        complete / running / failed / stopped (run_status), restarts: attempts - 1
    slurm_job, slurm_state        the last attempt's Slurm job; its state: squeue's while it lives, after that
    slurm_exit_code, slurm_elapsed  Slurm's final state (TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, CANCELLED, ...), exit
                                  code (code:signal) and elapsed time from its accounting (sacct, add_final_states)
    saved_step, reason            the last checkpoint (latest_checkpointed_iteration.txt); why the run is not
                                  complete: the trainer's end line, or for an attempt that ended without one,
                                  Slurm's ("TIMEOUT after 04:00:00 (limit 04:00:00), exit code 0:15; no save since
                                  step 1200")
    eval:<task>, eval_avg:<suite> scores of tools/evaluate.py results.json files inside the run folder (the main
                                  metric per task, as in megatron_sat/analysis/evaluation.py)

Bad input raises GridError naming the file: a folder without runs, a run folder missing config.json or
metrics.jsonl, a line of metrics.jsonl that is not JSON (only a last line cut short, with no newline, is
left out, with a warning: a write in progress or a crash). The sweep's side (its records in
<runs>/_grid/<sweep>.json, squeue's and sacct's states) is megatron_sat/sweep/ (records.py, slurm.py).
"""

import csv
import glob
import hashlib
import io
import json
import os
import socket
import statistics
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import psutil

from megatron_sat.analysis.evaluation import MAIN_METRICS
from megatron_sat.sweep.records import pending_entries, sweep_records
from megatron_sat.sweep.slurm import ACTIVE_SLURM, add_final_states, sacct_states, squeue_states
from megatron_sat.training.monitor import scale_name
from megatron_sat.training.records import METRICS, parse_lines
from megatron_sat.training.run_folder import read_tracker

COLUMNS = ["run", "arch", "scale", "seed", "status", "step", "train_iters", "params", "non_embedding_params",
           "tokens", "train_flops", "final_val_loss", "final_val_step", "best_val_loss", "last_train_loss",
           "tokens_per_s_per_gpu", "mfu", "step_time_s", "wall_hours", "gpu_hours", "peak_memory_gib",
           "peak_gpu_allocated_gib", "peak_gpu_reserved_gib", "peak_cpu_rss_gib", "restarts", "world_size", "sweep",
           "recipe", "data_id", "slurm_job", "slurm_state", "slurm_exit_code", "slurm_elapsed", "saved_step",
           "reason", "path"]
SKIP_DIRS = ("wandb", "data_cache", "index_cache")


class GridError(ValueError):
    """Bad input for the collector: the message names the file or folder."""


# ---------------------------------------------------------------------------------------------- finding runs
def find_runs(folders: Iterable[str]) -> List[str]:
    """Every run folder (config.json or metrics.jsonl in it) at or below each folder, sorted. A folder with none is
    an error unless it holds a sweep's record (submitted, no job started yet)."""
    found = []
    for top in folders:
        if not os.path.isdir(top):
            raise GridError(f"{top}: no such folder")
        mine = []
        for here, dirs, files in os.walk(top):
            if "config.json" in files or "metrics.jsonl" in files:
                mine.append(here)
                dirs[:] = []  # checkpoints, wandb and caches below a run are not runs
                continue
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("iter_"))
        if not mine and not glob.glob(os.path.join(top, "**", "_grid", "*.json"), recursive=True):
            raise GridError(f"{top}: no run folder (config.json + metrics.jsonl) below it")  # nor a sweep's record
        found += mine
    return sorted(dict.fromkeys(os.path.abspath(f) for f in found))


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            out = json.load(f)
    except FileNotFoundError:
        raise GridError(f"{path}: missing (a run folder needs config.json and metrics.jsonl)") from None
    except (OSError, ValueError) as e:
        raise GridError(f"{path}: unreadable ({e})") from None
    if not isinstance(out, dict):
        raise GridError(f"{path}: not a JSON object")
    return out


def read_metrics(path: str) -> List[dict]:
    """The records of a metrics.jsonl; GridError naming file and line for a bad line (a last line cut short,
    without its newline, is left out)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise GridError(f"{path}: missing (a run folder needs config.json and metrics.jsonl)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GridError(f"{path}: unreadable ({e})") from None
    good, bad = parse_lines(text)  # the one metrics reader (training/records.py); here a bad line is an error
    last = len(text.splitlines())
    for number, line in bad:
        if number == last and not text.endswith("\n"):  # no newline after it: being written, or cut by a crash
            print(f"warning: {path}: its last line is cut short (a write in progress, or a crash): left out",
                  file=sys.stderr)
            continue
        try:
            json.loads(line)
        except ValueError:
            raise GridError(f"{path}: line {number} is not JSON: {line[:80]!r}") from None
        raise GridError(f"{path}: line {number} is not a metrics record (no integer 'step')")
    out = [record for _, record in good]
    return out


# ---------------------------------------------------------------------------------------------- status
def process_alive(attempt: dict) -> Optional[bool]:
    """Whether an attempt's process still runs: None when it ran on another host (cannot tell from here)."""
    if not attempt or attempt.get("host") != socket.gethostname() or not attempt.get("pid"):
        return None
    try:
        proc = psutil.Process(int(attempt["pid"]))
        if proc.status() == psutil.STATUS_ZOMBIE:  # killed, not yet reaped (an orphan whose parent died with it)
            return False
        start = attempt.get("process_start")
        return start is None or abs(proc.create_time() - float(start)) < 1.0
    except Exception:  # no such process, or not ours to ask: treat as gone
        return False


def run_status(records: List[dict], config: dict, alive: Optional[bool], slurm_state: Optional[str],
               metrics_age_s: float, stale_s: float):
    """(status, reason): complete / running / failed / stopped, from the last "end" line, the process or Slurm
    job, and (when neither can be asked) how long ago metrics.jsonl changed."""
    end = records[-1] if records and records[-1].get("event") == "end" else None
    train_iters = config.get("train_iters")
    last = max((r["step"] for r in records if "loss" in r), default=0)
    if end is not None and end.get("status") == "complete":
        return "complete", None
    if end is None and train_iters and last >= train_iters and any("val_loss" in r for r in records) \
            and alive is not True and slurm_state not in ACTIVE_SLURM:
        return "complete", "no end line (written before the trainer recorded one)"
    if alive or slurm_state in ACTIVE_SLURM:
        return "running", f"Slurm {slurm_state}" if slurm_state else None
    if end is not None:
        return end.get("status") or "stopped", end.get("reason")
    if alive is None and slurm_state is None and metrics_age_s < stale_s:
        return "running", f"metrics.jsonl changed {metrics_age_s / 60:.0f} min ago (process not visible from here)"
    return "failed", "no end line and no process: killed, out of memory or lost node"


# ---------------------------------------------------------------------------------------------- one run
def _median(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def _steady(rows: List[dict]) -> List[dict]:
    return rows[1:] if len(rows) > 1 else rows


def data_identity(config: dict) -> dict:
    ident = config.get("data_identity") or {}
    return dict(data=ident.get("data", config.get("data") or ("mock" if config.get("mock_data") else None)),
                tokenizer=ident.get("tokenizer", config.get("tokenizer")),
                tokenizer_vocab_size=ident.get("tokenizer_vocab_size", config.get("tokenizer_vocab_size")),
                validation_set_id=ident.get("validation_set_id"),
                split=None if ident.get("validation_set_id") else config.get("split"))


def data_id(config: dict) -> str:
    return hashlib.sha1(json.dumps(data_identity(config), sort_keys=True).encode()).hexdigest()[:8]


def eval_scores(folder: str) -> dict:
    """{'eval:<task>': main metric, 'eval_avg:<suite>': mean} from tools/evaluate.py results.json files in a run
    folder (any depth, checkpoints left out)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "**", "results.json"), recursive=True)):
        if os.sep + "iter_" in path[len(folder):]:
            continue
        summary = read_json(path)
        if "table" not in summary or "averages" not in summary:
            continue  # not an evaluation output
        for task in dict.fromkeys(r["task"] for r in summary["table"]):
            rows = {r["metric"]: r["value"] for r in summary["table"] if r["task"] == task}
            metric = next((m for m in MAIN_METRICS if m in rows), next(iter(rows), None))
            if metric is not None:
                out[f"eval:{task}"] = rows[metric]
        for suite, avg in summary["averages"].items():
            if suite != "all":
                out[f"eval_avg:{suite}"] = avg["mean"]
    return out


def read_run(folder: str, slurm: Optional[Dict[str, str]] = None, stale_s: float = 3600.0) -> dict:
    """One grid row (module docstring) plus 'curve': [(wall hours, validation loss)] for the figures."""
    config = read_json(os.path.join(folder, "config.json"))
    metrics_path = os.path.join(folder, METRICS)
    records = read_metrics(metrics_path)
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    attempts = config.get("attempts") or []
    attempt = attempts[-1] if attempts else {}
    slurm_job = attempt.get("slurm_job")
    slurm_state = (slurm or {}).get(slurm_job) if slurm_job else None
    age = time.time() - os.path.getmtime(metrics_path)
    status, reason = run_status(records, config, process_alive(attempt), slurm_state, age, stale_s)
    try:
        saved_step = read_tracker(folder)
    except Exception:  # noqa: BLE001 - a tracker being written or damaged: the checkpoint tools name it
        saved_step = None
    world = config.get("world_size") or 1
    seq = config.get("seq_length") or 0
    step = max((r["step"] for r in train), default=0)
    tokens = train[-1].get("consumed_samples", 0) * seq if train else 0
    params = config.get("num_parameters")
    non_emb = config.get("non_embedding_parameters")
    if non_emb is None and params is not None and config.get("vocab_size") and config.get("hidden_size"):
        non_emb = params - config["vocab_size"] * config["hidden_size"]
    wall = next((r["wall_time_s"] for r in reversed(records) if "wall_time_s" in r), None)
    steady = _steady(train)
    tps = _median(r.get("tokens_per_s") for r in steady)
    gpu_reserved = max((r["mem_gpu_reserved_gib"] for r in records if "mem_gpu_reserved_gib" in r), default=None)
    gpu_alloc = max((r["mem_gpu_allocated_gib"] for r in records if "mem_gpu_allocated_gib" in r), default=None)
    cpu_rss = max((r["mem_cpu_peak_rss_gib"] for r in records if "mem_cpu_peak_rss_gib" in r), default=None)
    final = val[-1] if val else None
    flops_tok = config.get("flops_per_token")
    row = dict(
        run=os.path.basename(folder), arch=config.get("arch"), scale=config.get("scale") or scale_name(config),
        seed=config.get("seed"), status=status, step=step, train_iters=config.get("train_iters"), params=params,
        non_embedding_params=non_emb, tokens=tokens, train_flops=None if flops_tok is None else flops_tok * tokens,
        final_val_loss=final["val_loss"] if final else None, final_val_step=final["step"] if final else None,
        best_val_loss=min((r["val_loss"] for r in val), default=None),
        last_train_loss=train[-1]["loss"] if train else None,
        tokens_per_s_per_gpu=None if tps is None else tps / world, mfu=_median(r.get("mfu") for r in steady),
        step_time_s=_median(r.get("step_time_s") for r in steady),
        wall_hours=None if wall is None else wall / 3600.0,
        gpu_hours=None if wall is None else wall / 3600.0 * world,
        peak_memory_gib=gpu_reserved if gpu_reserved is not None else cpu_rss,
        peak_gpu_allocated_gib=gpu_alloc, peak_gpu_reserved_gib=gpu_reserved, peak_cpu_rss_gib=cpu_rss,
        restarts=config.get("restarts", max(len(attempts) - 1, 0)), world_size=world, sweep=config.get("sweep"),
        recipe=config.get("recipe"), data_id=data_id(config), slurm_job=slurm_job, slurm_state=slurm_state,
        saved_step=saved_step, reason=reason, path=folder)
    row["no_end_line"] = not (records and records[-1].get("event") == "end")
    row.update(eval_scores(folder))
    row["eta_s"] = (row["step_time_s"] * (row["train_iters"] - step)
                    if status == "running" and row["step_time_s"] and row["train_iters"] else None)
    row["curve"] = [(r["wall_time_s"] / 3600.0, r["val_loss"]) for r in val if "wall_time_s" in r]
    row["data_identity"] = data_identity(config)
    return row


# ---------------------------------------------------------------------------------------------- sweeps
def select_sweep(rows: List[dict], sweeps: List[dict], name: Optional[str]) -> Tuple[List[dict], List[dict]]:
    """(rows, sweep records) of sweep `name` only (all of them without a name): the runs its record lists or whose
    config.json names it; GridError when there is neither a run nor a record of it."""
    if not name:
        return rows, sweeps
    sweeps = [s for s in sweeps if s["sweep"] == name]
    listed = {e["run"] for s in sweeps for a in s["arrays"] for e in a["entries"]}
    rows = [r for r in rows if r.get("sweep") == name or r["run"] in listed]
    if not rows and not sweeps:
        raise GridError(f"no run of sweep {name!r} below the folders given")
    return rows, sweeps


def read_runs(folders: List[str], sweep: Optional[str] = None, stale_s: float = 3600.0,
              log: Optional[Callable[[str], None]] = None):
    """(rows, pending, note): a row per run folder below `folders` (read_run; sweep `sweep`'s only when given),
    the sweep records' entries that have no run folder yet (pending_entries), both with Slurm's final states of
    their finished jobs (add_final_states); note says why sacct could not give them (else None). `log` gets
    progress lines. GridError for bad input (find_runs, read_run, select_sweep)."""
    log = log or (lambda text: None)
    paths = find_runs(folders)
    log(f"collect_grid: {len(paths)} run folder(s) below {', '.join(folders)}")
    slurm = squeue_states()
    rows = []
    for i, path in enumerate(paths, start=1):
        if i == len(paths) or i % 10 == 1:
            log(f"  reading {i}/{len(paths)}: {os.path.relpath(path)}")
        rows.append(read_run(path, slurm, stale_s=stale_s))
    rows, sweeps = select_sweep(rows, sweep_records(folders), sweep)
    pending = pending_entries(sweeps, rows, slurm)
    # finished jobs: Slurm's final state, exit code and elapsed time from its accounting (sacct)
    accounting, note = sacct_states(r["slurm_job"] for r in rows + pending if r.get("slurm_state") not in ACTIVE_SLURM)
    add_final_states(rows + pending, accounting, note)
    return rows, pending, note


# ---------------------------------------------------------------------------------------------- output
def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def grid_csv(rows: List[dict]) -> str:
    """grid.csv: COLUMNS, then the eval columns found (sorted); floats written exactly (repr)."""
    evals = sorted({k for r in rows for k in r if k.startswith(("eval:", "eval_avg:"))})
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS + evals)
    for r in rows:
        writer.writerow([_cell(r.get(c)) for c in COLUMNS + evals])
    return buf.getvalue()


def _fmt_eta(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def status_table(rows: List[dict], pending: List[dict] = (), note: Optional[str] = None) -> str:
    """--status: one line per run (and per queued entry): status, step / total, ETA, last loss, Slurm job and
    state, and why a run that is not running or complete ended; `note` (no accounting) as the last line."""
    head = ["run", "arch", "scale", "seed", "status", "step", "ETA", "last loss", "val loss", "slurm job", "state",
            "reason"]
    lines = []
    for r in list(rows) + list(pending):
        total = r.get("train_iters")
        lines.append([r["run"], str(r.get("arch") or "-"), str(r.get("scale") or "-"), str(r.get("seed") or "-"),
                      r["status"], f"{r.get('step', 0)}/{total or '?'}" if "step" in r else "-",
                      _fmt_eta(r.get("eta_s")),
                      f"{r['last_train_loss']:.4f}" if r.get("last_train_loss") is not None else "-",
                      f"{r['final_val_loss']:.4f}" if r.get("final_val_loss") is not None else "-",
                      r.get("slurm_job") or "-", r.get("slurm_state") or "-",
                      "" if r["status"] in ("complete", "running") else r.get("reason") or ""])
    widths = [max(len(x[i]) for x in [head] + lines) for i in range(len(head))]
    fmt = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()  # noqa: E731
    counts = {}
    for r in list(rows) + list(pending):
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(x) for x in lines] + [summary or "no runs"]
                     + ([note + ": final states of finished jobs are unknown"] if note else []))
