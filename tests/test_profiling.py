"""tools/profile_throughput.py end to end on CPU, and its argument checks.

One launch of the tool (its default --mode per-arch: one 2-process torchrun per arch, PP=2) on the
debug recipe shapes for every arch (the three of the paper and the DenseFormer, MUDDFormer and
Hyper-Connections baselines), 1 warm-up + 2 measured steps, with the DeepSpeed flops profiler and a
torch.profiler trace of measured step 2 (about 2-4 minutes on 2 cores):

  * throughput.json / .csv / .png, the table on stdout, modules_<arch>.csv, trace_*.json, ops_*.txt;
  * every figure present and positive, ratios 1 for the baseline, per-arch peak RSS, SATFormer's
    throughput and memory against every arch (the form of the paper's claims);
  * pipeline bytes per micro-batch = forward + backward message of [s, b, W] float32: W = h for the
    Transformer, h + V1's width (KV heads x head dim) for the value-residual archs, h + the history
    X_0..X_2 (+ MUDDFormer's Q, K, V streams) for the dense archs, n x h for Hyper-Connections;
  * DeepSpeed's forward FLOPs over both stages within 5% of the analytic count (megatron_sat/profiling/
    flops.py), and SATFormer's extra (the gate's x @ W_alpha) within 5% of the analytic gate term.
Timings are never asserted (shared 2-core machines). Bad arguments: exit 2 with a message naming the
problem, before anything is imported from megatron.
"""

import csv
import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the profiler on 2 processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "profile_throughput.py")
ARCHS = ("transformer", "resformer", "satformer", "denseformer", "muddformer", "hyperconnections")
H, KV_HEADS, HEADS, SEQ, MBS = 64, 2, 4, 32, 2  # the debug recipes' shape (recipes/__init__.py)
# SATFormer's fused gate (the default): per KV group q, q, k, v rows (4 x 16) and the gate row, 2 x 65 = 130
# rows, padded with zero rows to 144 (a multiple of 16; megatron_sat/model/fused_gate.py)
GATE_PAD = 14
LAYERS, HC_STREAMS = 4, 4


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("profile"))
    cmd = [sys.executable, TOOL, "--recipe", "debug_satformer", "--nproc", "2", "--pp", "2", "--warmup", "1",
           "--steps", "2", "--repeats", "1", "--flops-profile", "--trace-steps", "2", "--out", out]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, \
        f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    with open(os.path.join(out, "throughput.json")) as f:
        return out, json.load(f), proc.stdout


def test_writes_every_output(profiled):
    out, result, stdout = profiled
    for name in ("throughput.json", "throughput.csv", "throughput.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "throughput.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(out, "throughput.csv")) as f:
        assert [r["arch"] for r in csv.DictReader(f)] == list(ARCHS)
    for arch in ARCHS:
        assert arch in stdout
        assert os.path.getsize(os.path.join(out, f"modules_{arch}.csv")) > 0
        assert os.path.getsize(os.path.join(out, f"trace_{arch}_step2_rank0.json")) > 0
        assert os.path.getsize(os.path.join(out, f"ops_{arch}_step2_rank0.txt")) > 0
    assert result["settings"]["layout"] == "TP1xPP2xDP1"


def test_figures_and_ratios(profiled):
    _, result, _ = profiled
    rows = {r["arch"]: r for r in result["rows"]}
    assert list(rows) == list(ARCHS)
    for arch, r in rows.items():
        assert r["steps"] == 2
        assert 0 < r["step_s_min"] <= r["step_s_median"] <= r["step_s_max"]
        assert r["step_cpu_s_median"] > 0
        assert r["tokens_per_s_per_gpu"] > 0 and r["tflops_per_gpu"] > 0
        assert r["mfu"] is None  # no peak FLOP/s on a CPU without --peak-tflops
        assert r["max_rss_mib"] > r["rss_above_start_mib"] > 0  # per arch: one process per arch
        assert r["saved_activation_mib"] > 0
        assert r["final_loss"] > 0
        for key in ("step_s_median", "step_cpu_s_median", "tokens_per_s_per_gpu", "rss_above_start_mib",
                    "saved_activation_mib", "pipeline_bytes_per_microbatch", "params"):
            assert r[f"{key}_ratio"] == pytest.approx(r[key] / rows["transformer"][key]), (arch, key)
    # W_alpha and the fused gate's padding rows, layers 2-4
    assert rows["satformer"]["params"] - rows["transformer"]["params"] == 3 * (KV_HEADS + GATE_PAD) * H
    assert rows["denseformer"]["params"] - rows["transformer"]["params"] == 2 + 3 + 4 + 5  # DWA weights per layer


