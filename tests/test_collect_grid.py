"""A sweep read back (issue 13): tools/collect_grid.py over real runs, the fits, the trainer's records.

    .venv/bin/python -m pytest -q -ra tests/test_collect_grid.py      # the Slurm parts take most of the time; the
                                                                      # time-limit job waits out Slurm's 1-minute minimum

  * a real sweep through tools/submit_grid.py on the real local Slurm (tests/slurm_cluster.py, one cluster start):
    transformer and satformer x 2 sizes (debug, and debug at 2 layers) x seeds 1, 2, plus one run that hits a NaN
    (failed) and one that stops early (stopped); --status while it runs names the Slurm jobs; then every value of
    grid.csv equals what the run's own metrics.jsonl and config.json say, the failed and stopped runs are listed
    with their status, and the runs share one validation set;
  * local runs: a live run is "running" (ETA), killed it is "failed", resumed and stopped it has 1 restart and its
    wall time goes on; data of another validation set is flagged and kept apart; bad input exits 2 naming the
    file, with nothing written; --wandb writes an offline summary run; the trainer's wandb run is in the sweep's
    group with arch, scale and seed;
  * Slurm's final states from its accounting (sacct, on the same cluster): a run killed at its time limit while
    its save hangs, a cancelled run and a run whose node dies each show Slurm's state, exit code, elapsed time
    and reason in --status and grid.csv; without accounting, --status says so;
  * the fits recover E, A, alpha and a compute multiplier from points made with known values;
  * validation samples do not depend on --seed, training batches do (the dataset builder).
The Slurm tests skip (with the reason, naming `make slurm`) only when Slurm is not installed; CI fails instead.
"""

import csv
import glob
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

import pytest
import train_cli
from slurm_cluster import SlurmCluster
from test_slurm import _start

from megatron_sat.analysis import collect as collect_lib


@pytest.fixture(scope="module")
def cluster():
    """The local Slurm with accounting (slurmdbd + MariaDB: sacct works); `site` is in conftest.py."""
    c = SlurmCluster(accounting=True)
    _start(c)
    try:
        yield c
    finally:
        c.stop()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECT = os.path.join(ROOT, "tools", "collect_grid.py")
SWEEP = "t13"
FLAGS = ["--train-iters", "6", "--eval-interval", "3", "--log-interval", "2"]


