"""The paper-grid recipes (recipes/paper.py), the layout planner (megatron_sat/training/planner.py) and the
Slurm tools' dry runs (tools/plan_layout.py, tools/submit_grid.py) and run-folder names (megatron_sat/sweep/plan.py), no
cluster needed.

    .venv/bin/python -m pytest -q tests/test_recipes.py        # about a minute on 2 cores
"""

import argparse
import os
import re
import subprocess
import sys

import pytest

from megatron_sat.sweep.plan import resolve
from megatron_sat.training.arguments import build_parser, parse_args
from megatron_sat.training.planner import estimate_memory, load_recipes, plan_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
recipes = load_recipes()
from recipes import paper  # noqa: E402  (registered by load_recipes)

TOKENS_PER_STEP = 512 * 4096


def _tool(*args, expect=0):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


ALL_ARCHS = ("transformer", "resformer", "satformer", "denseformer", "muddformer", "hyperconnections")


def test_grid_is_registered_with_trainer_arguments_only():
    from megatron_sat import archs

    assert paper.ARCHS == ALL_ARCHS == archs.ARCHS  # every arch has the whole grid (megatron_sat/archs.py)
    assert paper.GRID == [f"{a}_{s}" for s in ("130M", "340M", "760M", "1.3B") for a in ALL_ARCHS]
    assert len(paper.GRID) == 24
    dests = {a.dest for a in build_parser()._actions}
    for name in paper.GRID:
        values = recipes.get(name)
        assert set(values) <= dests, (name, set(values) - dests)
        args = parse_args(["--recipe", name, "--mock-data"])  # every recipe passes the trainer's checks
        assert args.arch == name.rsplit("_", 1)[0]
    assert {f"debug_{a}" for a in ALL_ARCHS} <= set(recipes.RECIPES)


def test_baseline_recipes_follow_the_authors_configs():
    for scale in paper.SCALES:
        hc = recipes.get(f"hyperconnections_{scale}")
        assert (hc["hc_expansion_rate"], hc["hc_dynamic"]) == (4, True)  # expansion 4, dynamic (tanh in the model)
        assert recipes.get(f"muddformer_{scale}")["muddformer_param_realloc"] is True  # 4 ways, pre/post norms
        for arch in ("denseformer", "muddformer", "hyperconnections"):
            r = recipes.get(f"{arch}_{scale}")
            assert r["recompute_granularity"] == "selective"  # the dense archs refuse full recompute
            assert r["lr"] == recipes.get(f"satformer_{scale}")["lr"]  # no xl config of theirs: 8e-4 at 1.3B
    assert recipes.get("hyperconnections_1.3B")["lr"] == 8e-4 != recipes.get("transformer_1.3B")["lr"]
    args = parse_args(["--recipe", "hyperconnections_760M", "--mock-data", "--hc-static", "--hc-expansion-rate", "2"])
    assert (args.hc_dynamic, args.hc_expansion_rate) == (False, 2)
    assert parse_args(["--recipe", "muddformer_130M", "--mock-data", "--no-muddformer-param-realloc"]) \
        .muddformer_param_realloc is False


@pytest.mark.parametrize("scale, lr, warmup, iters", [("130M", 2e-3, 24, 2385), ("340M", 1.5e-3, 48, 4769),
                                                      ("760M", 1e-3, 95, 9537), ("1.3B", 8e-4, 143, 14306)])
