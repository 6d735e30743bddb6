"""The trainer end to end, through its command line (real megatron-core, gloo, files, signals).

One small SATFormer (4 layers, hidden 64, GQA 4/2, seq 32) on the embedded corpus (real text,
BPE 512 trained on it), 40 scheduled steps, global batch 8 = 4 micro-batches of 2:

  A  1 process, straight, checkpoint every 3 steps             -> the reference losses
  B  1 process, --load A --ckpt-step 3, steps 4-6               -> exactly A's losses (resume)
  C  1 process, SIGTERM after step 2 -> checkpoint, exit 0; rerun with --load -> finishes 40 steps
     with exactly A's losses
  D  4 processes TP2 x PP2 with the separate SATFormer gate, --load A --ckpt-step 3 (layout and gate
     implementation change: A has the default, fused gate), steps 4-8 -> A's losses (relative 1e-5), grad
     norms and gate telemetry (1e-4)
  E  1 process, fused gate, --load D (TP2 x PP2 -> TP1 x PP1, separate -> fused), steps 9-10 -> A's losses
     (relative 1e-5, as D's)
  N  1 process, NaN injected at step 5 -> exit 3 with a message; latest checkpoint stays at 3
  F  1 process, --save F --load F --pretrained-checkpoint A, steps 1-2: A's final weights (validation
     loss after a step at lr 0 equals A's last one exactly), a new LR schedule from iteration 0; the
     same command rerun (a requeued job) resumes F's own checkpoint, steps 3-4
  G  2 processes DP2 with the distributed optimizer, steps 1-3; then 1 process resumes it (the
     optimizer state resharded DP2 -> DP1), steps 4-6 -> A's losses (relative 1e-5); with --eval-tasks
     every 2 steps (local tasks, one broken): scores in metrics.jsonl equal to tools/evaluate.py --checkpoint
     (at TP2, torchrun)
plus bad input (unknown recipe/arch, missing data, indivisible batch, missing pretrained checkpoint):
exit 2, clear message, nothing written. Eleven trainer launches in all (~2-3 minutes on 2 cores).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from train_cli import ROOT, free_port, latest, metrics, train
from train_cli import cmd as _cmd
from train_cli import env as _env

pytestmark = pytest.mark.slow  # real trainer runs, multi-process layouts

EVAL_TASKS = os.path.join(ROOT, "tests", "data", "eval")
TINY = ["--arch", "satformer", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "40", "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "10", "--eval-iters", "1",
        "--vocab-size", "512", "--no-progress-bar"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    data = ["--embedded-data", str(tmp / "data")]
    out = {"tmp": tmp}
    out["A_log"] = train(*TINY, *data, "--save", str(tmp / "A"), "--save-interval", "3")
    out["B_log"] = train(*TINY, *data, "--save", str(tmp / "B"), "--load", str(tmp / "A"), "--ckpt-step", "3",
                         "--exit-interval", "6")
    # C: SIGTERM once step 2 is logged
    c_dir = tmp / "C"
    proc = subprocess.Popen(_cmd(1, [*TINY, *data, "--save", str(c_dir)]), cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            if any(json.loads(line).get("step", 0) >= 2 for line in open(c_dir / "metrics.jsonl")):
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out["C1_log"], _ = proc.communicate(timeout=300)
    out["C1_rc"] = proc.returncode
    out["C1_stop"] = latest(c_dir) if os.path.exists(c_dir / "latest_checkpointed_iteration.txt") else None
    out["C2_log"] = train(*TINY, *data, "--save", str(c_dir), "--load", str(c_dir))
    out["D_log"] = train(*TINY, *data, "--save", str(tmp / "D"), "--load", str(tmp / "A"), "--ckpt-step", "3",
                         "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                         "--value-residual-gate-impl", "separate", "--exit-interval", "8", nproc=4)
    out["E_log"] = train(*TINY, *data, "--save", str(tmp / "E"), "--load", str(tmp / "D"), "--exit-interval", "10")
    out["N_log"] = train(*TINY, *data, "--save", str(tmp / "N"), "--save-interval", "3",
                         "--debug-inject-nan-at-step", "5", expect=3)
    (tmp / "F").mkdir()
    finetune = [*TINY, *data, "--save", str(tmp / "F"), "--load", str(tmp / "F"), "--pretrained-checkpoint",
                str(tmp / "A"), "--eval-interval", "1"]
    out["F1_log"] = train(*finetune, "--exit-interval", "2")
    out["F2_log"] = train(*finetune, "--exit-interval", "4")  # a requeued job: same command, later exit
    (tmp / "bad_tasks").mkdir()  # a task whose data is missing: reported, training goes on
    (tmp / "bad_tasks" / "broken.yaml").write_text(
        "task: broken_task\ndataset_path: json\ndataset_kwargs: {data_files: {test: missing.jsonl}}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{answer}}'\n")
    tasks = ["--eval-tasks", "megatron_sat_tiny_mc,broken_task,megatron_sat_tiny_gen", "--eval-tasks-interval", "2",
             "--eval-tasks-limit", "4", "--eval-tasks-include-path", EVAL_TASKS,
             "--eval-tasks-include-path", str(tmp / "bad_tasks")]
    dist_opt = [*TINY, *data, "--save", str(tmp / "G"), "--use-distributed-optimizer", *tasks]
    out["G1_log"] = train(*dist_opt, "--exit-interval", "3", nproc=2)
    out["G2_log"] = train(*dist_opt, "--load", str(tmp / "G"), "--exit-interval", "6")
    # H: a debug recipe on real text: the command line's data source replaces the recipe's mock data
    out["H_log"] = train("--recipe", "debug_satformer", *data, "--vocab-size", "512", "--train-iters", "3",
                         "--save", str(tmp / "H"), "--no-progress-bar")
    return out


def test_reference_run_writes_metrics_config_and_checkpoints(runs):
    a = runs["tmp"] / "A"
    train_rows, val = metrics(a)
    assert sorted(train_rows) == list(range(1, 41))
    for row in train_rows.values():
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "gate_mean", "gate_zero_frac"):
            assert key in row
        assert len(row["gate_mean"]) == 4 and row["gate_mean"][0] is None  # layer 1 has no gate
        assert all(0 <= z <= 1 for z in row["gate_zero_frac"][1:])
    assert sorted(val) == [10, 20, 30, 40]
    assert train_rows[40]["loss"] < train_rows[1]["loss"] - 1.0, "loss did not fall on real text"
    assert val[40] < val[10]
    # Megatron's warmup: step k uses lr * (k - 1) / warmup, then cosine down to min_lr
    assert [train_rows[k]["lr"] for k in (1, 2, 3)] == pytest.approx([0.0, 1.5e-3, 3e-3])
    assert train_rows[40]["lr"] == pytest.approx(3e-4, rel=0.05)
    config = json.load(open(a / "config.json"))
    assert config["arch"] == "satformer" and config["num_microbatches"] == 4 and config["vocab_size"] == 512
    assert latest(a) == 40 and os.path.isfile(a / "iter_0000040" / "metadata.json")
    assert not [p for p in os.listdir(a) if p.endswith(".tmp")]
    assert "final validation loss" in runs["A_log"] and "metrics: " in runs["A_log"]
    # a clean console, one process (A) and four (D): megatron-core's Transformer Engine / Apex notices and the other
    # known harmless warnings are filtered (compat/known_warnings.py); on CPU, why there is no MFU is said once
    for log in (runs["A_log"], runs["D_log"]):
        assert "Transformer Engine and Apex are not installed" not in log and "Warning:" not in log, log[-3000:]
        assert "MFU n/a" not in log
    assert runs["A_log"].count("no MFU on the step lines") == (1 if " x cpu" in runs["A_log"] else 0)


def test_resume_continues_exactly(runs):
    ref, _ = metrics(runs["tmp"] / "A")
    got, _ = metrics(runs["tmp"] / "B")
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step]["loss"] == ref[step]["loss"] and got[step]["grad_norm"] == ref[step]["grad_norm"]
    assert latest(runs["tmp"] / "B") == 6


def test_sigterm_saves_exits_zero_and_resume_finishes(runs):
    assert runs["C1_rc"] == 0, runs["C1_log"][-3000:]
    stop = runs["C1_stop"]
    assert stop is not None and 2 <= stop < 40, runs["C1_log"][-3000:]
    assert "SIGTERM" in runs["C1_log"]
    ref, _ = metrics(runs["tmp"] / "A")
    got, _ = metrics(runs["tmp"] / "C")
    assert sorted(got) == list(range(1, 41))
    assert [got[s]["loss"] for s in got] == [ref[s]["loss"] for s in got]
    assert latest(runs["tmp"] / "C") == 40


def test_tp2_pp2_from_one_rank_checkpoint_matches(runs):
    ref, _ = metrics(runs["tmp"] / "A")
    got, _ = metrics(runs["tmp"] / "D")
    assert sorted(got) == [4, 5, 6, 7, 8]
    for s in got:
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-5)
        assert got[s]["grad_norm"] == pytest.approx(ref[s]["grad_norm"], rel=1e-4)
        assert got[s]["gate_mean"][1:] == pytest.approx(ref[s]["gate_mean"][1:], rel=1e-4, abs=1e-6)
    assert "saved at TP1 x PP1" in runs["D_log"] and "TP2xPP2xDP1" in runs["D_log"]
    impls = [json.load(open(runs["tmp"] / run / "config.json"))["value_residual_gate_impl"] for run in "ADE"]
    assert impls == ["fused", "separate", "fused"]  # the checkpoints crossed gate implementations both ways
    back, _ = metrics(runs["tmp"] / "E")
    assert sorted(back) == [9, 10]
    for s in back:
        assert back[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-5)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(runs):
    n = runs["tmp"] / "N"
    assert "loss is nan at iteration 5" in runs["N_log"]
    assert latest(n) == 3
    assert sorted(p for p in os.listdir(n) if p.startswith("iter_")) == ["iter_0000003"]
    train_rows, _ = metrics(n)
    assert max(train_rows) == 4


def test_pretrained_checkpoint_gives_weights_only_and_a_rerun_resumes(runs):
    _, ref_val = metrics(runs["tmp"] / "A")
    got, val = metrics(runs["tmp"] / "F")
    assert sorted(got) == [1, 2, 3, 4]
    assert val[1] == ref_val[40]  # A's final weights, unchanged by a first step at lr 0
    assert [got[k]["lr"] for k in (1, 2, 3)] == pytest.approx([0.0, 1.5e-3, 3e-3])  # new schedule, iteration 0
    assert f"initialised from the weights of {runs['tmp'] / 'A' / 'iter_0000040'}" in runs["F1_log"]
    assert f"resumed from {runs['tmp'] / 'F' / 'iter_0000002'}" in runs["F2_log"]
    assert "initialised from" not in runs["F2_log"] and latest(runs["tmp"] / "F") == 4


def test_distributed_optimizer_resumes_across_data_parallel_sizes(runs):
    ref, _ = metrics(runs["tmp"] / "A")
    got, _ = metrics(runs["tmp"] / "G")
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert "DP2" in runs["G1_log"] and f"resumed from {runs['tmp'] / 'G' / 'iter_0000003'}" in runs["G2_log"]
    for s in got:  # DP2 (steps 1-3) and DP1 after the resume (4-6) against the plain optimizer at DP1
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-5), s
        assert got[s]["grad_norm"] == pytest.approx(ref[s]["grad_norm"], rel=1e-4), s


def test_eval_tasks_during_training(runs):
    """--eval-tasks on G (DP2 steps 1-3, then DP1 steps 4-6; the losses above equal A's, run without them):
    scores every 2 steps in metrics.jsonl, the broken task reported each time, and the step-6 scores equal
    tools/evaluate.py --checkpoint at TP2 (torchrun) on the checkpoint saved at step 6."""
    g = runs["tmp"] / "G"
    rows = {r["step"]: r for r in map(json.loads, open(g / "metrics.jsonl")) if "eval_tasks" in r}
    assert sorted(rows) == [2, 4, 6]
    for row in rows.values():
        assert set(row["eval_tasks"]) == {"megatron_sat_tiny_mc/acc", "megatron_sat_tiny_gen/exact_match"}
        assert all(0.0 <= v <= 1.0 for v in row["eval_tasks"].values())
        assert list(row["eval_tasks_failed"]) == ["broken_task"] and "missing.jsonl" in row["eval_tasks_failed"][
            "broken_task"]
    assert runs["G1_log"].count("task broken_task failed at step 2: ") == 1  # rank 0 reports
    assert "task broken_task failed at step 6: " in runs["G2_log"] and "tasks at step 4: " in runs["G2_log"]
    out = g / "eval" / "step6"  # inside the run folder, where collect_grid finds it; scored at TP2 under torchrun
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           f"--master-port={free_port()}", "tools/evaluate.py", "--checkpoint",
                           str(g / "iter_0000006"), "--tensor-model-parallel-size", "2", "--tasks",
                           "megatron_sat_tiny_mc", "megatron_sat_tiny_gen", "--include-path", EVAL_TASKS, "--limit",
                           "4", "--batch-size", "2", "--output", str(out)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.load(open(out / "results.json"))["table"]
    assert {f"{r['task']}/{r['metric']}": r["value"] for r in table} == pytest.approx(rows[6]["eval_tasks"],
                                                                                     abs=1e-12)


def test_debug_recipe_trains_on_the_embedded_corpus(runs):
    config = json.load(open(runs["tmp"] / "H" / "config.json"))
    assert config["mock_data"] is False and config["embedded_data"] and config["tokenizer_vocab_size"] == 512
    assert config["recipe"] == "debug_satformer" and latest(runs["tmp"] / "H") == 3
    assert (config["weight_decay_params"], config["output_layer_init"]) == ("matrices", "scaled")


@pytest.mark.parametrize("extra, message", [
    (["--recipe", "no_such_recipe"], "unknown recipe 'no_such_recipe'; known recipes: "),
    (["--arch", "mamba", "--mock-data", "--vocab-size", "64"], "unknown --arch 'mamba'"),
    (["--data-path", "/nonexistent/corpus_text_document", "--tokenizer-model", "/nonexistent"],
     "--data-path: no indexed dataset (.bin + .idx) at /nonexistent/corpus_text_document"),
    (["--mock-data", "--vocab-size", "64", "--global-batch-size", "7"],
     "--global-batch-size 7 is not divisible by --micro-batch-size x data-parallel size = 2 x 1"),
    (["--mock-data", "--vocab-size", "64", "--pretrained-checkpoint", "/nonexistent/run"],
     "--pretrained-checkpoint folder /nonexistent/run does not exist"),
    (["--mock-data", "--vocab-size", "64", "--global-batch-size", "0"],
     "--micro-batch-size (2) and --global-batch-size (0) must be >= 1"),
    (["--mock-data", "--vocab-size", "64", "--split", "abc"], "--split 'abc' must be up to three"),
    (["--mock-data", "--vocab-size", "64", "--save-retain-interval", "0"], "--save-retain-interval must be >= 1"),
    (["--mock-data", "--vocab-size", "64", "--eval-samples", "0"], "--eval-samples must be >= 1"),
    (["--mock-data", "--vocab-size", "64", "--weight-decay-params", "some"], "invalid choice: 'some'"),
    (["--mock-data", "--vocab-size", "64", "--eval-tasks", "piqa", "--pipeline-model-parallel-size", "2"],
     "--eval-tasks runs at PP1 and CP1 only (TP and DP are fine)"),
    (["--mock-data", "--vocab-size", "64", "--eval-tasks", "piqa"], "--eval-tasks with --mock-data needs "
     "--tokenizer-model"),
    (["--mock-data", "--vocab-size", "64", "--eval-tasks-interval", "5"], "--eval-tasks-interval need --eval-tasks"),
])
def test_bad_input_fails_clearly_without_writing(tmp_path, extra, message):
    save = tmp_path / "run"
    proc = subprocess.run(_cmd(1, ["--save", str(save), *extra]), cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr
    assert not save.exists()
