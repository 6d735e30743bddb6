"""Multi-node Slurm jobs on one machine: a private cluster of two Slurm nodes, n1 and n2 (tests/slurm_cluster.py,
nodes=2: both at 127.0.0.1, a slurmd each), running the real trainer on CPU over gloo.

    .venv/bin/python -m pytest -q -ra tests/test_slurm_multinode.py        # a few minutes on 2 cores

  * slurm/train.sbatch with --nodes 2 --ntasks-per-node 2 and TP2 x PP2 (one pipeline stage per node): the
    rendezvous address comes from n1's NodeAddr (n1 resolves nowhere); USR1 after a save -> the job saves,
    requeues itself and resumes on the two nodes; its losses equal the same layout's on one node (torchrun,
    uninterrupted) exactly, and one rank's within 1e-5 (TP sums in another order);
  * n2 dies during a step (its slurmd and its ranks killed): the job ends instead of hanging; with n2 back, the
    requeued job resumes from the last complete checkpoint and finishes;
  * tools/submit_grid.py submits an array whose entries take two nodes each.
What waits for a real cluster: NCCL and InfiniBand, real time limits, nodes that are really apart.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import train_cli
from slurm_cluster import SlurmCluster
from test_slurm import _start, read, run_dir

pytestmark = [pytest.mark.slow, pytest.mark.slurm]  # a local two-node Slurm running the trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ("--train-iters", "14", "--log-interval", "1", "--save-interval", "5", "--eval-interval", "1000")
LAYOUT = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")


@pytest.fixture(scope="module")
def cluster():
    c = _start(SlurmCluster(nodes=2))
    try:
        yield c
    finally:
        c.stop()


def _losses(folder):
    return {r["step"]: r["loss"] for r in train_cli.rows(folder) if "loss" in r}


def _wait_until(cluster, job, condition, log_path, what, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        assert cluster.states(job)[0] in ("PENDING", "RUNNING", "CONFIGURING"), read(log_path)
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}:\n{read(log_path)}")


def test_two_node_pipeline_preempted_requeued_and_exact(cluster, site):
    # every run starts from one rank's weights (TP ranks draw their shards' init from their own streams)
    init = site["root"] / "init"
    train_cli.train("--recipe", "debug_satformer", "--train-iters", "3", "--save", init, "--no-progress-bar")
    flags = (*FLAGS, "--pretrained-checkpoint", str(init))
    folder = run_dir(site, "debug_satformer", *flags, *LAYOUT)
    job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=15", "--job-name=msat-2n",
                          f"--output={site['logs']}/%x-%j.out", "slurm/train.sbatch", "debug_satformer", *flags,
                          *LAYOUT], cwd=ROOT, env=site["env"])
    log_path = f"{site['logs']}/msat-2n-{job}.out"
    _wait_until(cluster, job, lambda: (train_cli.latest(folder) or 0) >= 5 and max(_losses(folder), default=0) >= 6,
                log_path, "the first checkpoint and a step after it")
    cluster.signal_batch(job, "USR1")
    state = cluster.wait(job, timeout=900)
    log = read(log_path)
    assert state == "COMPLETED", log
    assert int(cluster.job(job)[0]["Restarts"]) == 1, log
    assert "on n[1-2], 4 tasks, master 127.0.0.1:" in log, log  # n1's NodeAddr, not the name n1
    assert "TP2xPP2xDP1" in log and "requeueing job" in log and "resumed from" in log, log
    got = _losses(folder)
    assert sorted(got) == list(range(1, 15)), sorted(got)
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["world_size"] == 4
    one_node = site["root"] / "one_node"
    train_cli.train("--recipe", "debug_satformer", *flags, *LAYOUT, "--save", one_node, "--no-progress-bar", nproc=4)
    assert got == _losses(one_node)  # the same layout on one node, uninterrupted: exactly
    one_rank = site["root"] / "one_rank"
    train_cli.train("--recipe", "debug_satformer", *flags, "--save", one_rank, "--no-progress-bar")
    ref = _losses(one_rank)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step


def test_a_dead_node_ends_the_job_and_the_requeue_resumes(cluster, site):
    flags = ("--train-iters", "400", "--log-interval", "1", "--save-interval", "4", "--eval-interval", "1000",
             "--pipeline-model-parallel-size", "2")
    folder = run_dir(site, "debug_transformer", *flags)
    job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=15", "--job-name=msat-dead",
                          f"--output={site['logs']}/%x-%j.out", "slurm/train.sbatch", "debug_transformer", *flags],
                         cwd=ROOT, env=site["env"])
    log_path = f"{site['logs']}/msat-dead-{job}.out"
    _wait_until(cluster, job, lambda: (train_cli.latest(folder) or 0) >= 8, log_path, "two checkpoints")
    cluster.kill_node("n2")
    t0 = time.time()
    deadline = t0 + 240
    while time.time() < deadline and cluster.states(job)[0] == "RUNNING":
        time.sleep(1)
    ended = time.time() - t0
    assert cluster.states(job)[0] != "RUNNING", f"the job still runs {ended:.0f} s after n2 died:\n{read(log_path)}"
    cluster.start_node("n2")  # the node comes back (ReturnToService=2)
    state = cluster.wait(job, timeout=600)  # launch.sh does not requeue a crash: FAILED, unless Slurm requeued it
    at_death = train_cli.latest(folder)
    if state != "COMPLETED":  # resubmit, as a user (or tools/submit_grid.py) would
        job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=15",
                              "--job-name=msat-dead", f"--output={site['logs']}/%x-%j.out", "slurm/train.sbatch",
                              "debug_transformer", *flags], cwd=ROOT, env=site["env"])
        log_path = f"{site['logs']}/msat-dead-{job}.out"
    assert cluster.wait(job, timeout=900) == "COMPLETED", read(log_path)
    log = read(log_path)
    assert re.search(rf"resumed from \S+iter_{at_death:07d} \(iteration {at_death}", log), log
    assert train_cli.latest(folder) == 400
    print(f"n2 killed: the job left RUNNING after {ended:.0f} s ({state}); resumed from iteration {at_death}")


def test_grid_array_with_two_node_entries(cluster, site):
    extra = ("--train-iters", "6", "--pipeline-model-parallel-size", "2")
    proc = subprocess.run([sys.executable, "tools/submit_grid.py", "--archs", "transformer,satformer", "--scales",
                           "debug", "--nodes", "2", "--gpus-per-node", "1", "--submit", "--", *extra],
                          cwd=ROOT, env=cluster.env(site["env"]), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"submitted array job (\d+): 2 task", proc.stdout).group(1)
    assert cluster.wait(job, timeout=900) == "COMPLETED", proc.stdout
    for i, arch in enumerate(("transformer", "satformer")):
        log = read(f"{site['logs']}/msat-debug-{job}_{i}.out")
        assert "on n[1-2], 2 tasks" in log, log
        folder = run_dir(site, f"debug_{arch}", *extra, "--seed", "1234")
        assert train_cli.latest(folder) == 6, log
        assert json.load(open(os.path.join(folder, "config.json")))["layout"].startswith("TP1xPP2"), log