def test_schedule_from_the_paper(scale, lr, warmup, iters):
    sched = paper.SCHEDULES[scale]
    for arch in paper.ARCHS:
        r = recipes.get(f"{arch}_{scale}")
        expected_lr = 5e-4 if (arch, scale) == ("transformer", "1.3B") else lr  # the authors' Transformer xl
        assert r["lr"] == expected_lr and r["min_lr"] == pytest.approx(0.1 * expected_lr)
        assert r["global_batch_size"] * r["seq_length"] == TOKENS_PER_STEP  # "about 2M tokens per step"
        assert r["train_iters"] == iters and (iters - 1) * TOKENS_PER_STEP < sched.tokens <= iters * TOKENS_PER_STEP
        assert r["lr_warmup_iters"] == warmup == round(sched.warmup_tokens / TOKENS_PER_STEP)
        assert (r["adam_beta1"], r["adam_beta2"], r["weight_decay"], r["clip_grad"]) == (0.9, 0.95, 0.1, 1.0)
        assert r["lr_decay_style"] == "cosine" and r["vocab_size"] == 32000 and r["rotary_base"] == 10000


@pytest.mark.parametrize("scale, iters, warmup", [("130M", 2384, 23), ("340M", 4768, 47), ("760M", 9536, 95),
                                                  ("1.3B", 14305, 143)])
def test_the_authors_counts_are_one_step_fewer(scale, iters, warmup):
    """The authors floor both counts (their train.py: int()); the recipes round the total up and the warmup to
    the nearest step, a stated departure (recipes/paper.py): one training step more at every scale, one warmup
    step more at 130M and 340M."""
    assert paper.authors_counts(scale) == dict(train_iters=iters, lr_warmup_iters=warmup)
    r = recipes.get(f"satformer_{scale}")
    assert r["train_iters"] == iters + 1
    assert r["lr_warmup_iters"] - warmup == (1 if scale in ("130M", "340M") else 0)


def test_author_config_defects_are_fixed():
    for name in paper.GRID:
        r = recipes.get(name)
        assert r["hidden_size"] % r["num_attention_heads"] == 0, name  # SATFormer xl had 24 heads at 2048
        assert r["num_query_groups"] == r["num_attention_heads"], name  # Transformer medium had 4 KV heads
    assert recipes.get("satformer_1.3B")["num_attention_heads"] == 32
    own = {k for options in paper.ARCH_OPTIONS.values() for k in options}  # a baseline's own switches
    shapes = {s: {tuple(sorted((k, v) for k, v in recipes.get(f"{a}_{s}").items()
                               if k not in ("arch", "lr", "min_lr") and k not in own))
                  for a in paper.ARCHS} for s in paper.SCALES}
    assert all(len(v) == 1 for s, v in shapes.items() if s != "1.3B")  # archs differ only in arch (and xl lr)


def test_recipe_runs_through_the_trainer_parser_with_overrides(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    args = parse_args(["--recipe", "satformer_760M", "--mock-data", "--tensor-model-parallel-size", "2",
                       "--micro-batch-size", "2", "--lr", "5e-4"])
    assert (args.arch, args.num_layers, args.hidden_size, args.train_iters) == ("satformer", 19, 1536, 9537)
    assert (args.tensor_model_parallel_size, args.micro_batch_size, args.lr) == (2, 2, 5e-4)


def test_every_recipe_has_a_valid_default_layout():
    for name in paper.GRID:
        plan = plan_recipe(name)
        assert plan.ok, plan.format()
        c = paper.cluster(name)
        assert plan.world_size == c["nodes"] * c["gpus_per_node"] and plan.gpu == c["gpu"]
        assert plan.micro_batch_size * plan.dp * plan.num_microbatches == plan.global_batch_size == 512
        assert 5 < plan.memory["total"] < 0.9 * 80, plan.format()
        assert plan.gpu_hours > 0 and "status    OK" in plan.format()
    assert paper.cluster("debug_satformer")["gpu"] == "cpu"


def test_planner_rejects_bad_layouts():
    cases = [
        (["--tensor-model-parallel-size", "5"], "num_attention_heads=24 is not divisible by TP=5"),
        (["--pipeline-model-parallel-size", "2"], "num_layers=19 is not divisible by PP = 2"),
        (["--micro-batch-size", "3"], "global batch 512 is not divisible by micro-batch x DP = 3 x 16"),
        (["--micro-batch-size", "32"], "exceeds 90% of the H100's 80 GiB"),
    ]
    for overrides, message in cases:
        plan = plan_recipe("satformer_760M", overrides)
        assert not plan.ok and any(message in e for e in plan.errors), (overrides, plan.errors)
    assert not plan_recipe("satformer_130M", ["--pipeline-model-parallel-size", "4"], nodes=1).ok  # 11 layers
    big = plan_recipe("satformer_1.3B", ["--micro-batch-size", "8"], nodes=2)
    assert not big.ok and plan_recipe("satformer_1.3B", ["--micro-batch-size", "8"], nodes=2, gpu="H200").ok
    assert plan_recipe("satformer_1.3B", ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size",
                                          "2", "--sequence-parallel"], nodes=1).ok