def test_satformer_against_every_arch(profiled):
    """The paper states its throughput and memory claims as SATFormer vs a baseline: both are reported."""
    _, result, stdout = profiled
    rows = {r["arch"]: r for r in result["rows"]}
    sat = rows["satformer"]
    for arch, r in rows.items():
        assert r["satformer_speedup"] == pytest.approx(sat["tokens_per_s_per_gpu"] / r["tokens_per_s_per_gpu"]), arch
        assert r["satformer_memory_saving"] == pytest.approx(1 - sat["rss_above_start_mib"] / r["rss_above_start_mib"])
    assert sat["satformer_speedup"] == 1 and sat["satformer_memory_saving"] == 0
    assert "satformer vs" in stdout and "1.75x, 31% less memory" in stdout and "1.82x, 5% less memory" in stdout


def test_pipeline_bytes(profiled):
    _, result, _ = profiled
    head_dim = H // HEADS
    history = LAYERS // 2 + 1  # X_0..X_2 cross the boundary before layer 3
    extra = dict(transformer=0, resformer=KV_HEADS * head_dim, satformer=KV_HEADS * head_dim,
                 denseformer=history * H, muddformer=(3 + history) * H, hyperconnections=(HC_STREAMS - 1) * H)
    for r in result["rows"]:
        width = H + extra[r["arch"]]
        assert r["pipeline_message_shape"] == [SEQ, MBS, width]
        assert r["pipeline_message_bytes"] == SEQ * MBS * width * 4
        assert r["pipeline_bytes_per_microbatch"] == 2 * SEQ * MBS * width * 4  # one boundary, fwd + bwd


def test_flops_formula_matches_deepspeed(profiled):
    _, result, _ = profiled
    rows = {r["arch"]: r for r in result["rows"]}
    for arch, r in rows.items():
        assert r["deepspeed_to_analytic"] == pytest.approx(1.0, abs=0.05), arch
    # SATFormer's extra matmul: layers 2..4 each compute x @ W_alpha inside the QKV GEMM, with its padding
    # rows, 2 h (N_kv + pad) FLOPs per token, and the gate function
    ds = {arch: r["deepspeed_forward_flops_per_token"] for arch, r in rows.items()}
    measured = ds["satformer"] - ds["transformer"]
    assert measured == pytest.approx(3 * (2 * H * (KV_HEADS + GATE_PAD) + KV_HEADS), rel=0.05)


