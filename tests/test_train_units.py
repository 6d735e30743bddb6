"""Fast checks of the trainer's pieces that need no process group: the FLOPs count against a hand
count, the peak-FLOPs table, the recipe registry and argument validation."""

import types

import pytest

import recipes  # the repository's recipes/ package
from megatron_sat.model.flops import PEAK_TFLOPS, flops_breakdown, flops_per_token, peak_flops_per_device
from megatron_sat.training.argument_checks import validate_args
from megatron_sat.training.arguments import build_parser, parse_args


def _cfg(arch, **kw):
    base = dict(arch=arch, num_layers=3, hidden_size=8, num_attention_heads=2, num_query_groups=1,
                kv_channels=4, ffn_hidden_size=16, gated_linear_unit=True, value_residual_last_k=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_flops_hand_count_tiny():
    # h=8, L=3, nh=2, ng=1, d=4, f=16, s=5, V=11, written out term by term:
    qkv = 2 * 8 * (2 * 4 + 2 * 1 * 4)      # x [8] @ W_qkv [8, 16]           = 256 per layer
    attn = 2 * 5 * 2 * 4 + 2 * 5 * 2 * 4   # q.k over 5 keys, 2 heads of 4; then p @ V = 160
    proj = 2 * 8 * 8                       # [8] @ W_o [8, 8]                 = 128
    mlp = 2 * 8 * 16 * 2 + 2 * 16 * 8      # gate+up [8, 32], down [16, 8]    = 768
    logits = 2 * 8 * 11                    # = 176
    transformer = 3 * (qkv + attn + proj + mlp) + logits
    assert flops_per_token(_cfg("transformer"), 5, 11, training=False) == transformer == 4112
    assert flops_per_token(_cfg("transformer"), 5, 11) == 3 * 4112
    # SATFormer mixes in layers 2 and 3: x @ W_alpha [8, 1] = 16, relu 1, alpha * V1 + V over 4 = 8
    sat = flops_breakdown(_cfg("satformer"), 5, 11)
    assert (sat["gate"], sat["mixing"]) == (2 * (16 + 1), 2 * 8)
    separate = _cfg("satformer", value_residual_gate_impl="separate")
    assert flops_per_token(separate, 5, 11, training=False) == 4112 + 34 + 16
    # the fused gate (default): QKV rows (2 + 2) * 4 = 16, + 1 gate row = 17, padded to 32: 15 zero rows of h
    assert sat["gate_padding"] == 2 * (2 * 8 * 15) and flops_breakdown(separate, 5, 11)["gate_padding"] == 0
    assert flops_per_token(_cfg("satformer"), 5, 11, training=False) == 4112 + 34 + 16 + 480
    # TP 2 cannot split one KV group: the gate stays separate, no padding
    assert flops_breakdown(_cfg("satformer"), 5, 11, tp=2)["gate_padding"] == 0
    # last_k=1: only layer 3; ResFormer: l1 * V1 + l2 * V = 3 * 4 per mixing layer
    assert flops_breakdown(_cfg("satformer", value_residual_last_k=1), 5, 11)["gate"] == 17
    res = flops_breakdown(_cfg("resformer"), 5, 11)
    assert (res["gate"], res["mixing"]) == (0, 2 * 12)


def test_flops_of_the_baselines_hand_count_tiny():
    # the tiny config above (h=8, L=3): transformer forward 4112; the connections' terms written out
    dense = flops_breakdown(_cfg("denseformer"), 5, 11)
    assert dense["connections"] == (3 + 5 + 7) * 8  # layer i: weighted sum of i + 1 outputs, (2(i+1) - 1) h
    assert flops_per_token(_cfg("denseformer"), 5, 11, training=False) == 4112 + 120
    # Hyper-Connections n=2, dynamic, per sublayer: 2nh(n+1)=96 + 2nh=32 + 3n(n+2)=24 (weights), 2n(n+1)h=96 (mix),
    # 2nh=32 (beta y +) = 280; 2 sublayers x 3 layers, + (n-1) h = 8 for the streams' sum in layer 3
    hc = flops_breakdown(_cfg("hyperconnections", hc_expansion_rate=2, hc_dynamic=True), 5, 11)
    assert hc["connections"] == 6 * 280 + 8
    assert flops_breakdown(_cfg("hyperconnections", hc_expansion_rate=2, hc_dynamic=False), 5, 11)["connections"] \
        == 6 * (96 + 32) + 8
    # MUDDFormer, 4 ways (1 in the last layer): 2hCk + Ck + 2(Ck)^2 + Ck + C(2k-1)h + Ch per layer (k = i + 1)
    mudd = flops_breakdown(_cfg("muddformer", muddformer_param_realloc=False), 5, 11)
    per_layer = [2 * 8 * c * k + 2 * c * k + 2 * (c * k) ** 2 + c * (2 * k - 1) * 8 + c * 8
                 for c, k in ((4, 2), (4, 3), (1, 4))]
    assert mudd["connections"] == sum(per_layer) == 400 + 696 + 168
    assert mudd["mlp"] == flops_breakdown(_cfg("transformer"), 5, 11)["mlp"]  # same FFN in every layer
    realloc = flops_breakdown(_cfg("muddformer", muddformer_param_realloc=True), 5, 11)["mlp"]
    assert realloc == 2 * 8 * (256 + 256 + 256) * 3  # FFN 0.5x, 1x, 1.5x of 16, rounded as the authors: >= 256


def test_fused_gate_padding_under_one_percent_at_paper_scales():
    """The fused gate pads each TP rank's QKV width to a multiple of 16 rows: under 1% extra GEMM width at
    the paper's scales for TP 1 and 2 (the recipes run TP 1), and for 760M and 1.3B also at TP 4. A rank
    with g KV groups needs (-g) mod 16 rows, so few groups per rank cost more: 340M and 130M at TP 4 (4 and
    3 groups per rank) pad 1.6% and 2.3%. The gate rows themselves are W_alpha (counted in "gate")."""
    from megatron_sat.model.config import make_config
    from megatron_sat.model.fused_gate import padding_rows
    from megatron_sat.model.sizes import PAPER_SCALES

    for scale, sizes in PAPER_SCALES.items():
        cfg = make_config("satformer", **sizes)
        qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels
        for tp in (1, 2, 4) if scale in ("760M", "1.3B") else (1, 2):
            pad = padding_rows(cfg, tp)
            assert (qkv_rows + cfg.num_query_groups + pad) % (16 * tp) == 0
            assert pad / qkv_rows < 0.01, f"{scale} TP{tp}: {pad} padding rows on {qkv_rows}"


def test_flops_match_parameter_rule_of_thumb_at_1b():
    # 6 N per token (N without embeddings) is the standard estimate: the exact count is close to it
    from megatron_sat.model.config import make_config

    cfg = make_config("satformer", **recipes.SIZES["xl"])
    h, L, f = 2048, 24, 5632
    n_layer_params = L * (4 * h * h + 3 * h * f)
    exact = flops_per_token(cfg, 4096, 32000) - 3 * flops_breakdown(cfg, 4096, 32000)["attention"]
    assert abs(exact - 6 * (n_layer_params + 32000 * h)) / exact < 0.01


def test_peak_flops_table_and_cpu():
    assert PEAK_TFLOPS["H100"] == PEAK_TFLOPS["H200"] == 989.0 and PEAK_TFLOPS["A100"] == 312.0
    assert peak_flops_per_device(50.0) == 50e12
    import torch

    if not torch.cuda.is_available():
        assert peak_flops_per_device(None) is None  # no MFU on CPU (the step line says why, once)


def test_recipes_registry_and_overrides():
    assert {"demo", "debug_transformer", "debug_resformer", "debug_satformer", "debug_denseformer",
            "debug_muddformer", "debug_hyperconnections"} <= set(recipes.RECIPES)
    dests = {a.dest for a in build_parser()._actions}
    for name in recipes.RECIPES:
        assert set(recipes.get(name)) <= dests, name
    args = parse_args(["--recipe", "debug_resformer", "--train-iters", "7", "--save", "x"])
    assert (args.arch, args.train_iters, args.num_layers, args.save) == ("resformer", 7, 4, "x")
    assert recipes.base(lr=2e-3)["min_lr"] == pytest.approx(2e-4)
    assert recipes.model("satformer", "large")["hidden_size"] == 1536
    with pytest.raises(ValueError, match="unknown recipe 'nope'; known recipes: "):
        recipes.get("nope")


def test_validate_args_lists_every_problem():
    args = build_parser().parse_args(["--arch", "gpt9", "--global-batch-size", "10", "--micro-batch-size", "4",
                                      "--mock-data", "--vocab-size", "64", "--tensor-model-parallel-size", "3"])
    with pytest.raises(ValueError) as e:
        validate_args(args, world_size=4)
    text = str(e.value)
    assert "unknown --arch 'gpt9'" in text and "world size 4 is not divisible by TP x PP x CP = 3 x 1 x 1" in text
    args = build_parser().parse_args(["--global-batch-size", "10", "--micro-batch-size", "4", "--mock-data",
                                      "--vocab-size", "64"])
    with pytest.raises(ValueError, match="--global-batch-size 10 is not divisible by --micro-batch-size x "
                                         "data-parallel size = 4 x 2"):
        validate_args(args, world_size=2)
    validate_args(build_parser().parse_args(["--mock-data", "--vocab-size", "64"]), world_size=2)


@pytest.mark.parametrize("argv, message", [
    (["--arch", "denseformer", "--recompute-granularity", "full"],
     "--recompute-granularity full is not supported for --arch denseformer"),
    (["--arch", "muddformer", "--recompute-granularity", "full"],
     "--recompute-granularity full is not supported for --arch muddformer"),
    (["--arch", "hyperconnections", "--fp8-format", "hybrid"],
     "--fp8-format is not supported for the hyperconnections baseline"),
    (["--arch", "denseformer", "--fp8-format", "e4m3"], "--fp8-format is not supported for the denseformer baseline"),
    (["--arch", "hyperconnections", "--hc-expansion-rate", "0"], "--hc-expansion-rate must be >= 1"),
])
def test_baseline_limits_are_refused_before_any_work(argv, message):
    args = build_parser().parse_args(["--mock-data", "--vocab-size", "64", *argv])
    with pytest.raises(ValueError, match=message):
        validate_args(args, world_size=1)


def test_baseline_flags_reach_the_model_config():
    from megatron_sat.model.args import model_args

    def model_config_fields(args):
        return vars(model_args(args))

    parser = build_parser()
    keys = ("hc_expansion_rate", "hc_dynamic", "muddformer_param_realloc")
    defaults = model_config_fields(parser.parse_args([]))
    assert tuple(defaults[k] for k in keys) == (4, True, True)  # the authors' configs
    fields = model_config_fields(parser.parse_args(["--hc-expansion-rate", "2", "--hc-static",
                                                    "--no-muddformer-param-realloc"]))
    assert tuple(fields[k] for k in keys) == (2, False, False)
    assert defaults["local_attention"] == "sdpa"  # torch SDPA for the local spec unless asked otherwise
    assert model_config_fields(parser.parse_args(["--local-attention", "dot_product"]))["local_attention"] == "dot_product"
    assert defaults["qk_norm_eps"] == 1e-5  # the authors' q/k norms (flash-linear-attention's RMSNorm default)
    assert model_config_fields(parser.parse_args(["--qk-norm-eps", "1e-6"]))["qk_norm_eps"] == 1e-6
    validate_args(parser.parse_args(["--arch", "hyperconnections", "--recompute-granularity", "full", "--mock-data",
                                     "--vocab-size", "64"]), world_size=1)  # HC checkpoints like any hidden state


def test_arguments_become_objects_in_one_place(monkeypatch):
    """training/setup.py: every model flag (ModelArgs' flagged fields), the layout, the dtype and the training-only
    fields reach the model config; bf16 / distributed optimizer follow the target; the scheduler reads the command's schedule."""
    import torch

    from megatron_sat.model.args import NAMES, model_args
    from megatron_sat.parallel.world import world_from_env
    from megatron_sat.training import schedule, setup

    parser = build_parser()
    args = parser.parse_args(["--arch", "resformer", "--value-residual-gate", "sigmoid", "--value-residual-gate-impl",
                              "separate", "--value-residual-last-k", "2", "--resformer-lambdas", "fixed",
                              "--hc-expansion-rate", "2", "--hc-static", "--no-muddformer-param-realloc",
                              "--output-layer-init", "unscaled", "--local-attention", "dot_product",
                              "--qk-norm-eps", "1e-6", "--pipeline-model-parallel-size", "2",
                              "--num-virtual-stages-per-pipeline-rank", "2", "--recompute-granularity", "full",
                              "--recompute-num-layers", "2", "--bf16"])
    run = setup.precision_and_layout(args, gpu=False)
    assert (run.bf16, run.distributed_optimizer, run.dtype) == (True, False, torch.bfloat16)  # --bf16 over the CPU
    assert (run.layout.pp, run.layout.vpp, run.layout.tp) == (2, 2, 1)
    assert setup.precision_and_layout(parser.parse_args([]), gpu=True)[:3] == (True, True, torch.bfloat16)
    assert setup.precision_and_layout(parser.parse_args([]), gpu=False)[:3] == (False, False, torch.float32)
    config = setup.model_config(args, run.layout, run.dtype, training=True)
    described = vars(model_args(args))  # every flag's value, the derived sizes resolved
    assert described["num_query_groups"] == 4 and described["value_residual_gate"] == "sigmoid"
    assert all(getattr(config, k) == described[k] for k in NAMES), "a model flag is lost"
    assert (config.arch, config.num_layers, config.params_dtype, config.bf16) == ("resformer", 4, torch.bfloat16, True)
    assert (config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size) == (2, 2)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "uniform", 2)
    plain = setup.model_config(args)  # the planner's: no layout, dtype or training-only fields
    assert (plain.pipeline_model_parallel_size, plain.recompute_granularity, plain.bf16) == (1, None, False)
    assert all(getattr(plain, k) == described[k] for k in NAMES)

    args = parser.parse_args(["--lr", "2e-3", "--min-lr", "2e-4", "--train-iters", "50", "--lr-warmup-fraction",
                              "0.1", "--lr-decay-style", "linear", "--weight-decay", "0.05"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = setup.scheduler(optimizer, args)
    assert (sched.max_lr, sched.min_lr, sched.lr_warmup_steps, sched.lr_decay_steps) == (2e-3, 2e-4, 5.0, 50)
    assert (sched.lr_decay_style, sched.start_wd, sched.override_opt_param_scheduler) == ("linear", 0.05, True)
    assert setup.scheduler(optimizer, args, schedule.CHECKPOINT).use_checkpoint_opt_param_scheduler

    for key in ("WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    assert (world_from_env(), world_from_env(default=0)) == (1, 0)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert world_from_env() == 1  # an sbatch script itself: one process, not a rank of the job's world
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert world_from_env() == 8  # a task of an srun step
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert world_from_env() == 4  # torchrun's


def test_help_renders():
    text = build_parser().format_help()
    for flag in ("--tensor-model-parallel-size", "--num-virtual-stages-per-pipeline-rank", "--global-batch-size",
                 "--exit-duration-in-mins", "--wandb-project", "--recipe", "--arch"):
        assert flag in text
    assert "--debug-inject-nan-at-step" not in text


def test_model_config_errors_exit_2_before_any_work(tmp_path):
    """Arch limits fail in argument checking (no megatron import); what only the model config knows fails
    in the trainer before any data or folder is made. Exit 2, a message naming the problem, nothing written."""
    import subprocess
    import sys

    out = tmp_path / "run"
    for extra, message in (
            (["--recipe", "debug_denseformer", "--recompute-granularity", "full"],
             "--recompute-granularity full is not supported for --arch denseformer"),
            (["--recipe", "debug_hyperconnections", "--fp8-format", "hybrid"],
             "--fp8-format is not supported for the hyperconnections baseline"),
            (["--recipe", "debug_resformer", "--num-layers", "1"], "arch 'resformer' mixes layer 1's values")):
        proc = subprocess.run([sys.executable, "-m", "megatron_sat.train", *extra, "--save", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert message in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
        assert not out.exists()


def test_gpu_only_options_refused_cleanly_on_cpu(tmp_path):
    """Without Transformer Engine on a GPU, FP8 and context parallelism are refused with exit 2, nothing written."""
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU refusal")
    out = tmp_path / "run"
    for extra, message in ((["--fp8-format", "hybrid"], "--fp8-format needs Transformer Engine on a GPU"),
                           (["--transformer-impl", "transformer_engine"], "needs Transformer Engine on a GPU"),
                           (["--context-parallel-size", "2"], "not divisible by TP x PP x CP = 1 x 1 x 2")):
        proc = subprocess.run([sys.executable, "-m", "megatron_sat.train", "--recipe", "debug_satformer",
                               "--save", str(out), *extra], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert message in proc.stdout + proc.stderr
        assert not out.exists()


def test_console_scripts_run_from_anywhere(tmp_path):
    """`pip install -e .` puts the main tools on PATH (tools/ is installed as megatron_sat_tools)."""
    import os
    import subprocess
    import sys

    bin_dir = os.path.dirname(sys.executable)
    names = ["train", "collect-grid", "convert-to-hf", "convert-from-hf", "preprocess-data", "evaluate",
             "analyze-gates", "plan-layout", "submit-grid", "torchrun"]
    missing = [n for n in names if not os.path.isfile(os.path.join(bin_dir, f"megatron-sat-{n}"))]
    assert not missing, f"console scripts not installed (re-run `make venv`): {missing}"
    for name in ("convert-to-hf", "plan-layout"):
        proc = subprocess.run([os.path.join(bin_dir, f"megatron-sat-{name}"), "--help"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and f"usage: megatron-sat-{name}" in proc.stdout, proc.stdout + proc.stderr


def test_resume_of_a_checkpoint_from_before_qk_norm_eps_asks_for_its_eps():
    """A checkpoint without qk_norm_eps used its layernorm eps for the q/k norms: resuming it at another eps is
    refused (naming both), at that eps it is not."""
    from megatron_sat.training.run_folder import model_differences

    old = {"arch": "satformer", "layernorm_epsilon": 1e-6}
    assert model_differences(old, {"arch": "satformer", "layernorm_epsilon": 1e-6, "qk_norm_eps": 1e-5}) == [
        "qk_norm_eps 1e-06 in the checkpoint, 1e-05 now"]
    assert model_differences(old, {"arch": "satformer", "layernorm_epsilon": 1e-6, "qk_norm_eps": 1e-6}) == []


def test_arch_labels_select_the_gate_implementation():
    from megatron_sat.archs import arch_label

    assert arch_label("satformer") == ("satformer", {})
    assert arch_label("satformer:separate") == ("satformer", {"value_residual_gate_impl": "separate"})
    assert arch_label("satformer:fused") == ("satformer", {"value_residual_gate_impl": "fused"})
    assert arch_label("transformer:dot_product") == ("transformer", {"local_attention": "dot_product"})
    for bad in ("transformer:separate", "satformer:eager", "satformer:", "sat"):
        with pytest.raises(ValueError, match="satformer:IMPL"):
            arch_label(bad)


def test_fused_gate_fallback_is_announced():
    """Where the fused gate cannot run (a QKV bias), the separate one runs and says so."""
    from megatron_sat.model.config import make_config
    from megatron_sat.model.specs import layer_spec

    sizes = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
    with pytest.warns(UserWarning, match="runs the separate gate"):
        layer_spec(make_config("satformer", **sizes, add_qkv_bias=True), "local")
    assert not make_config("satformer", **sizes, add_qkv_bias=True).fused_value_residual_gate
    assert make_config("satformer", **sizes).fused_value_residual_gate


def test_the_progress_bar_starts_after_the_banner_and_carries_the_loss(tmp_path, monkeypatch, capsys):
    """Monitor: no bar while the run is being set up (the banner comes first, on its own line); start_bar draws it
    (on a terminal), each step line sets its loss; without an MFU the reason is printed once, not on every line."""
    from megatron_sat.training.monitor import Monitor

    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    args = parse_args(["--recipe", "debug_satformer", "--train-iters", "3", "--save", str(tmp_path / "run")])
    monitor = Monitor(args, dict(vars(args), num_parameters=1000, vocab_size=256), 0, resumed=False, is_logger=True)
    try:
        assert monitor.bar is None
        monitor.start_bar()
        assert monitor.bar is not None and monitor.bar.n == 0
        for step in (1, 2):
            monitor.log_train(dict(step=step, loss=5.0 - step, lr=1e-3, grad_norm=1.0, tokens_per_s=100.0,
                                   mfu=None), eta_s=1.0)
            monitor.advance()
        assert monitor.bar.postfix == "loss=3.0000" and monitor.bar.n == 2
    finally:
        monitor.close()
    out = capsys.readouterr()
    text = out.out + out.err
    assert text.count("no MFU on the step lines") == 1 and "MFU n/a" not in text and "step 2/3 | loss 3.0000" in text


def test_the_loop_reads_its_settings_not_the_argument_namespace(tmp_path):
    """training/loop.py's Loop takes its settings (LoopSettings, taken once from the arguments by
    trainer.loop_settings), the built parts and the model setup: no argument namespace reaches it, and the settings
    hold the arguments' own values (checkpoints record every argument, as vars(args) held them)."""
    import ast
    import dataclasses
    import inspect

    from megatron_sat.training import loop
    from megatron_sat.training.trainer import loop_settings

    args = parse_args(["--recipe", "debug_satformer", "--save", str(tmp_path / "run"), "--exit-interval", "5",
                       "--rampup-batch-size", "2", "2", "16", "--train-samples", "160"])
    settings = loop_settings(args, 3.0, 4.0)
    for f in dataclasses.fields(loop.LoopSettings):
        if f.name not in ("hang_minutes", "group_minutes", "arguments"):
            assert getattr(settings, f.name) == getattr(args, f.name), f.name
    assert (settings.exit_interval, settings.rampup_batch_size, settings.save) == (5, [2, 2, 16], str(tmp_path / "run"))
    assert (settings.hang_minutes, settings.group_minutes) == (3.0, 4.0)
    assert settings.arguments == vars(args) and settings.arguments is not vars(args)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.train_iters = 1
    assert list(inspect.signature(loop.Loop.__init__).parameters) == [
        "self", "settings", "setup", "parts", "stop", "t_start", "log"]
    tree = ast.parse(inspect.getsource(loop))
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
        {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
    assert "args" not in names  # (a checkpoint's record is passed as the keyword args=, a name of Saver.save's)