def test_memory_model_behaves():
    from megatron_sat.model.config import make_config
    from megatron_sat.model.sizes import PAPER_SCALES
    from megatron_sat.parallel.layout import Layout

    sat, tr = (make_config(a, **PAPER_SCALES["760M"]) for a in ("satformer", "transformer"))
    kw = dict(dp=8, micro_batch_size=4, num_microbatches=16, seq_length=4096, vocab_size=32000)
    base = estimate_memory(sat, Layout(), **kw)
    assert estimate_memory(tr, Layout(), **kw)["v1"] == 0 < base["v1"]
    assert estimate_memory(sat, Layout(), **dict(kw, micro_batch_size=8))["activations"] > 1.9 * base["activations"] / 2
    no_dist = estimate_memory(sat, Layout(), distributed_optimizer=False, **kw)
    assert no_dist["optimizer"] == pytest.approx(8 * base["optimizer"], rel=1e-6)  # sharded over DP 8
    none = estimate_memory(sat, Layout(), recompute=None, **kw)["activations"]
    assert base["activations"] < none < 1.01 * base["activations"]  # bf16 flash attention: only its statistics
    fp32 = {r: estimate_memory(sat, Layout(), recompute=r, bf16=False, **kw)["activations"] for r in (None, "selective")}
    assert fp32[None] > 2 * fp32["selective"]  # TE's unfused fp32 attention keeps its s x s scores
    full = estimate_memory(sat, Layout(), recompute="full", **kw)["activations"]
    assert full < base["activations"]
    tp2 = estimate_memory(sat, Layout(tp=2, sp=True), **kw)
    assert tp2["activations"] == pytest.approx(base["activations"] / 2, rel=1e-6)
    assert tp2["weights"] < 0.51 * base["weights"]
    one_f_one_b = estimate_memory(make_config("satformer", **dict(PAPER_SCALES["760M"], num_layers=20)),
                                  Layout(pp=4), **kw)
    assert one_f_one_b["in_flight"] == 4  # stage 0 holds PP micro-batches
    inter = estimate_memory(make_config("satformer", **dict(PAPER_SCALES["760M"], num_layers=20)),
                            Layout(pp=4, vpp=5), **kw)
    assert inter["in_flight"] == pytest.approx(4 * (1 + 3 / 20))

    # the baselines' connections: none for the Transformer, more for each extra stream or history
    est = {a: estimate_memory(make_config(a, **PAPER_SCALES["760M"]), Layout(), **kw)
           for a in ("transformer", "denseformer", "muddformer", "hyperconnections")}
    assert est["transformer"]["connections"] == est["transformer"]["history_grads"] == 0
    assert est["transformer"]["total"] < est["denseformer"]["total"] < est["muddformer"]["total"]
    assert 0 < est["denseformer"]["connections"] < est["muddformer"]["connections"]
    assert est["denseformer"]["history_grads"] > 0 == est["hyperconnections"]["history_grads"]
    assert est["hyperconnections"]["weights"] > est["transformer"]["weights"]  # count_parameters' "connections"
    hc = [estimate_memory(make_config("hyperconnections", **PAPER_SCALES["760M"], hc_expansion_rate=n), Layout(), **kw)
          for n in (1, 2, 4, 8)]
    assert all(x["connections"] < y["connections"] for x, y in zip(hc, hc[1:]))
    static = estimate_memory(make_config("hyperconnections", **PAPER_SCALES["760M"], hc_dynamic=False), Layout(), **kw)
    assert static["connections"] < hc[2]["connections"]
    hc_full = estimate_memory(make_config("hyperconnections", **PAPER_SCALES["760M"]), Layout(), recompute="full", **kw)
    assert 0 < hc_full["connections"] < 0.25 * hc[2]["connections"]  # [s, b, n*h] layer inputs + one layer's
    assert estimate_memory(make_config("muddformer", **PAPER_SCALES["760M"]), Layout(), recompute="full",
                           **kw) == est["muddformer"]  # refuses full recompute: sized as selective
    for arch in ("denseformer", "hyperconnections"):  # per token: sequence parallelism shards them all
        sp = estimate_memory(make_config(arch, **PAPER_SCALES["760M"]), Layout(tp=2, sp=True), **kw)
        assert sp["connections"] == pytest.approx(est[arch]["connections"] / 2, rel=1e-6)
        no_sp = estimate_memory(make_config(arch, **PAPER_SCALES["760M"]), Layout(tp=2), **kw)
        assert no_sp["connections"] == pytest.approx(est[arch]["connections"], rel=1e-6)  # replicated over TP
    dense18 = make_config("denseformer", **dict(PAPER_SCALES["760M"], num_layers=18))
    one = estimate_memory(dense18, Layout(), **dict(kw, num_microbatches=1))
    two = estimate_memory(dense18, Layout(pp=2), **dict(kw, num_microbatches=1))
    assert two["connections"] > one["connections"] / 2  # the history crosses the stage boundary
    hc2 = plan_recipe("hyperconnections_760M", ["--hc-expansion-rate", "2"]).memory  # the switches reach the plan
    assert hc2["connections"] < plan_recipe("hyperconnections_760M").memory["connections"]