def _tool():
    spec = importlib.util.spec_from_file_location("profile_throughput_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, message", [
    (["--archs", "transformer", "hyper_connections"], "did you mean hyperconnections?"),
    (["--archs", "transformer", "denseformer", "--recompute", "full"],
     "--recompute full is not supported for --arch denseformer"),
    (["--archs", "transformer", "gpt5"], "unknown arch"),
    (["--archs", "satformer", "resformer"], "--baseline transformer must be one of --archs"),
    (["--archs", "transformer", "transformer"], "twice"),
    (["--recipe", "no_such_recipe"], "unknown recipe"),
    (["--scale", "7B"], "unknown --scale"),
    (["--nproc", "3", "--tp", "2"], "not divisible by TP x PP"),
    (["--pp", "3", "--nproc", "3"], "num_layers=4 is not divisible"),
    (["--global-batch-size", "3"], "--global-batch-size 3 is not divisible by --micro-batch-size x data-parallel"),
    (["--steps", "2", "--trace-steps", "2-5"], "outside the measured steps"),
    (["--trace-steps", "x"], "--trace-steps wants"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--trace-rank", "4"], "not a rank"),
    (["--precision", "fp8"], "invalid choice"),
])
def test_bad_arguments(argv, message, capsys, monkeypatch):
    for var in ("WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    tool = _tool()
    with pytest.raises(SystemExit) as exc:
        tool.main(argv + ["--out", "/nonexistent/never_written"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_trainers_complete_check_on_one_line(tmp_path, capsys, monkeypatch):
    """The profiler runs the trainer's complete argument check (argument_checks.argument_errors, as --print-config,
    plan-layout and the dry run do) on each profiled arch's arguments: a config file with two problems only that
    check catches (the --grad-reduce-in-bf16 clash, --min-lr above --lr) is refused with both, on one line, exit 2."""
    for var in ("WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text("grad-reduce-in-bf16: true\naccumulate-allreduce-grads-in-fp32: true\nmin-lr: 0.5\n")
    with pytest.raises(SystemExit) as exc:
        _tool().main(["--recipe", "debug_transformer", "--config", str(bad), "--archs", "transformer", "satformer",
                      "--out", str(tmp_path / "never_written")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ": error: 2 problems: " in err[0], err  # each problem once, not once per arch
    assert "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict" in err[0]
    assert "need 0 <= --min-lr (0.5) <= --lr" in err[0]
    assert not (tmp_path / "never_written").exists()


def test_gpu_check_refuses_without_cuda(tmp_path):
    """tools/gpu_check.sh on a machine without CUDA: one line saying so, exit 2, nothing installed or written."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "gpu_check"
    proc = subprocess.run(["bash", os.path.join(repo, "tools", "gpu_check.sh"), str(out)], capture_output=True,
                          text=True, env=dict(os.environ, PYTHON=sys.executable), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device visible" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_settings_are_the_trainers_arguments(monkeypatch):
    """The profiler's settings are the recipe's trainer arguments (arguments.recipe_args) with the tool's flags over
    them, and its own defaults only where the recipe is silent (megatron_sat/profiling/settings.py)."""
    from megatron_sat.model.args import FLAGGED as MODEL_CONFIG_KEYS
    from megatron_sat.profiling.settings import resolve
    from megatron_sat.training.arguments import recipe_args

    for var in ("WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    parser = _tool().build_parser()
    spec = resolve(parser.parse_args(["--scale", "760M", "--nproc", "8", "--tp", "2", "--precision", "bf16"]))
    recipe = recipe_args("satformer_760M")
    assert recipe.output_layer_init == "unscaled"  # a switch the trainer's default does not have
    assert all(spec["arguments"][k] == getattr(recipe, k) for k in MODEL_CONFIG_KEYS)
    assert spec["arguments"]["tensor_model_parallel_size"] == 2 and spec["layout"]["tp"] == 2  # the flag over it
    assert (spec["bf16"], spec["precision"], spec["recompute"]) == (True, "bf16", recipe.recompute_granularity)
    assert (spec["global_batch_size"], spec["seq_length"], spec["lr"]) == (recipe.global_batch_size,
                                                                          recipe.seq_length, recipe.lr)
    tiny = resolve(parser.parse_args(["--scale", "tiny", "--pp", "2", "--nproc", "2"]))  # a shape, no recipe
    assert (tiny["seq_length"], tiny["micro_batch_size"], tiny["vocab_size"], tiny["lr"]) == (512, 1, 32000, 1e-4)
    assert tiny["global_batch_size"] == 1 * 1 * 2 * 2  # micro-batch x DP x 2 PP
    with pytest.raises(ValueError, match="num_layers=4 is not divisible by PP = 3"):  # layout.validate, per arch
        resolve(parser.parse_args(["--scale", "tiny", "--pp", "3", "--nproc", "3"]))