def collect(*args, env=None, expect=0):
    proc = subprocess.run([sys.executable, COLLECT, *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)
    assert proc.returncode == expect, proc.stdout + proc.stderr
    return proc


def records(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def config(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def read_csv(path):
    with open(path) as f:
        return {r["run"]: r for r in csv.DictReader(f)}


def expected_row(folder):
    """The grid row of a run folder, recomputed here from its files by the rules of megatron_sat/analysis/grid.py."""
    c, recs = config(folder), records(folder)
    train = [r for r in recs if "loss" in r]
    val = [r for r in recs if "val_loss" in r]
    steady = train[1:] if len(train) > 1 else train
    med = lambda key: statistics.median(r[key] for r in steady) if steady and steady[0].get(key) is not None else None  # noqa: E731,E501
    tokens = train[-1]["consumed_samples"] * c["seq_length"]
    wall = recs[-1]["wall_time_s"] / 3600
    return dict(arch=c["arch"], scale=c["scale"], seed=c["seed"], params=c["num_parameters"],
                non_embedding_params=c["num_parameters"] - c["vocab_size"] * c["hidden_size"], tokens=tokens,
                train_flops=c["flops_per_token"] * tokens, final_val_loss=val[-1]["val_loss"],
                best_val_loss=min(r["val_loss"] for r in val), step=train[-1]["step"],
                tokens_per_s_per_gpu=med("tokens_per_s") / c["world_size"], mfu=med("mfu"),
                step_time_s=med("step_time_s"), wall_hours=wall, gpu_hours=wall * c["world_size"],
                peak_memory_gib=max(r["mem_cpu_peak_rss_gib"] for r in recs if "mem_cpu_peak_rss_gib" in r),
                restarts=len(c["attempts"]) - 1)


def same(cell: str, value) -> bool:
    if value is None:
        return cell == ""
    if isinstance(value, float):
        return float(cell) == value
    return cell == str(value)


def submit(cluster, site, archs, seeds, *flags, env_extra=None):  # noqa: F811
    env = cluster.env(dict(site["env"], **(env_extra or {})))
    proc = subprocess.run([sys.executable, "tools/submit_grid.py", "--archs", archs, "--scales", "debug", "--seeds",
                           seeds, "--gpus-per-node", "1", "--sweep", SWEEP, "--submit", "--", *FLAGS, *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return re.search(r"submitted array job (\d+)", proc.stdout).group(1)


@pytest.mark.slow
@pytest.mark.slurm
def test_sweep_through_slurm_is_collected(cluster, site, tmp_path):  # noqa: F811
    t0 = time.time()
    jobs = [submit(cluster, site, "transformer,satformer", "1,2"),
            submit(cluster, site, "transformer,satformer", "1,2", "--num-layers", "2"),
            submit(cluster, site, "transformer", "3", "--debug-inject-nan-at-step", "5", "--save-interval", "2"),
            submit(cluster, site, "satformer", "3", "--exit-interval", "3", env_extra=dict(MSAT_REQUEUE="0"))]
    env = cluster.env(site["env"])
    status = collect(site["runs"], "--sweep", SWEEP, "--status", env=env).stdout
    sweep = json.load(open(os.path.join(site["runs"], "_grid", f"{SWEEP}.json")))
    names = [e["run"] for a in sweep["arrays"] for e in a["entries"]]
    assert len(names) == 10 and all(n in status for n in names), status
    assert f"{jobs[0]}_0" in status, status  # each entry with its Slurm job (queued or running)
    for job in jobs:
        cluster.wait(job, timeout=900)
    print(f"sweep of 10 runs through Slurm: {time.time() - t0:.0f} s")

    out = tmp_path / "grid"
    log = collect(site["runs"], "--sweep", SWEEP, "--out", out, env=env).stderr
    assert "10 run(s): 8 complete, 1 failed, 1 stopped" in log, log
    rows = read_csv(out / "grid.csv")
    assert sorted(rows) == sorted(names)
    for name, row in rows.items():
        folder = os.path.join(site["runs"], name)
        assert row["path"] == folder and config(folder)["sweep"] == SWEEP
        if row["status"] != "complete":
            continue
        for key, value in expected_row(folder).items():
            assert same(row[key], value), (name, key, row[key], value)
        assert float(row["wall_hours"]) > 0 and row["slurm_job"].startswith(tuple(jobs))
    status = {(r["arch"], r["seed"]): r["status"] for r in rows.values() if r["seed"] == "3"}
    assert status == {("transformer", "3"): "failed", ("satformer", "3"): "stopped"}, status
    failed = next(r for r in rows.values() if r["status"] == "failed")
    assert "loss is nan" in failed["reason"] and failed["step"] == "4", failed
    assert {r["scale"] for r in rows.values()} == {"debug", "2x64"}
    # one validation set for the whole sweep: every run (both seeds, both archs) scored the same sequences
    assert len({config(os.path.join(site["runs"], n))["data_identity"]["validation_set_id"] for n in names}) == 1
    table = (out / "table.md").read_text()
    assert re.search(r"\| transformer \| [\d.]+ ± [\d.]+ \(2\) \| [\d.]+ ± [\d.]+ \(2\) \|", table), table
    assert "| satformer | " in table and "## Difference to the Transformer" in table
    assert "no fit: 2 scale(s): 3 or more are needed" in table
    assert re.search(r"\| \S+_s3\S* \| transformer \| debug \| 3 \| failed \| 4/6 \|", table), table
    assert re.search(r"\| \S+_s3\S* \| satformer \| debug \| 3 \| stopped \| 3/6 \|", table), table
    fits = json.load(open(out / "fits.json"))
    assert fits["fits"]["satformer"]["params"]["error"].startswith("2 scale(s)")
    for name in ("scaling", "wallclock", "efficiency"):
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


# ---------------------------------------------------------------------------------------------- local runs
@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """A debug run watched live (running), killed (failed), resumed and stopped at step 10 (1 restart)."""
    base = tmp_path_factory.mktemp("local")
    runs = base / "runs"
    d = runs / "live"
    flags = ["--recipe", "debug_transformer", "--train-iters", "2000", "--log-interval", "2", "--save-interval", "4",
             "--eval-interval", "4", "--no-progress-bar", "--save", d, "--load", d]
    proc = train_cli.start(*flags, log_path=base / "live.log")
    out = {}
    try:
        train_cli.wait_for(lambda: (train_cli.latest(d) or 0) >= 4, proc, "the first checkpoint", timeout=300)
        out["running"] = collect(runs, "--status").stdout
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out["killed"] = collect(runs, "--status").stdout
    out["killed_at"] = records(d)[-1]["wall_time_s"]
    train_cli.train(*flags, "--exit-interval", "10")
    return dict(out, base=base, runs=runs, run=d)


def _line(table, run):
    return next(line for line in table.splitlines() if line.startswith(run + " "))


@pytest.mark.slow  # the local_run fixture: a trainer run
def test_running_killed_and_resumed_run(local_run):
    running = _line(local_run["running"], "live")
    assert re.search(r"\brunning\s+\d+/2000\s+\d+m\d\ds\s+\d+\.\d{4}", running), local_run["running"]
    assert re.search(r"\bfailed\b", _line(local_run["killed"], "live")), local_run["killed"]
    recs, c = records(local_run["run"]), config(local_run["run"])
    end = recs[-1]
    start = c["attempts"][1]["start_step"]
    assert end["event"] == "end" and end["status"] == "stopped" and end["restarts"] == 1
    assert start >= 4 and end["step"] % 10 == 0 and start < end["step"] <= start + 10
    assert c["restarts"] == 1 and len(c["attempts"]) == 2
    assert c["wall_time_before_s"] >= local_run["killed_at"] and end["wall_time_s"] > c["wall_time_before_s"]
    assert all("mem_cpu_peak_rss_gib" in r for r in recs if "loss" in r)
    assert re.search(r"\bstopped\b", _line(collect(local_run["runs"], "--status").stdout, "live"))


@pytest.mark.slow  # the local_run fixture: a trainer run
def test_other_data_is_flagged_and_kept_apart(local_run, tmp_path):
    runs = tmp_path / "runs"
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        shutil.copytree(local_run["run"], runs / name, ignore=shutil.ignore_patterns("iter_*"))
        c = config(runs / name)
        c.update(seed=seed, train_iters=10)  # as if each had been a complete 10-step run
        if name == "c":
            c["data_identity"]["validation_set_id"] = "another-set"
        (runs / name / "config.json").write_text(json.dumps(c))
        recs = records(runs / name)
        recs[-1].update(status="complete")
        (runs / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "out"
    collect(runs, "--out", out)
    rows = read_csv(out / "grid.csv")
    assert rows["a"]["data_id"] == rows["b"]["data_id"] != rows["c"]["data_id"]
    table = (out / "table.md").read_text()
    assert "**Warning:** 1 complete run(s) used other data" in table and "mixed groups: transformer debug" in table
    assert re.search(r"\| transformer \| [\d.]+ ± [\d.]+ \(2\) \|", table), table  # a and b only
    assert "## Runs on other data (kept apart)" in table and "| c | transformer | debug | 3 |" in table
    assert table.splitlines()[1].startswith("3 run(s) collected") and " from ../runs; " in table.splitlines()[1]
    assert str(tmp_path) not in table  # the runs folder was given as an absolute path: named relative to --out


def test_tables_name_the_runs_folder_relative():
    """A published table never names the absolute path of the runs folder (docs/ladder/table_3seeds.md did)."""
    assert collect_lib.runs_named(["/tmp/sweep/runs", "runs", "./a/../runs2"], "/tmp/sweep/out/ladder") == \
        ["../../runs", "runs", "runs2"]
    for table in glob.glob(os.path.join(ROOT, "docs", "ladder", "*.md")):
        header = open(table).read().splitlines()[1]
        assert re.search(r" from [^/ ][^ ]*; status", header), (table, header)


@pytest.mark.slow  # the local_run fixture: a trainer run
def test_bad_input_exits_2_naming_the_file_and_writes_nothing(local_run, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    err = collect(empty, "--out", out, expect=2).stderr
    assert f"{empty}: no run folder" in err and not out.exists()
    runs = tmp_path / "runs"
    shutil.copytree(local_run["run"], runs / "r", ignore=shutil.ignore_patterns("iter_*"))
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    lines = (runs / "r" / "metrics.jsonl").read_text().splitlines(keepends=True)
    (runs / "r" / "metrics.jsonl").write_text("".join(lines[:2]) + "{not json\n" + "".join(lines[2:]))
    err = collect(runs, "--out", out, expect=2).stderr.strip()
    assert err.endswith(f"{runs / 'r' / 'metrics.jsonl'}: line 3 is not JSON: '{{not json'"), err
    assert len(err.splitlines()) <= 3 and "Traceback" not in err
    assert sorted(os.listdir(out)) == ["keep.txt"] and not list(tmp_path.glob(".collect_grid-*"))
    (runs / "r" / "metrics.jsonl").write_text("".join(lines) + '{"step": 11, "lo')  # a line being written: fine
    collect(runs, "--out", out)
    os.remove(runs / "r" / "config.json")
    err = collect(runs, "--out", tmp_path / "o2", expect=2).stderr
    assert f"{runs / 'r' / 'config.json'}: missing" in err and not (tmp_path / "o2").exists()
    err = collect(runs, "--out", runs / "summary", expect=2).stderr
    assert "lies inside RUNS_DIR" in err


@pytest.mark.slow  # the local_run fixture: a trainer run
def test_wandb_summary_run_and_the_trainers_group(local_run, tmp_path, monkeypatch):
    out = tmp_path / "out"
    log = collect(local_run["runs"], "--out", out, "--wandb", env=dict(os.environ, WANDB_MODE="offline")).stderr
    assert "wandb: offline summary run" in log, log
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    from megatron_sat.training.arguments import parse_args
    from megatron_sat.training.monitor import Monitor

    monkeypatch.setenv("MSAT_SWEEP", "sweep-x")
    args = parse_args(["--recipe", "debug_satformer", "--seed", "7", "--save", str(tmp_path / "run"),
                       "--wandb-project", "p", "--wandb-mode", "offline", "--no-progress-bar"])
    monitor = Monitor(args, dict(vars(args), num_parameters=1000, vocab_size=256), 0, resumed=False, is_logger=True)
    try:
        assert monitor.wandb.group == "sweep-x"
        assert (monitor.wandb.config["arch"], monitor.wandb.config["scale"], monitor.wandb.config["seed"]) == (
            "satformer", "debug", 7)
    finally:
        monitor.close()
    assert config(tmp_path / "run")["sweep"] == "sweep-x"


def _sbatch_trainer(cluster, folder, *flags, sbatch=()):  # noqa: F811
    """The trainer as a batch job of its own (no requeue: its final state stays Slurm's last word)."""
    cmd = [sys.executable, "-m", "megatron_sat.train", "--recipe", "debug_transformer", "--train-iters", "2000",
           "--log-interval", "2", "--save-interval", "4", "--eval-interval", "4", "--no-progress-bar",
           "--save", folder, "--load", folder, *flags]
    return cluster.sbatch(["--no-requeue", "--ntasks=1", "--cpus-per-task=1", f"--output={folder}.out", *sbatch,
                           "--wrap", "exec " + " ".join(shlex.quote(str(x)) for x in cmd)], cwd=ROOT,
                          env=train_cli.env())


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_final_states_of_a_timeout_a_cancel_and_a_dead_node(cluster, local_run, tmp_path,  # noqa: F811
                                                                  monkeypatch):
    runs = tmp_path / "runs"
    timeout_run, cancel_run, node_run = runs / "timeout", runs / "cancel", runs / "node"
    shutil.copytree(local_run["run"], timeout_run, ignore=shutil.ignore_patterns("wandb"))  # resumes from its save
    saved = train_cli.latest(timeout_run)
    t0 = time.time()
    # past its time limit while a save hangs: SIGTERM, then SIGKILL after KillWait, no end line
    timeout_job = _sbatch_trainer(cluster, timeout_run, "--debug-save-delay", "600", sbatch=["--time=1"])
    cancel_job = _sbatch_trainer(cluster, cancel_run)
    proc = subprocess.Popen(["sleep", "600"])  # wait_for's "process" (the jobs are Slurm's)
    try:
        train_cli.wait_for(lambda: (train_cli.latest(cancel_run) or 0) >= 4, proc, "the cancelled run's save",
                           timeout=300)
        cluster.run(["scancel", cancel_job])
        assert cluster.wait(cancel_job, timeout=120) == "CANCELLED"
        node_job = _sbatch_trainer(cluster, node_run)
        train_cli.wait_for(lambda: (train_cli.latest(node_run) or 0) >= 4, proc, "the node run's save", timeout=300)
        assert cluster.wait(timeout_job, timeout=300) == "TIMEOUT", open(f"{timeout_run}.out").read()[-3000:]
        # the node dies: its slurmd and the job's processes get SIGKILL; Slurm then declares it down (what it does
        # after SlurmdTimeout, here at once) and the job ends NODE_FAIL
        cluster.kill_node(cluster.node)
        cluster.run(["scontrol", "update", f"nodename={cluster.node}", "state=down", "reason=killed-by-test"])
        assert cluster.wait(node_job, timeout=120) == "NODE_FAIL"
    finally:
        proc.kill()
        proc.wait()
        if not any(n == "slurmd" for n in cluster.procs):
            cluster.start_node(cluster.node)
        cluster.run(["scontrol", "update", f"nodename={cluster.node}", "state=resume"], check=False)
        cluster._wait_for(cluster._node_idle, 120, "the node to come back")
    print(f"timeout, cancel and dead-node jobs: {time.time() - t0:.0f} s")

    env = cluster.env(dict(os.environ))
    status = collect(runs, "--status", env=env).stdout
    out = tmp_path / "grid"
    collect(runs, "--out", out, env=env)
    rows = read_csv(out / "grid.csv")
    t, c, n = rows["timeout"], rows["cancel"], rows["node"]
    assert (t["status"], t["slurm_state"], t["slurm_job"]) == ("failed", "TIMEOUT", timeout_job), t
    assert re.fullmatch(rf"TIMEOUT after 00:0[12]:\d\d \(limit 00:01:00\), exit code \d+:\d+; no save since step "
                        rf"{saved}", t["reason"]), t["reason"]
    assert t["saved_step"] == str(saved) and re.fullmatch(r"00:0[12]:\d\d", t["slurm_elapsed"])
    assert (c["status"], c["slurm_state"]) == ("stopped", "CANCELLED"), c
    assert re.search(r"SIGTERM.*; Slurm: CANCELLED by uid 0 after 00:0\d:\d\d, exit code \d+:\d+$", c["reason"]), c
    assert (n["status"], n["slurm_state"]) == ("failed", "NODE_FAIL"), n
    assert re.fullmatch(rf"NODE_FAIL after 00:0\d:\d\d, exit code \d+:\d+; no save since step {n['saved_step']}",
                        n["reason"]), n["reason"]
    for name, row in rows.items():
        line = _line(status, name)
        assert row["slurm_state"] in line and row["reason"] in line, status

    # array tasks cancelled before they started: sacct lists them only under the array's id, as one range
    from megatron_sat.sweep import slurm

    held = cluster.sbatch(["--hold", "--array=0-2", "--wrap", "true"], cwd=str(tmp_path))
    cluster.run(["scancel", held])
    monkeypatch.setenv("SLURM_CONF", cluster.conf)
    deadline = time.time() + 60
    while True:  # slurmctld hands the records to slurmdbd a moment later
        states, note = slurm.sacct_states([f"{held}_2", timeout_job])
        if f"{held}_2" in states or time.time() > deadline:
            break
        time.sleep(1)
    assert note is None and states[f"{held}_2"]["state"] == "CANCELLED", states
    assert states[timeout_job]["state"] == "TIMEOUT" and states[timeout_job]["timelimit"] == "00:01:00", states

    # a Slurm without accounting: the same runs, and --status says what it cannot know
    plain = tmp_path / "slurm.conf"
    plain.write_text(re.sub(r"^AccountingStorage\w+=.*\n", "", open(cluster.conf).read(), flags=re.M))
    status = collect(runs, "--status", env=dict(env, SLURM_CONF=str(plain))).stdout
    assert "Slurm accounting not available (sacct: " in status, status
    assert "no end line and no process" in _line(status, "timeout") and "TIMEOUT" not in status, status


# ---------------------------------------------------------------------------------------------- fits, data
def test_fit_recovers_known_law_and_compute_multiplier():
    import numpy as np

    from megatron_sat.analysis import scaling

    n = np.array([1e6, 3e6, 1e7, 3e7, 1e8])
    fit = scaling.fit_power_law(n, 1.8 + 400.0 * n ** -0.34)
    assert (fit["E"], fit["A"], fit["alpha"]) == pytest.approx((1.8, 400.0, 0.34), rel=1e-6)
    with pytest.raises(scaling.FitError, match="2 scale"):
        scaling.fit_power_law(n[:2], [3.0, 2.9])
    rng = np.random.default_rng(0)  # seeds scattered around the law: the bootstrap brackets the truth
    points = {x: list(1.8 + 400.0 * x ** -0.34 + rng.normal(0, 0.005, 3)) for x in n}
    noisy = scaling.fit_with_bootstrap(points, samples=200)
    assert abs(noisy["alpha"] - 0.34) < 3 * noisy["bootstrap"]["alpha"]["sd"] + 1e-3
    # an arch that is a Transformer with 3x the compute: multiplier 3 at every compute, from the fits and measured
    c = np.geomspace(1e15, 1e19, 4)
    ref = scaling.fit_power_law(c, 2.0 + 50.0 * c ** -0.1)
    arch = scaling.fit_power_law(c, 2.0 + 50.0 * (3 * c) ** -0.1)
    assert [scaling.multiplier_from_fits(arch, ref, x) for x in c] == pytest.approx([3.0] * 4, rel=1e-6)
    measured = [scaling.multiplier_measured(list(zip(c, 50.0 * c ** -0.1)), 50.0 * (3 * x) ** -0.1, x)
                for x in c[:3]]  # a pure power law is a straight line in log-log: interpolation is exact
    assert [m for m, _ in measured] == pytest.approx([3.0] * 3, rel=1e-9) and not any(e for _, e in measured)


def test_fits_are_of_the_mean_over_seeds_whose_losses_differ():
    """Two seeds per scale on either side of a known law by offsets that change from scale to scale: the fit of the
    means recovers the law exactly, the fit of either seed alone does not (so fitting one seed instead of the mean
    fails), through scaling.fit_with_bootstrap and through grid_table.summarize."""
    import numpy as np

    from megatron_sat.analysis import grid_table, scaling

    law = (1.8, 400.0, 0.34)
    n = np.array([1e6, 3e6, 1e7, 3e7, 1e8])
    offsets = np.array([0.08, -0.05, 0.10, -0.07, 0.06])
    truth = law[0] + law[1] * n ** -law[2]
    points = {float(x): [t + d, t - d] for x, t, d in zip(n, truth, offsets)}
    fit = scaling.fit_with_bootstrap(points, samples=50)
    assert (fit["E"], fit["A"], fit["alpha"]) == pytest.approx(law, rel=1e-5), fit
    for seed in (0, 1):  # each seed alone is far from the law: the test above tells the mean from one seed
        alone = scaling.fit_power_law(n, [points[float(x)][seed] for x in n])
        assert abs(alone["alpha"] - law[2]) > 0.01 or abs(alone["E"] - law[0]) > 0.01, alone
    assert fit["seeds"] == {str(float(x)): 2 for x in n} and fit["bootstrap"]["alpha"]["sd"] > 0
    rows = _synthetic_rows({("transformer", f"s{int(x)}"): points[float(x)] for x in n})
    summary = grid_table.summarize(rows, fit_params="params", bootstrap=0)
    fitted = summary["fits"]["transformer"]["params"]
    assert (fitted["E"], fitted["A"], fitted["alpha"]) == pytest.approx(law, rel=1e-5), fitted
    assert [summary["cells"]["transformer"][f"s{int(x)}"]["mean"] for x in n] == pytest.approx(truth, rel=1e-12)


def _synthetic_rows(losses: dict, flops: dict = None) -> list:
    """Grid rows of complete runs: {(arch, scale): [final loss per seed]} (scale names sort by their size)."""
    rows = []
    for (arch, scale), values in losses.items():
        size = float(scale.lstrip("s"))
        for seed, loss in enumerate(values, start=1):
            rows.append(dict(run=f"{arch}_{scale}_s{seed}", arch=arch, scale=scale, seed=seed, status="complete",
                             final_val_loss=float(loss), data_id="d", data_identity={}, params=size,
                             non_embedding_params=size, train_flops=(flops or {}).get(scale)))
    return rows


def test_difference_intervals_cover_at_their_rate_and_a_zero_difference_is_not_marked():
    """200 simulated sweeps (3 seeds; transformer, resformer, satformer at 2 scales) with known offsets and known,
    unequal seed noise: each 95 % Welch interval covers its true difference in 90-99 % of the sweeps (binomial
    sd at 200: 1.5 %), a zero difference is marked in about 5 %, a large one nearly always."""
    import numpy as np

    from megatron_sat.analysis import grid_table

    truth = {("transformer", "s1"): 3.00, ("resformer", "s1"): 2.98, ("satformer", "s1"): 2.96,
             ("transformer", "s2"): 2.80, ("resformer", "s2"): 2.80, ("satformer", "s2"): 2.79}
    noise = {"transformer": 0.010, "resformer": 0.015, "satformer": 0.005}
    rng = np.random.default_rng(26)
    covered, marked, sweeps = {}, {}, 200
    for _ in range(sweeps):
        rows = _synthetic_rows({k: mu + rng.normal(0.0, noise[k[0]], 3) for k, mu in truth.items()})
        summary = grid_table.summarize(rows, fit_params="params", bootstrap=0)
        for ref, per_arch in summary["differences"].items():
            for arch, per_scale in per_arch.items():
                for scale, d in per_scale.items():
                    key = (ref, arch, scale)
                    true = truth[(arch, scale)] - truth[(ref, scale)]
                    covered[key] = covered.get(key, 0) + (d["low"] <= true <= d["high"])
                    marked[key] = marked.get(key, 0) + bool(d["significant"])
    rates = {k: v / sweeps for k, v in covered.items()}
    print("coverage of the 95 % Welch intervals over 200 sweeps:",
          ", ".join(f"{a}-{r} {sc}: {v:.3f}" for (r, a, sc), v in sorted(rates.items())))
    assert len(rates) == 8 and all(0.90 <= v <= 0.99 for v in rates.values()), rates
    assert 0.93 <= sum(covered.values()) / (8 * sweeps) <= 0.97  # all 1600 (correlated) intervals together
    zero = [("transformer", "resformer", "s2"), ("resformer", "transformer", "s2")]
    assert all(marked[k] / sweeps <= 0.10 for k in zero), marked  # true difference 0: marked ~5 % of the time
    assert marked[("transformer", "satformer", "s1")] / sweeps >= 0.9, marked  # -0.04, 4x the noise: found

    # one sweep in the table: equal archs are not marked, a clear difference is, one seed gets no interval
    rows = _synthetic_rows({("transformer", "s1"): [3.00, 3.02, 2.98], ("resformer", "s1"): [3.01, 2.99, 3.00],
                            ("satformer", "s1"): [2.90, 2.91, 2.89], ("satformer", "s2"): [2.7],
                            ("transformer", "s2"): [2.80, 2.81]})
    summary = grid_table.summarize(rows, fit_params="params", bootstrap=0)
    same = summary["differences"]["transformer"]["resformer"]["s1"]
    assert same["diff"] == pytest.approx(0.0, abs=1e-12) and same["low"] < 0 < same["high"] and not same["significant"]
    assert summary["differences"]["transformer"]["satformer"]["s1"]["significant"]
    table = grid_table.markdown(summary, "synthetic")
    assert re.search(r"\| resformer \| \+0\.0000 \[-0\.\d{4}, \+0\.\d{4}\] \| -", table), table
    assert re.search(r"\| satformer \| -0\.1000 \[-0\.\d{4}, -0\.\d{4}\] \*\*\\\*\*\* \| -0\.1050 \(n=1/2\)", table), table


def test_difference_intervals_are_welchs_under_unequal_noise_and_seed_counts():
    """Unequal seed noise AND unequal seed counts (3 noisy seeds against 12 quiet ones), where Welch's degrees of
    freedom (~2) and Student's pooled ones (13) disagree: the interval equals scipy's Welch interval
    (ttest_ind(equal_var=False)) and covers the true difference in 93-97 % of 1500 draws (binomial sd 0.56 %);
    a pooled-variance interval covers 58 % of the same draws, Welch's standard error with the pooled df 84 %."""
    import numpy as np
    from scipy import stats

    from megatron_sat.analysis import grid_table

    rng = np.random.default_rng(39)
    true, draws, covered = -0.2, 1500, 0
    for i in range(draws):
        a, b = 2.8 + rng.normal(0.0, 0.1, 3), 3.0 + rng.normal(0.0, 0.005, 12)
        d = grid_table.difference(list(a), list(b))
        covered += d["low"] <= true <= d["high"]
        if i < 5:  # the library's Welch interval, to rounding
            welch = stats.ttest_ind(a, b, equal_var=False)
            ci = welch.confidence_interval(0.95)
            assert (d["low"], d["high"], d["df"]) == pytest.approx((ci.low, ci.high, welch.df), rel=1e-9, abs=1e-12)
            assert 2.0 <= d["df"] < 4.0 and d["significant"] == (d["high"] < 0 or d["low"] > 0)
    print(f"Welch interval, 3 vs 12 seeds, noise 0.1 vs 0.005: coverage {covered / draws:.4f} over {draws} draws")
    assert 0.93 <= covered / draws <= 0.97
    # docs/sweeps_operations.md: no interval where a side has one seed; two seeds a side give one
    one = grid_table.difference([2.9], [3.0, 3.1, 3.05])
    assert one["diff"] == pytest.approx(-0.15) and (one["low"], one["high"], one["significant"]) == (None, None, None)
    two = grid_table.difference([2.9, 2.92], [3.0, 3.1])
    assert two["low"] < two["diff"] < two["high"] and two["df"] == pytest.approx(6.76 / 6.26, rel=1e-9)


def test_multiplier_interval_from_the_seed_bootstrap_of_the_fits():
    """An arch that is a Transformer given 3x the compute, seeds with small noise at 4 scales: the fitted multiplier
    is near 3 and its bootstrap interval holds 3; the table shows the interval."""
    import numpy as np

    from megatron_sat.analysis import grid_table

    rng = np.random.default_rng(0)
    flops = {f"s{i}": c for i, c in enumerate(np.geomspace(1e15, 1e18, 4).tolist(), start=1)}
    law = lambda c: 2.0 + 50.0 * c ** -0.1  # noqa: E731
    losses = {}
    for scale, c in flops.items():
        losses[("transformer", scale)] = law(c) + rng.normal(0, 0.003, 3)
        losses[("satformer", scale)] = law(3 * c) + rng.normal(0, 0.003, 3)
    summary = grid_table.summarize(_synthetic_rows(losses, flops), fit_params="params", bootstrap=200)
    m = summary["multiplier"]["satformer"]
    for scale in flops:
        low, high = m["from_fits_interval"][scale]
        assert low < m["from_fits"][scale] < high and low <= 3.0 <= high, (scale, low, m["from_fits"][scale], high)
    table = grid_table.markdown(summary, "synthetic")
    assert re.search(r"\| satformer \| fits \| \d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\] \|", table), table


def test_validation_samples_do_not_depend_on_the_seed():
    import torch

    from megatron_sat.data import build_datasets
    from megatron_sat.data.tokenizer import NullTokenizer
    from megatron_sat.training.data import VALIDATION_SEED, validation_set_id

    def build(seed, valid_seed=VALIDATION_SEED):
        return build_datasets(None, NullTokenizer(512), seq_length=16, num_samples=(64, 16, 0), seed=seed,
                              valid_seed=valid_seed, mock=True)

    one, two = build(1), build(2)
    assert all(torch.equal(one.valid[i]["tokens"], two.valid[i]["tokens"]) for i in range(16))
    assert validation_set_id(one.valid, 16) == validation_set_id(two.valid, 16)
    assert not all(torch.equal(one.train[i]["tokens"], two.train[i]["tokens"]) for i in range(16))
    old_one, old_two = build(1, None), build(2, None)  # before: the seed also drew the validation samples
    assert validation_set_id(old_one.valid, 16) != validation_set_id(old_two.valid, 16)
    assert all(torch.equal(one.train[i]["tokens"], old_one.train[i]["tokens"]) for i in range(16))  # order kept


def test_ladder_recipes_grow_and_share_everything_else():
    import recipes

    for arch in ("transformer", "resformer", "satformer"):
        ladder = [recipes.get(f"{arch}_ladder{i}") for i in (1, 2, 3)]
        assert [r["hidden_size"] for r in ladder] == [64, 128, 192] and [r["num_layers"] for r in ladder] == [2, 3, 4]
        same = ("train_iters", "global_batch_size", "seq_length", "embedded_data", "vocab_size", "eval_iters", "split")
        assert all({k: r[k] for k in same} == {k: ladder[0][k] for k in same} for r in ladder)
        assert all(r["arch"] == arch and r["hidden_size"] // r["num_attention_heads"] == 32 for r in ladder)


@pytest.mark.slow  # the local_run fixture: a trainer run
def test_eval_scores_become_columns_and_suite_tables(local_run, tmp_path):
    """A tools/evaluate.py results.json inside a run folder (written by evaluation.write_results from lm-eval's
    result layout) gives one column per task and the suite tables."""
    from megatron_sat.analysis.evaluation import results_table, suite_averages, write_results

    runs = tmp_path / "runs"
    shutil.copytree(local_run["run"], runs / "r", ignore=shutil.ignore_patterns("iter_*"))
    c = config(runs / "r")
    c["train_iters"] = records(runs / "r")[-1]["step"]
    (runs / "r" / "config.json").write_text(json.dumps(c))  # as if it were complete
    recs = records(runs / "r")
    recs[-1]["status"] = "complete"
    (runs / "r" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    results = {"swde": {"contains,none": 0.25, "contains_stderr,none": 0.01},
               "fda": {"contains,none": 0.75}, "piqa": {"acc,none": 0.6, "acc_norm,none": 0.625}}
    table = results_table(results)
    write_results(dict(model="hf/r", tasks=list(results), skipped=[], table=table,
                       averages=suite_averages(table, list(results)), results=results), str(runs / "r" / "eval"))
    out = tmp_path / "out"
    collect(runs, "--out", out)
    row = read_csv(out / "grid.csv")["r"]
    assert (row["eval:swde"], row["eval:fda"], row["eval:piqa"]) == ("0.25", "0.75", "0.625")  # piqa: acc_norm
    assert (row["eval_avg:retrieval"], row["eval_avg:zeroshot"]) == ("0.5", "0.625")
    md = (out / "table.md").read_text()
    assert "## Evaluation: retrieval suite" in md and "| transformer | debug | 0.5000 | 0.2500 | 0.7500 |" in md, md
    assert "## Evaluation: zeroshot suite" in md and "| transformer | debug | 0.6250 | 0.6250 |" in md, md
