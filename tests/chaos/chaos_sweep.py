"""The sweep tests/chaos/chaos.py drives: submit, inject the drawn faults, resubmit what ended, verify against fault-free runs.

One fault in flight per run at a time (a node loss: none elsewhere, it hits every run); a fault is recovered when
the run logs a training step again. `redone` = the last step the interrupted attempt logged minus the step the
next attempt resumed from (both read from the run's Slurm log).
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from typing import List, Optional

import chaos_faults as cf

from megatron_sat.training.records import read_metrics

ROOT = cf.ROOT
SAVE_INTERVAL = 5
RETAIN_INTERVAL = 1000  # retention deletes every checkpoint but the newest and those at multiples of this


def draw(rng, n: int, runs: int) -> List[dict]:
    """n faults: kinds in shuffled rounds of all kinds (each once before any twice), a delay in steps (the run is
    the ready one with the most steps left when the fault's turn comes; `run` is kept for the record)."""
    kinds = []
    while len(kinds) < n:
        block = list(cf.KINDS)
        rng.shuffle(block)
        kinds += block
    return [dict(kind=k, run=rng.randrange(runs), delay=rng.randint(2, 2 * SAVE_INTERVAL)) for k in kinds[:n]]


def _rows(folder: str) -> List[dict]:
    """The step records of a run's metrics.jsonl (the torn-metrics fault's half record left out)."""
    return [row for row in read_metrics(folder) if "loss" in row and row["step"] < 999999]


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


class Run:
    def __init__(self, index: int, entry: dict, folder: str, line: str):
        self.index, self.name, self.folder = index, entry["run"], folder
        self.arch = entry["arch"]
        self.line = line  # the manifest line: RECIPE FLAGS...
        self.job: Optional[str] = None
        self.logs: List[str] = []
        self.fault: Optional[dict] = None
        self.ready_rows = 0
        self.done = False
        self.expected_restarts = 0
        self.resubmissions = 0


class Sweep:
    def __init__(self, cluster, out: str, archs, faults: int, hang_s: float, rng, name: str):
        self.cluster, self.out, self.archs, self.rng, self.name = cluster, out, archs, rng, name
        self.hang_s = hang_s
        self.iters = 100 + faults * 40  # steps left for the faults: ~35 s per restart on 2 loaded cores
        self.runs_dir, self.logs = os.path.join(out, "runs"), os.path.join(out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        site = os.path.join(out, "site.sh")
        with open(site, "w") as f:
            f.write(f"MSAT_GPUS=0\nMSAT_CPUS_PER_TASK=1\nMSAT_RUNS={self.runs_dir}\nMSAT_LOGS={self.logs}\n"
                    f"MSAT_PYTHON={sys.executable}\nsource {ROOT}/slurm/site.sh\n")
        self.env = dict(os.environ, MSAT_SITE=site, MSAT_REPO=ROOT, OMP_NUM_THREADS="1", MSAT_SWEEP=name,
                        PYTHONPATH=ROOT)
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            self.env.pop(key, None)
        self.runs: List[Run] = []
        self.faults: List[dict] = []
        self.readers: List[dict] = []  # export / evaluate faults whose process still runs
        self.mounts: List[str] = []
        self.refs = {}
        self.node_down = None  # (node, since)
        self.t0 = time.time()
        self.notes: List[str] = []

    def say(self, text: str) -> None:
        print(f"[chaos {time.time() - self.t0:6.1f} s] {text}", flush=True)

    # ------------------------------------------------------------------ set-up
    def submit(self) -> None:
        # the embedded corpus (not the recipes' mock tokens): the runs record a tokenizer, so that an evaluation
        # racing a run scores its checkpoint rather than refusing it
        flags = ["--embedded-data", os.path.join(self.out, "data"), "--vocab-size", "512",
                 "--train-iters", str(self.iters), "--log-interval", "1", "--save-interval", str(SAVE_INTERVAL),
                 "--save-retain-interval", str(RETAIN_INTERVAL), "--eval-interval", "100000",
                 "--hang-timeout-minutes", f"{self.hang_s / 60:.4f}"]
        env = self.cluster.env(dict(self.env, MSAT_SBATCH_EXTRA="--hold"))  # held until the tmpfs are mounted
        tool = os.path.join(ROOT, "tools", "submit_grid.py")
        proc = subprocess.run([sys.executable, tool, "--archs", ",".join(self.archs), "--scales", "debug",
                               "--nodes", "2", "--gpus-per-node", "1", "--sweep", self.name, "--submit", "--", *flags],
                              cwd=self.out, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"submit_grid failed: {proc.stdout}{proc.stderr}")
        record = json.load(open(os.path.join(self.runs_dir, "_grid", f"{self.name}.json")))
        array = record["arrays"][0] if "arrays" in record else record["jobs"][0]
        self.manifest = array["manifest"]
        lines = open(self.manifest).read().splitlines()
        for i, entry in enumerate(array["entries"]):
            run = Run(i, entry, os.path.join(self.runs_dir, entry["run"]), lines[i])
            run.job = f"{array['job']}_{i}"
            run.logs.append(os.path.join(self.logs, f"msat-debug-{array['job']}_{i}.out"))
            os.makedirs(run.folder, exist_ok=True)
            mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160m", "tmpfs", run.folder],
                                   capture_output=True, text=True)
            if mount.returncode == 0:
                self.mounts.append(run.folder)
            else:
                self.notes.append(f"no tmpfs for {run.name} ({mount.stderr.strip()}): disk_full skipped there")
            run.ready_rows = 0
            self.runs.append(run)
        self.time_limit = self.cluster.job(self.runs[0].job)[0].get("TimeLimit", "15")
        self.cluster.run(["scontrol", "release", array["job"]])
        self.say(f"sweep {self.name}: {len(self.runs)} runs of {self.iters} steps, job {array['job']}, "
                 f"runs on tmpfs: {len(self.mounts)}")
        ref_dir = os.path.join(self.out, "reference")
        for run in self.runs:  # the fault-free runs: the same entries, the same DP2 layout, on local disk
            recipe, *rflags = shlex.split(run.line)
            at = rflags.index("--hang-timeout-minutes")  # no faults to detect there (nor a loaded first save)
            del rflags[at:at + 2]
            log = open(os.path.join(self.logs, f"reference-{run.name}.log"), "w")
            self.refs[run.name] = subprocess.Popen(
                ["nice", "-n", "10", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                 f"--master-port={_port()}", "-m", "megatron_sat.train", "--recipe", recipe, *rflags, "--save",
                 os.path.join(ref_dir, run.name), "--no-progress-bar"], cwd=ROOT, env=self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    def resubmit(self, run: Run) -> None:
        from megatron_sat.sweep.plan import sbatch_args

        site = dict(MSAT_LOGS=self.logs, MSAT_CPUS_PER_TASK="1", MSAT_GPUS="0")
        args = sbatch_args(("debug", 2, 1, "cpu", self.time_limit), 1, site, os.path.join(ROOT, "slurm"),
                           self.manifest)
        args = [f"--array={run.index}" if a.startswith("--array=") else a for a in args]
        job = self.cluster.sbatch(args, cwd=self.out, env=self.env)
        run.job = f"{job}_{run.index}"
        run.logs.append(os.path.join(self.logs, f"msat-debug-{job}_{run.index}.out"))
        run.resubmissions += 1
        self.say(f"{run.name}: resubmitted as {run.job}")

    # ------------------------------------------------------------------ the loop
    def run(self, plan: List[dict], timeout: float = 3600) -> None:
        pending = list(plan)
        deadline = time.time() + timeout
        while time.time() < deadline:
            self._restore_node()
            for run in self.runs:
                self._poll(run)
            if pending:
                self._maybe_inject(pending)
            self._poll_readers()
            if all(r.done for r in self.runs) and not any(r.fault for r in self.runs) and not self.readers:
                break
            time.sleep(0.3)
        else:
            raise TimeoutError(f"the sweep did not finish in {timeout:.0f} s")
        for f in pending:
            self.notes.append(f"fault {f['kind']} not injected: every run had finished")

    def _state(self, run: Run):
        records = self.cluster.job(run.job)
        return (records[0].get("JobState", "?"), records[0].get("Reason", "")) if records else ("?", "")

    def _poll(self, run: Run) -> None:
        if run.done:
            return
        state, reason = self._state(run)
        f = run.fault
        if f and f["kind"] == "suspend" and f.get("resume_at") and time.time() >= f["resume_at"]:
            self.cluster.run(["scontrol", "resume", run.job], check=False)
            f["resume_at"] = None
        if f and f.get("proc") is not None:  # a reader
            if f["proc"].poll() is not None:
                ok, detail = cf.reader_verdict(f["kind"], f["proc"], f["output"])
                f.update(named=ok, detail=detail, recovery_s=time.time() - f["t_abs"], redone=0, proc=None)
                self._close(run, f)
        elif f and f.get("state_seen") is None and state not in ("RUNNING", "SUSPENDED"):
            f["state_seen"] = f"{state} {reason}".strip()
        if f and f.get("fill_target") and state == "RUNNING" and f.get("state_seen") is None:
            # what retention freed since the disk was filled (until the job ends: its resubmission runs freed)
            cf.top_up(run.folder, *f["fill_target"])
        rows = _rows(run.folder)
        if f and f["kind"] not in ("export", "evaluate") and f.get("resume_at") is None and state == "RUNNING":
            self._recovered(run, f, rows)
        if state in cf_terminal():
            if state == "COMPLETED" and (_tracker(run.folder) or 0) >= self.iters:
                run.done = True
                f = run.fault
                if f and f.get("proc") is not None:  # a reader still at work on the finished run
                    f["proc"].wait(timeout=600)
                    ok, detail = cf.reader_verdict(f["kind"], f["proc"], f["output"])
                    f.update(named=ok, detail=detail, recovery_s=time.time() - f["t_abs"], redone=0, proc=None)
                elif f:  # ended before a step after the fault (the fault came at the last steps)
                    f.update(recovery_s=time.time() - f["t_abs"], redone=_redone(run, f, _attempts(run.folder)))
                if f:
                    self._close(run, f)
                return
            if self.node_down:
                return  # wait for the node before resubmitting
            cf.free_disk(run.folder)
            self.resubmit(run)

    def _poll_readers(self, wait: bool = False) -> None:
        """Readers race the runs without holding them: the run gets its next fault meanwhile."""
        for f in list(self.readers):
            if wait:
                f["proc"].wait(timeout=600)
            if f["proc"].poll() is not None:
                ok, detail = cf.reader_verdict(f["kind"], f["proc"], f["output"])
                f.update(named=ok, detail=detail, recovery_s=time.time() - f["t_abs"], redone=0, proc=None)
                self.readers.remove(f)

    def _recovered(self, run: Run, f: dict, rows: List[dict]) -> None:
        """A fault is over once the run trains again: a step logged after it, by a new attempt where it restarts."""
        attempts = _attempts(run.folder)
        if f["restarts"]:
            if len(attempts) <= f["attempts_at"]:
                return
            if f.get("rows_new") is None:
                f["rows_new"] = len(rows)  # rows at the first sight of the new attempt
                return
            if len(rows) <= f["rows_new"]:
                return
        elif len(rows) <= f["rows_at"]:
            return
        f.update(recovery_s=time.time() - f["t_abs"], redone=_redone(run, f, attempts))
        self._close(run, f)

    def _close(self, run: Run, f: dict) -> None:
        run.fault = None
        run.ready_rows = len(_rows(run.folder))

    def _ready(self, run: Run, delay: int) -> bool:
        """Free for a fault: no fault in flight, training, `delay` steps logged since its last recovery, and a
        checkpoint to fall back to (a reader needs one, a full disk measures one)."""
        return run.fault is None and len(_rows(run.folder)) >= run.ready_rows + delay and bool(
            _tracker(run.folder)) and self._state(run)[0] == "RUNNING" and bool(cf.rank_processes(run.folder))

    def _maybe_inject(self, pending: List[dict]) -> None:
        """The next fault goes to a ready run, the one with the most steps left (so that no run races ahead while
        another restarts). A node loss hits every run: it waits until all are ready, letting later faults go
        first, for at most 60 s; then it holds them."""
        live = [r for r in self.runs if not r.done]
        if not live or self.node_down:
            return
        for nxt in list(pending):
            if nxt["kind"] == "node_loss":
                if all(self._ready(r, nxt["delay"]) for r in live):
                    pending.remove(nxt)
                    self._inject(self._most_left(live), "node_loss", None)
                    return
                if time.time() - nxt.setdefault("waiting_since", time.time()) > 60:
                    return
                continue
            cands = [r for r in live if self._ready(r, nxt["delay"])
                     and (nxt["kind"] != "disk_full" or r.folder in self.mounts)]
            if cands:
                pending.remove(nxt)
                self._inject(self._most_left(cands), nxt["kind"], None)
            return

    def _most_left(self, runs: List[Run]) -> Run:
        return max(runs, key=lambda r: (self.iters - _rows(r.folder)[-1]["step"], -r.index))

    def _inject(self, run: Run, kind: str, rows) -> None:
        fault = cf.FAULTS[kind]
        rows = _rows(run.folder)
        log = run.logs[-1]
        f = dict(kind=kind, run=run.name, t=time.time() - self.t0, t_abs=time.time(), step=rows[-1]["step"],
                 rows_at=len(rows), attempts_at=len(_attempts(run.folder)), restarts=fault.restarts,
                 job=run.job, log=log, log_at=len(_read(log)), log_index=len(run.logs) - 1,
                 detected_by=fault.detected_by, detail="", named=None, state_seen=None, resume_at=None, proc=None)
        if kind in ("kill9_rank", "hang"):
            f["detail"] = cf.signal_rank(run.folder, cf.SIGNALS[kind], self.rng)
        elif kind == "torn_metrics":
            cf.signal_rank(run.folder, signal.SIGKILL, self.rng, every=True)
            cf.wait_until(lambda: not cf.rank_processes(run.folder), 30, "the killed ranks to go")
            f["detail"] = cf.tear_metrics(run.folder)
        elif kind == "suspend":
            self.cluster.run(["scontrol", "suspend", run.job])
            f["resume_at"] = time.time() + 2 * self.hang_s
            f["detail"] = f"{2 * self.hang_s:.0f} s"
        elif kind == "preempt_usr1":
            self.cluster.signal_batch(run.job, "USR1")
        elif kind == "scancel":
            self.cluster.run(["scancel", run.job])
        elif kind == "disk_full":
            f["detail"], f["fill_target"] = cf.fill_disk(run.folder, RETAIN_INTERVAL)
        elif kind in ("export", "evaluate"):
            f["output"] = os.path.join(self.out, "readers", f"{kind}-{len(self.faults)}")
            os.makedirs(os.path.dirname(f["output"]), exist_ok=True)
            f["proc"] = cf.start_reader(kind, run.folder, f["output"], self.env)
        elif kind == "node_loss":
            node = self.rng.choice(self.cluster.nodes)
            hit = [r for r in self.runs if not r.done and cf.rank_processes(r.folder)]
            self.cluster.kill_node(node)
            self.cluster.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=chaos-node-loss"],
                             check=False)
            self.node_down = (node, time.time())
            f["detail"] = f"{node}; runs hit: {', '.join(r.name[:18] for r in hit)}"
            for other in hit:  # each restarts too: a fault of its own in flight (not a row of the table)
                if other is not run:
                    other.expected_restarts += 1
                    rows_o = _rows(other.folder)
                    other.fault = dict(f, run=other.name, shadow=True, step=rows_o[-1]["step"], rows_at=len(rows_o),
                                       attempts_at=len(_attempts(other.folder)), job=other.job, log=other.logs[-1],
                                       log_at=len(_read(other.logs[-1])), log_index=len(other.logs) - 1)
        if fault.restarts:
            run.expected_restarts += 1
        self.faults.append(f)
        if kind in ("export", "evaluate"):
            self.readers.append(f)
        else:
            run.fault = f
        self.say(f"fault {len(self.faults)}: {kind} -> {run.name} at step {f['step']} {f['detail']}")

    def _restore_node(self) -> None:
        if not self.node_down:
            return
        node, since = self.node_down
        if time.time() - since < 3:
            return
        if f"slurmd-{node}" not in self.cluster.procs:
            self.cluster.start_node(node)
        self.cluster.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
        out = self.cluster.run(["sinfo", "-h", "-n", node, "-o", "%T"], check=False).stdout.strip()
        if out and not out.startswith(("down", "drain", "fail")) and not out.endswith("*"):
            self.say(f"node {node} back ({out})")
            self.node_down = None

    # ------------------------------------------------------------------ checks
    def verify(self) -> dict:
        from verify_chaos import verify

        return verify(self)

    def cleanup(self) -> None:
        for f in self.readers:
            if f["proc"].poll() is None:
                f["proc"].kill()
        for proc in self.refs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for run in self.runs:
            cf.free_disk(run.folder)
        for mount in self.mounts:
            subprocess.run(["umount", "-l", mount], capture_output=True)


def _attempts(folder: str) -> List[dict]:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f).get("attempts") or []
    except (OSError, ValueError):
        return []


