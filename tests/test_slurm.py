"""The project's Slurm scripts on a real Slurm: a private single-node cluster (tests/slurm_cluster.py: Debian's
munge, slurmctld, slurmd, installed by `make slurm`) running the real trainer on CPU (gloo, 2 tasks).

    .venv/bin/python -m pytest -q -ra tests/test_slurm.py          # about 3-4 minutes on 2 cores

  * the cluster is stopped cleanly even with a job still running (its own small cluster);
  * slurm/train.sbatch runs debug_satformer with srun -n 2 -> COMPLETED, the loss falls, a checkpoint exists;
  * tools/submit_grid.py --submit runs a 2-entry job array (debug_transformer, debug_resformer) -> both finish;
  * preemption: USR1 to the batch shell (what --signal=B:USR1@180 sends before the time limit) after the job has
    saved -> the trainer checkpoints, the job requeues itself, resumes and finishes with the losses of an
    uninterrupted run;
  * a hung rank (SIGSTOP): the watchdog stops the job (exit 75), launch.sh requeues it, it resumes exactly;
  * sweep entries longer than their recipe (a --config file's train-iters, --train-samples), requeued past the
    recipe's step count, run to their own length (launch.sh's TRAIN_ITERS is the trainer's).
Skipped (with the reason, naming `make slurm`) only when Slurm is not installed; in CI (.ci/run sets
MSAT_REQUIRE_SLURM=1 after `make slurm`) a missing Slurm fails instead.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import train_cli
from slurm_cluster import SlurmCluster, SlurmUnavailable, rank_process

pytestmark = [pytest.mark.slow, pytest.mark.slurm]  # a local Slurm running the trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(cluster: SlurmCluster) -> SlurmCluster:
    try:
        return cluster.start()
    except SlurmUnavailable as e:
        pytest.skip(f"no Slurm: {e}")


@pytest.fixture(scope="module")
def cluster():
    c = SlurmCluster()
    _start(c)
    try:
        yield c
    finally:
        c.stop()


def run_dir(site, recipe, *flags) -> str:
    """The run folder slurm/launch.sh derives (through the same tools/submit_grid.py --resolve)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "submit_grid.py"), "--resolve", recipe, "--",
                          *flags], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    name = re.search(r"^RUN_NAME=(\S+)$", out, re.M).group(1).strip("'")
    return os.path.join(site["runs"], name)


def metrics(folder):
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tracker(folder):
    path = os.path.join(folder, "latest_checkpointed_iteration.txt")
    return int(open(path).read()) if os.path.isfile(path) else None


def read(path):
    return open(path, errors="replace").read() if os.path.isfile(path) else f"<no file {path}>"


def sbatch_train(cluster, site, name, recipe, *flags):
    return cluster.sbatch(["--ntasks=2", "--cpus-per-task=1", "--time=15", f"--job-name={name}",
                           f"--output={site['logs']}/%x-%j.out", "slurm/train.sbatch", recipe, *flags],
                          cwd=ROOT, env=site["env"])


def test_cluster_stops_cleanly_with_a_running_job():
    c = _start(SlurmCluster())
    try:
        job = c.sbatch(["--ntasks=1", "--output=/dev/null", "--wrap", "srun sleep 300"], cwd="/tmp")
        deadline = time.time() + 120
        while not (c.states(job) == ["RUNNING"] and c._stepd_pids()) and time.time() < deadline:
            time.sleep(0.3)
        assert c.states(job) == ["RUNNING"] and c._stepd_pids(), (c.states(job), c.tail_logs())
        procs = list(c.procs.values())
        root = c.root
    finally:
        c.stop()
    assert all(p.poll() is not None for p in procs), "daemons still running"
    deadline = time.time() + 15
    while c._stepd_pids() and time.time() < deadline:  # SIGKILLed job steps vanish
        time.sleep(0.2)
    assert not c._stepd_pids(), "slurmstepd left behind"
    assert not os.path.exists(root)


def test_train_sbatch_debug_recipe(cluster, site):
    job = sbatch_train(cluster, site, "msat-debug", "debug_satformer", "--train-iters", "20")
    state = cluster.wait(job, timeout=600)
    log = read(f"{site['logs']}/msat-debug-{job}.out")
    assert state == "COMPLETED", log
    folder = run_dir(site, "debug_satformer", "--train-iters", "20")
    losses = [m["loss"] for m in metrics(folder) if "loss" in m]
    assert len(losses) >= 2 and losses[-1] < losses[0], (losses, log)
    assert tracker(folder) == 20 and os.path.isdir(os.path.join(folder, "iter_0000020")), log
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["world_size"] == 2 and config["arch"] == "satformer"
    assert "run complete (20/20 steps)" in log and "srun" in log