def _saved_bytes_worker(sizes, seq_length, micro_batch_size, vocab_size, cases):
    """One gloo rank: bytes autograd saves in one forward of each (arch, switches), parameters excluded."""
    import torch

    from megatron_sat.model.config import make_config
    from megatron_sat.model.gpt import build_model
    from megatron_sat.parallel.layout import Layout, initialize
    from megatron_sat.profiling.step_benchmark import SavedBytes

    initialize(Layout())
    tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length), generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, -1)
    out = []
    for arch, switches in cases:
        torch.manual_seed(1234)
        config = make_config(arch, **sizes, **switches, **Layout().config_fields())
        model = build_model(config, vocab_size=vocab_size, max_sequence_length=seq_length, backend="local")[0]
        # step_benchmark.run's activation_bytes also counts the parameters autograd saves (e.g. the Transformer's
        # fused QKV weight, which MUDDFormer replaces by per-call slice copies); here they are marked as seen
        counter = SavedBytes()
        counter.seen.update(p.untyped_storage().data_ptr() for p in model.parameters())
        with counter:
            model(tokens, position_ids, None, labels=tokens).float().mean()
        out.append(counter.bytes)
    return out


@pytest.mark.slow  # a 1-rank launch measuring every case
def test_memory_model_matches_saved_activations():
    """The planner's (baseline - Transformer) activations equal the measured difference in saved bytes (fp32, local
    backend, one micro-batch, no parallelism: one gloo process started by tests/dist_utils.py)."""
    from dist_utils import run_distributed

    from megatron_sat.model.config import make_config
    from megatron_sat.parallel.layout import Layout

    sizes = dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=512)
    s, b, vocab = 64, 2, 256
    cases = [("transformer", {}), ("denseformer", {}), ("muddformer", {}), ("hyperconnections", {}),
             ("hyperconnections", dict(hc_expansion_rate=2, hc_dynamic=False))]
    measured = run_distributed(_saved_bytes_worker, 1, sizes, s, b, vocab, cases, timeout=300)[0]

    def planned(arch, switches):
        m = estimate_memory(make_config(arch, **sizes, **switches), Layout(), dp=1, micro_batch_size=b,
                            num_microbatches=1, seq_length=s, vocab_size=vocab, activation_bytes=4, backend="local")
        return (m["activations"] + m["connections"]) * 2**30  # history_grads are not saved tensors

    base = planned(*cases[0])
    for (arch, switches), got in zip(cases[1:], measured[1:]):
        extra, want = got - measured[0], planned(arch, switches) - base
        # the formulas count these tensors exactly (to the byte at these sizes); 2% leaves room for small
        # Megatron-internal changes, while one missed [s, b, h] per layer is 3% (Hyper-Connections, dynamic) to
        # 100% (DenseFormer) of a difference
        assert want == pytest.approx(extra, rel=0.02), (arch, switches, extra, want)