def _redone(run: Run, f: dict, attempts: List[dict]) -> int:
    """Steps the interrupted attempt trained past the checkpoint the next attempt resumed from: its last step
    line in the run's Slurm log (after the fault, before the resume) minus that checkpoint's step. Read from the
    log, not metrics.jsonl: a resume rewrites metrics.jsonl without the steps past its checkpoint. No new attempt
    (a suspension, a reader): the same process trained on, nothing was redone."""
    if len(attempts) <= f["attempts_at"]:
        return 0
    return redone_in_log(log_text(run, f), f["step"], attempts[f["attempts_at"]].get("start_step", 0))


def redone_in_log(text: str, step_at_fault: int, start: int) -> int:
    """`text`: the run's log from the fault on; `start`: the step the next attempt resumed from."""
    resumed = re.search(rf"resumed from \S+iter_{start:07d} \(iteration {start}\b", text)
    trained = [int(n) for n in re.findall(r"^step\s+(\d+)/", text[:resumed.start()] if resumed else text, re.M)]
    return max([step_at_fault, *trained]) - start


def cf_terminal():
    from slurm_cluster import TERMINAL

    return TERMINAL


def _tracker(folder: str) -> Optional[int]:
    try:
        return int(open(os.path.join(folder, "latest_checkpointed_iteration.txt")).read())
    except (OSError, ValueError):
        return None


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_text(run: Run, f: dict) -> str:
    """The run's Slurm log from the fault on (its log then, after the offset, and every later log)."""
    return _read(run.logs[f["log_index"]])[f["log_at"]:] + "".join(_read(p) for p in run.logs[f["log_index"] + 1:])


def named(run: Run, f: dict) -> bool:
    if f["kind"] in ("export", "evaluate"):
        return bool(f["named"])
    text = log_text(run, f)
    found = all(re.search(n, text) for n in cf.FAULTS[f["kind"]].needles)
    if f["kind"] == "node_loss":  # the batch shell may have died with the node: Slurm's state names it then
        return found and (bool(f.get("state_seen")) or "training exited" in text)
    return found