def test_submit_grid_job_array(cluster, site):
    proc = subprocess.run([sys.executable, "tools/submit_grid.py", "--archs", "transformer,resformer", "--scales",
                           "debug", "--submit", "--", "--train-iters", "10"],
                          cwd=ROOT, env=cluster.env(site["env"]), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "debug_transformer" in proc.stdout and "debug_resformer" in proc.stdout  # the table
    job = re.search(r"submitted array job (\d+): 2 task", proc.stdout).group(1)
    state = cluster.wait(job, timeout=900)
    logs = [read(f"{site['logs']}/msat-debug-{job}_{i}.out") for i in (0, 1)]
    assert state == "COMPLETED", "\n".join(logs)
    assert len(cluster.states(job)) == 2
    for arch, log in zip(("transformer", "resformer"), logs):
        folder = run_dir(site, f"debug_{arch}", "--train-iters", "10", "--seed", "1234")
        assert tracker(folder) == 10, log
        assert json.load(open(os.path.join(folder, "config.json")))["arch"] == arch


def test_preempted_job_requeues_and_resumes(cluster, site, tmp_path):
    """USR1 after the job has saved (the moment that used to kill it): one more save, requeue, resume; the
    losses equal an uninterrupted run of the same 2-rank layout, exactly."""
    iters = 150
    flags = ("--train-iters", str(iters), "--log-interval", "1", "--save-interval", "25", "--eval-interval", "1000")
    folder = run_dir(site, "debug_transformer", *flags)
    job = sbatch_train(cluster, site, "msat-preempt", "debug_transformer", *flags)
    log_path = f"{site['logs']}/msat-preempt-{job}.out"
    deadline = time.time() + 300
    while time.time() < deadline:  # wait until a checkpoint exists and training has gone on past it
        steps = [m["step"] for m in metrics(folder) if "loss" in m]
        if (tracker(folder) or 0) >= 25 and steps and steps[-1] >= 30:
            break
        assert cluster.states(job)[0] in ("PENDING", "RUNNING"), read(log_path)
        time.sleep(0.2)
    else:
        pytest.fail(f"training did not reach its first checkpoint:\n{read(log_path)}")
    # what Slurm sends 180 s before the time limit (#SBATCH --signal=B:USR1@180); the batch shell forwards it
    # to every rank with scancel --signal=USR1
    cluster.signal_batch(job, "USR1")
    state = cluster.wait(job, timeout=900)
    log = read(log_path)
    assert state == "COMPLETED", log
    assert int(cluster.job(job)[0]["Restarts"]) == 1, log
    assert "BrokenPipeError" not in log and "not requeueing" not in log, log
    stopped = int(re.search(r"stopped at checkpoint (\d+)/", log).group(1))
    assert 30 <= stopped < iters, log
    assert f"requeueing job {job} to continue from step {stopped}" in log
    assert re.search(rf"resumed from \S+iter_{stopped:07d} \(iteration {stopped}", log), log
    assert f"run complete ({iters}/{iters} steps)" in log
    assert tracker(folder) == iters and os.path.isdir(os.path.join(folder, f"iter_{stopped:07d}"))
    train = {m["step"]: m["loss"] for m in metrics(folder) if "loss" in m}
    assert sorted(train) == list(range(1, iters + 1)), sorted(train)
    straight = tmp_path / "straight"
    train_cli.train("--recipe", "debug_transformer", *flags, "--save", straight, "--no-progress-bar", nproc=2)
    ref = {m["step"]: m["loss"] for m in metrics(straight) if "loss" in m}
    assert train == ref, [s for s in ref if train.get(s) != ref[s]][:5]



def test_a_sweep_requeued_past_the_recipes_steps_runs_to_its_own(cluster, site, tmp_path):
    """A submit_grid sweep entry whose length is not the recipe's (20 steps): a --config file with train-iters 150,
    and --train-samples 1200 (150 steps of 8). USR1 after a save past step 20 requeues it; at the restart
    slurm/launch.sh reads the trainer's own length (submit_grid --resolve), so the run goes on to 150 and ends
    COMPLETED (it used to stop there as "complete": TRAIN_ITERS was the recipe's 20). Both sweeps on one cluster."""
    config = tmp_path / "long.yaml"
    config.write_text("train-iters: 150\n")
    # --lr 0.002: at the recipe's rate, train-iters 150 from the file names the preempted test's run (a run name
    # hashes resolved values, and the save and log intervals name nothing), which is complete: nothing to do
    common = ["--lr", "0.002", "--save-interval", "25", "--log-interval", "1", "--eval-interval", "1000"]
    entries = {"config": ["--config", str(config), *common], "samples": ["--train-samples", "1200", *common]}
    jobs = {}
    for key, flags in entries.items():  # one sweep at a time: the second must not finish while the first is watched
        proc = subprocess.run([sys.executable, "tools/submit_grid.py", "--archs", "transformer", "--scales", "debug",
                               "--sweep", f"long-{key}", "--submit", "--", *flags],
                              cwd=ROOT, env=cluster.env(site["env"]), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "_it150_" in proc.stdout, proc.stdout  # the table names the run by its own length
        job = jobs[key] = re.search(r"submitted array job (\d+): 1 task", proc.stdout).group(1)
        folder = run_dir(site, "debug_transformer", *flags, "--seed", "1234")
        assert tracker(folder) is None, f"{folder} was trained by another test: give this one other flags"
        log_path = f"{site['logs']}/msat-debug-{job}_0.out"
        deadline = time.time() + 600
        while time.time() < deadline:  # a checkpoint past the recipe's 20 steps, and training gone on
            steps = [m["step"] for m in metrics(folder) if "loss" in m]
            if (tracker(folder) or 0) >= 25 and steps and steps[-1] >= 30:
                break
            assert cluster.states(job)[0] in ("PENDING", "RUNNING"), read(log_path)
            time.sleep(0.2)
        else:
            pytest.fail(f"{key}: training did not pass step 25:\n{read(log_path)}")
        cluster.signal_batch(job, "USR1")
    for key, flags in entries.items():
        job, folder = jobs[key], run_dir(site, "debug_transformer", *flags, "--seed", "1234")
        state = cluster.wait(job, timeout=900)
        log = read(f"{site['logs']}/msat-debug-{job}_0.out")
        assert state == "COMPLETED", log
        stopped = int(re.search(r"stopped at checkpoint (\d+)/150", log).group(1))
        assert 25 <= stopped < 150 and f"to continue from step {stopped}" in log, log
        assert f"run {folder} from step {stopped} of 150" in log and "nothing to do" not in log, log
        assert "run complete (150/150 steps)" in log and tracker(folder) == 150, log
        assert sorted(m["step"] for m in metrics(folder) if "loss" in m) == list(range(1, 151))


def test_a_hung_rank_is_requeued_and_resumes(cluster, site):
    """One rank of a 2-task job SIGSTOPped: the other rank's watchdog names it within --hang-timeout-minutes and
    exits 75, slurm/launch.sh requeues the job, which resumes from the last checkpoint and repeats the losses."""
    iters = 40
    flags = ("--train-iters", str(iters), "--log-interval", "1", "--save-interval", "5", "--eval-interval", "1000",
             "--hang-timeout-minutes", "0.25")
    folder = run_dir(site, "debug_transformer", *flags)
    job = sbatch_train(cluster, site, "msat-hang", "debug_transformer", *flags)
    log_path = f"{site['logs']}/msat-hang-{job}.out"
    deadline = time.time() + 300
    while time.time() < deadline:
        steps = [m["step"] for m in metrics(folder) if "loss" in m]
        # just past a save (step 11, 16, ...): the steps the stop loses are then repeated after the resume (stopped
        # on a save, with nothing logged past it, the loss check below would have nothing to compare; CI saw that)
        if (tracker(folder) or 0) >= 5 and steps and steps[-1] >= 8 and steps[-1] % 5 in (1, 2):
            break
        assert cluster.states(job)[0] in ("PENDING", "RUNNING"), read(log_path)
        time.sleep(0.05)
    else:
        pytest.fail(f"training did not reach step 8:\n{read(log_path)}")
    rank1 = rank_process(folder, 1)
    assert rank1 is not None, "rank 1's process not found"
    rank1.suspend()  # SIGSTOP
    deadline = time.time() + 120
    while "the hang watchdog stopped the job" not in read(log_path):
        assert time.time() < deadline, read(log_path)
        time.sleep(0.1)
    first = {m["step"]: m["loss"] for m in metrics(folder) if "loss" in m}
    stopped = tracker(folder)
    state = cluster.wait(job, timeout=900)
    log = read(log_path)
    assert state == "COMPLETED", log
    assert int(cluster.job(job)[0]["Restarts"]) == 1, log
    assert "rank 1 stopped responding" in log and "NOT RESPONDING" in log, log
    assert f"requeueing job {job} to resume from step {stopped}" in log, log
    assert re.search(rf"resumed from \S+iter_{stopped:07d} \(iteration {stopped}", log), log
    assert tracker(folder) == iters
    again = {m["step"]: m["loss"] for m in metrics(folder) if "loss" in m}
    repeated = [s for s in first if s > stopped]
    assert repeated and all(again[s] == first[s] for s in repeated), [(s, first[s], again[s]) for s in repeated]


def test_profile_sbatch(cluster, site):
    """slurm/profile.sbatch -> tools/profile_throughput.py inside the job (2 tasks, every arch in one launch)."""
    job = cluster.sbatch(["--ntasks=2", "--cpus-per-task=1", "--time=15", f"--output={site['logs']}/%x-%j.out",
                          "slurm/profile.sbatch", "debug_satformer", "--steps", "1", "--warmup", "1"],
                         cwd=ROOT, env=site["env"])
    state = cluster.wait(job, timeout=600)
    log = read(f"{site['logs']}/msat-profile-{job}.out")
    assert state == "COMPLETED", log
    result = json.load(open(os.path.join(site["runs"], "profile", f"debug_satformer-{job}", "throughput.json")))
    assert "satformer" in json.dumps(result) and "transformer" in json.dumps(result)


def test_preprocess_array_and_merge(cluster, site, tmp_path):
    """slurm/preprocess.sbatch as a 2-task array over 4 FineWeb-style shards (3 parquet, 1 jsonl.gz): one dataset
    per shard; tools/merge_datasets.py joins them into the bytes of one-process preprocessing; an unfinished shard
    stops the merge (named) and a rerun of its task redoes only that shard."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_sat.data import (
        default_corpus_documents,
        merge_datasets,
        preprocess,
        preprocess_shards,
        shard_prefixes,
        train_bpe_tokenizer,
    )

    texts = [t for _, t in default_corpus_documents(("topics",))[:24]]
    src = tmp_path / "fineweb" / "data" / "CC-MAIN-2024-10"
    src.mkdir(parents=True)
    for i in range(3):
        pq.write_table(pa.table({"text": texts[6 * i:6 * i + 6], "url": [f"u{j}" for j in range(6)]}),
                       str(src / f"00{i}_00000.parquet"), row_group_size=4)
    (src / "003_00000.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n"
                                                                   for t in texts[18:]).encode()))
    tok = str(tmp_path / "tok")
    train_bpe_tokenizer([str(src / "000_00000.parquet")], 300, tok)
    shards = str(tmp_path / "shards")
    job = cluster.sbatch(["--array=0-1", "--cpus-per-task=1", "--time=15", f"--output={site['logs']}/%x-%A_%a.out",
                          "slurm/preprocess.sbatch", shards, "--input", str(tmp_path / "fineweb"), "--tokenizer", tok],
                         cwd=ROOT, env=site["env"])
    state = cluster.wait(job, timeout=600)
    logs = "\n".join(read(f"{site['logs']}/msat-preprocess-{job}_{i}.out") for i in (0, 1))
    assert state == "COMPLETED" and len(cluster.states(job)) == 2, logs
    assert "task 0 of 2: inputs 0..1 of 4" in logs and "task 1 of 2: inputs 2..3 of 4" in logs, logs
    names = json.load(open(os.path.join(shards, "shards.json")))["shards"]
    assert names == ["00000_000_00000", "00001_001_00000", "00002_002_00000", "00003_003_00000"]
    single = str(tmp_path / "single")
    preprocess([str(src)], tok, single, progress=False)
    tool = [sys.executable, os.path.join(ROOT, "tools", "merge_datasets.py"), "--shard-dir", shards]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")

    ok = subprocess.run(tool + ["--output-prefix", str(tmp_path / "merged"), "--blend-file", str(tmp_path / "blend.txt")],
                        capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr
    for ext in (".bin", ".idx"):
        assert open(single + ext, "rb").read() == open(str(tmp_path / "merged") + ext, "rb").read(), ext
    blend = open(tmp_path / "blend.txt").read().split()
    assert blend[1::2] == [os.path.join(shards, n) for n in names] and all(int(w) > 0 for w in blend[0::2])
    # shard 1 unfinished (its .meta.json is written last): the merge refuses naming it; task 0 rerun (what a
    # requeue or a resubmission of the array runs) redoes only that shard
    os.remove(os.path.join(shards, names[1] + ".meta.json"))
    with pytest.raises(SystemExit, match=rf"1 of 4 shards in \S+ are not finished \({names[1]}\)"):
        shard_prefixes(shards)
    before = os.path.getmtime(os.path.join(shards, names[0] + ".bin"))
    said = []
    preprocess_shards([str(tmp_path / "fineweb")], tok, shards, task=0, num_tasks=2, progress=False,
                      log=lambda *a, **k: said.append(" ".join(map(str, a))))
    assert f"preprocess_data: {names[0]} already done, skipped" in said and names[1] in said[-1], said
    assert os.path.getmtime(os.path.join(shards, names[0] + ".bin")) == before
    merge_datasets(shard_prefixes(shards), str(tmp_path / "merged2"))
    assert open(single + ".bin", "rb").read() == open(str(tmp_path / "merged2") + ".bin", "rb").read()