def test_run_names_follow_the_hyperparameters():
    _, name = resolve("satformer_760M")
    assert name == "satformer_760M_lr0.001_gbs512_seq4096_it9537_s1234"
    assert resolve("satformer_760M", ["--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                                      "--save-interval", "100"])[1] == name  # layout/cadence: same run
    assert resolve("satformer_760M", ["--seed", "7", "--lr", "2e-3"])[1] == \
        "satformer_760M_lr0.002_gbs512_seq4096_it9537_s7"
    gated = resolve("satformer_760M", ["--value-residual-gate", "sigmoid"])[1]
    assert re.fullmatch(name + r"_[0-9a-f]{8}", gated)
    out = _tool("tools/submit_grid.py", "--resolve", "debug_resformer", "--", "--train-iters", "7")
    assert "TRAIN_ITERS=7" in out and "NEEDS_DATA=0" in out
    assert "NEEDS_DATA=1" in _tool("tools/submit_grid.py", "--resolve", "satformer_130M")


# run-folder names as tools/submit_grid.py gave them before the flags carried their names_run tag (its hand-kept
# NAME_IGNORES list): a resumed run finds its folder only while these stay the same
PINNED_NAMES = [
    ("satformer_760M", (), "satformer_760M_lr0.001_gbs512_seq4096_it9537_s1234"),
    ("satformer_760M", ("--value-residual-gate", "sigmoid"), "satformer_760M_lr0.001_gbs512_seq4096_it9537_s1234_d8269ca7"),
    ("satformer_760M", ("--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--save-interval", "100",
                        "--data-path", "d/x", "--tokenizer-model", "tok", "--wandb-mode", "offline", "--eval-interval",
                        "50", "--recompute-granularity", "full", "--bf16"),
     "satformer_760M_lr0.001_gbs512_seq4096_it9537_s1234"),
    ("transformer_1.3B", ("--seed", "3"), "transformer_1.3B_lr0.0005_gbs512_seq4096_it14306_s3"),
    ("hyperconnections_130M", ("--transformer-impl", "local"),
     "hyperconnections_130M_lr0.002_gbs512_seq4096_it2385_s1234_c7e53e3a"),
    ("resformer_340M", ("--context-parallel-size", "2", "--recompute-method", "block"),
     "resformer_340M_lr0.0015_gbs512_seq4096_it4769_s1234_ee2f1674"),
    ("muddformer_130M", ("--eval-tasks", "lambada_openai", "--lr", "3e-4", "--train-iters", "100"),
     "muddformer_130M_lr0.0003_gbs512_seq4096_it100_s1234_f13c574a"),
    ("debug_satformer", (), "debug_satformer_lr0.003_gbs8_seq32_it20_s1234"),
    ("debug_transformer", ("--train-iters", "7", "--mock-data", "--vocab-size", "512"),
     "debug_transformer_lr0.003_gbs8_seq32_it7_s1234_4bafd21c"),
    ("debug_resformer", ("--finetune", "--no-load-optim"), "debug_resformer_lr0.003_gbs8_seq32_it20_s1234_4ad37df8"),
    ("denseformer_760M", ("--embedded-data", "emb", "--seq-length", "1024", "--global-batch-size", "64"),
     "denseformer_760M_lr0.001_gbs64_seq1024_it9537_s1234_e39f660b"),
    ("satformer_130M", ("--data-args-path", "args.txt", "--tokenizer-type", "HuggingFaceTokenizer"),
     "satformer_130M_lr0.002_gbs512_seq4096_it2385_s1234_e66ddc95"),
]


def test_run_names_are_unchanged():
    got = [(recipe, flags, resolve(recipe, list(flags))[1]) for recipe, flags, _ in PINNED_NAMES]
    assert got == PINNED_NAMES


def _other_value(action, value) -> list:
    """Command-line words that give `action` a value other than `value`."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [action.option_strings[1] if value else flag]
    if action.nargs == 0:  # store_true / store_false / store_const
        assert value != action.const, f"{flag}: the recipe already gives its switch's value"
        return [flag]
    if action.choices:
        return [flag, next(str(c) for c in action.choices if c != value)]
    if action.type is int and (isinstance(action.nargs, int) or action.nargs == "+"):  # numbers (--rampup-batch-size)
        return [flag, *[str(v + 3) for v in (value or [0] * (action.nargs if isinstance(action.nargs, int) else 1))]]
    if action.type in (int, float):
        return [flag, str((value or 0) + 3)]
    return [flag, "other/x"]  # strings, paths, lists (nargs *, append)


def test_every_flag_is_tagged_and_its_tag_holds(tmp_path):
    """Each trainer flag says whether it names a run (training/arguments.py _group, names_run): a flag declared
    without the tag fails here. And the tag holds: another value of a naming flag gives another run folder, of any
    other flag the same one (the recipe itself is the name's prefix). --config's value is a path: another path
    to a file that sets nothing new is the same run (its contents: tests/test_resolver.py)."""
    recipe = "debug_satformer"
    base_args, base = resolve(recipe)
    (tmp_path / "same.yaml").write_text("seed: 1234\n")
    untagged, wrong = [], []
    for action in build_parser()._actions:
        if action.dest in ("help", "recipe"):
            continue
        if not isinstance(getattr(action, "names_run", None), bool):
            untagged.append(action.option_strings[0])
            continue
        if action.choices is not None and len(action.choices) == 1:  # one value (--optimizer adam): no other
            if action.names_run:                                        # value to name another run with
                wrong.append(f"{action.option_strings[0]} (names_run=True with its one value)")
            continue
        special = {"config": ["--config", str(tmp_path / "same.yaml")],
                   "train_samples": ["--train-samples", "80"]}  # the trainer refuses less than one global batch
        other = special.get(action.dest) or _other_value(action, getattr(base_args, action.dest))
        before = base
        if action.dest == "rampup_batch_size":  # a ramp-up needs --train-samples (Megatron-LM's rule): compare with it
            gbs = base_args.global_batch_size
            other = ["--train-samples", "80", "--rampup-batch-size", "1", str(max(gbs - 1, 1)), "16"]
            before = resolve(recipe, other[:2])[1]
        if action.dest in ("data_path", "train_data_path"):  # a dataset replaces the recipe's mock data (a new run,
            before = resolve(recipe, [other[0], "a/x"])[1]     # mock_data names it): compare two datasets
        changed = resolve(recipe, other)[1] != before
        if changed != action.names_run:
            wrong.append(f"{action.option_strings[0]} (names_run={action.names_run}, name changed: {changed})")
    assert not untagged, (f"flags without a names_run tag: {untagged}; declare them through the argument groups of "
                          "training/arguments.py (_group), with names_run=False if they do not change what a run "
                          "computes")
    assert not wrong, wrong


def test_plan_layout_cli(capsys):
    """The tool as run (one process), then its main() for the other recipes: a process each would spend 5 s
    importing torch and megatron-core, which this test's process has already."""
    from megatron_sat_tools import plan_layout

    def plan(*args, expect=0):
        capsys.readouterr()
        assert plan_layout.main(list(args)) == expect
        return capsys.readouterr().out

    out = _tool("tools/plan_layout.py", "--recipe", "satformer_1.3B")
    assert "TP1xPP1xDP32" in out and "status    OK" in out and "GPU hours" in out
    assert plan("--recipe", "satformer_1.3B") == out  # main() prints what the tool prints
    out = plan("--recipe", "satformer_1.3B", "--nodes", "1", "--micro-batch-size", "16", expect=1)
    assert "exceeds 90%" in out
    assert "note" not in plan("--recipe", "satformer_760M")
    for recipe in ("muddformer_760M", "hyperconnections_1.3B"):
        out = plan("--recipe", recipe)
        assert "status    OK" in out and "GPU hours" in out
        assert f"memory counts {recipe.split('_')[0]}'s extra activations" in out and "connections" in out
    out = plan("--recipe", "denseformer_130M", "--recompute-granularity", "full", expect=1)
    assert "--recompute-granularity full is not supported for --arch denseformer" in out


def test_submit_grid_dry_run_prints_table_and_sbatch_lines():
    out = _tool("tools/submit_grid.py", "--dry-run", "--seeds", "1,2", "--segments", "2")
    rows = [line for line in out.splitlines()
            if re.match(r"(transformer|resformer|satformer|denseformer|muddformer|hyperconnections)_", line)]
    assert len(rows) == 48  # 6 archs x 4 scales x 2 seeds
    sbatch = [line for line in out.splitlines() if line.startswith("sbatch ")]
    assert len(sbatch) == 8  # one array per scale, 2 chained segments each
    assert all("slurm/array.sbatch" in s and "--array=0-11" in s and "--gpus-per-node=8" in s for s in sbatch)
    assert sum("--dependency=afterany:" in s for s in sbatch) == 4
    assert all("MSAT_REQUEUE=0" in s for s in sbatch)
    assert "--nodes=4" in sbatch[-1] and "GPU hours in all" in out
    assert "mem GiB counts the extra activations of denseformer, hyperconnections, muddformer" in out


def test_sbatch_scripts():
    for script in ("train.sbatch", "array.sbatch", "profile.sbatch", "launch.sh", "site.sh"):
        subprocess.run(["bash", "-n", os.path.join(ROOT, "slurm", script)], check=True)
    train = open(os.path.join(ROOT, "slurm", "train.sbatch")).read()
    array = open(os.path.join(ROOT, "slurm", "array.sbatch")).read()
    for text in (train, array):
        assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@" in text
        assert "#SBATCH --open-mode=append" in text
    assert "#SBATCH --output=logs/%x-%j.out" in train and "#SBATCH --output=logs/%x-%A_%a.out" in array


@pytest.mark.slow  # a trainer run
def test_paper_recipe_trains_through_the_trainer(tmp_path):
    """A paper recipe, shrunk, through the trainer's command line (CPU, mock data, 2 steps)."""
    shrink = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "4",
              "--ffn-hidden-size", "128", "--seq-length", "32", "--global-batch-size", "4", "--micro-batch-size", "2",
              "--vocab-size", "256", "--train-iters", "2", "--lr-warmup-iters", "1", "--log-interval", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "megatron_sat.train", "--recipe", "resformer_340M", "--mock-data", *shrink,
                           "--save", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    config = json.load(open(tmp_path / "config.json"))
    assert (config["recipe"], config["arch"], config["lr"], config["recompute_granularity"]) == \
        ("resformer_340M", "resformer", 1.5e-3, "selective")
    assert (tmp_path / "iter_0000002").is_dir()


# ---------------------------------------------------------------------------------------------------------------
# the paper recipes train the way the authors trained (issue 17)
# ---------------------------------------------------------------------------------------------------------------

def test_paper_recipes_follow_the_authors():
    for name in paper.GRID:
        r = recipes.get(name)
        scale = name.rsplit("_", 1)[1]
        assert (r["weight_decay_params"], r["output_layer_init"]) == ("all", "unscaled"), name
        assert (r["split"], r["eval_interval"]) == ("99.5,0.5,0", 500), name
        assert r["eval_samples"] == {"130M": 6400, "340M": 3200, "760M": 1600, "1.3B": 800}[scale], name
    args = parse_args(["--recipe", "satformer_130M", "--mock-data", "--vocab-size", "64"])
    assert (args.weight_decay_params, args.output_layer_init) == ("all", "unscaled")
    defaults = parse_args(["--arch", "satformer", "--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32",
                           "--num-attention-heads", "2", "--train-iters", "2"])  # Megatron's behaviour is the default
    assert (defaults.weight_decay_params, defaults.output_layer_init) == ("matrices", "scaled")


def test_a_data_source_on_the_command_line_replaces_the_recipes():
    args = parse_args(["--recipe", "debug_satformer", "--embedded-data", "/tmp/corpus"])
    assert (args.mock_data, args.embedded_data, args.vocab_size) == (False, "/tmp/corpus", None)
    args = parse_args(["--recipe", "debug_satformer", "--embedded-data", "/tmp/corpus", "--vocab-size", "512"])
    assert args.vocab_size == 512
    assert parse_args(["--recipe", "debug_satformer"]).mock_data is True


@pytest.fixture(scope="module")
def fidelity(tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity") / "r.json"
    _tool(os.path.join(ROOT, "tests", "workers", "recipe_fidelity.py"), str(out))
    import json

    return json.loads(out.read_text())


def test_weight_decay_groups_under_both_settings(fidelity):
    for arch in ("transformer", "resformer", "satformer", "denseformer", "muddformer", "hyperconnections"):
        every = fidelity[f"{arch}/all"]
        assert all(p["wd_mult"] == 1.0 for p in every.values()), {n for n, p in every.items() if p["wd_mult"] != 1}
        megatron = fidelity[f"{arch}/matrices"]
        assert {n for n, p in megatron.items() if p["wd_mult"] == 0.0} == {n for n, p in megatron.items()
                                                                             if p["ndim"] == 1}
        assert any(p["ndim"] == 1 for p in every.values())  # norms at least: the check above saw 1-D tensors
    own = {"resformer": "lambda", "denseformer": "", "hyperconnections": "hc", "muddformer": ""}
    for arch, word in own.items():  # the arch's own 1-D weights are among the decayed ones under `all`
        names = [n for n, p in fidelity[f"{arch}/all"].items() if p["ndim"] == 1 and word in n
                 and "layernorm" not in n and "norm.weight" not in n]
        assert names, arch


def test_output_projection_init_under_both_settings(fidelity):
    for arch in ("transformer", "resformer", "satformer", "denseformer", "muddformer", "hyperconnections"):
        scaled, unscaled = fidelity[f"{arch}/scaled"], fidelity[f"{arch}/unscaled"]
        want_scaled = scaled["expected_scaled"] / (2.0 if arch == "hyperconnections" else 1.0)  # / sqrt(n = 4)
        for name, std in scaled["stds"].items():
            want = 0.02 if "linear_qkv" in name else want_scaled
            assert std == pytest.approx(want, rel=0.05), (arch, "scaled", name)
        for name, std in unscaled["stds"].items():
            assert std == pytest.approx(0.02, rel=0.05), (arch, "unscaled", name)
