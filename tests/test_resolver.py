"""One resolver: every tool that reasons about a run (the Slurm sweep and its --resolve, the planner, the dry run,
the throughput profiler, the monitor) resolves its arguments as the trainer does (training/arguments.py:
recipe < --config < command line, then --train-samples and --lr-warmup-fraction). Checked against the trainer's own
--print-config and parse_args on a table of inputs; the run name follows a config file's contents, not its path.

    .venv/bin/python -m pytest -q tests/test_resolver.py        # a few seconds
"""

import importlib.util
import os

import pytest
import yaml

from megatron_sat.profiling import settings as profiler_settings
from megatron_sat.sweep.plan import resolve
from megatron_sat.training import planner
from megatron_sat.training.arguments import build_parser, parse_args, parse_run, recipe_args
from megatron_sat.training.config_file import config_dict
from megatron_sat.training.monitor import scale_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "debug_satformer"  # 4 x 64, 20 steps, global batch 8, warmup 2, mock data
FILES = {
    "over_recipe.yaml": "train-iters: 40\nhidden-size: 96\nlr: 0.002\n",  # over the recipe: more steps, a new shape
    "alone.yaml": "num-layers: 2\nhidden-size: 64\nnum-attention-heads: 4\ntrain-iters: 12\nmock-data: true\n"
                  "vocab-size: 256\nglobal-batch-size: 4\nmicro-batch-size: 2\n",  # a whole run, no recipe
    "samples.yaml": "train-samples: 96\n",  # sample-based length over the recipe's steps
}
# (recipe, trainer flags); {name} is the path of FILES["name.yaml"]
CASES = [
    (RECIPE, []),
    (RECIPE, ["--seed", "7", "--lr", "0.01"]),
    (RECIPE, ["--config", "{over_recipe}"]),
    (RECIPE, ["--config", "{over_recipe}", "--train-iters", "30"]),
    (None, ["--config", "{alone}"]),
    (None, ["--config", "{alone}", "--hidden-size", "128"]),
    (RECIPE, ["--train-samples", "80"]),
    (RECIPE, ["--config", "{over_recipe}", "--train-samples", "200"]),  # the command line's length wins
    (RECIPE, ["--config", "{samples}"]),
    (RECIPE, ["--config", "{samples}", "--train-iters", "5"]),
    (RECIPE, ["--lr-warmup-fraction", "0.25"]),
    (None, ["--config", "{alone}", "--lr-warmup-fraction", "0.5", "--train-samples", "40"]),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("configs")
    for name, text in FILES.items():
        (folder / name).write_text(text)
    return {name.split(".")[0]: str(folder / name) for name in FILES}


def _submit_grid():
    spec = importlib.util.spec_from_file_location("submit_grid_tool", os.path.join(ROOT, "tools", "submit_grid.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trainer(argv, capsys):
    """The trainer on `argv`: (its --print-config as a dict, the arguments it trains with)."""
    with pytest.raises(SystemExit) as done:
        parse_args(argv + ["--print-config"])
    assert done.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    return printed, parse_args(argv)


@pytest.mark.parametrize("recipe, flags", CASES, ids=[" ".join([r or "-", *f]) for r, f in CASES])
def test_every_tool_resolves_as_the_trainer(recipe, flags, files, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the trainer's default run folder (runs/...) is checked on disk: a fresh one
    for var in ("WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    flags = [f.format(**files) for f in flags]
    argv = (["--recipe", recipe] if recipe else []) + flags
    printed, trained = _trainer(argv, capsys)
    parser = build_parser()

    # the resolver every tool calls, and the sweep's run resolution (its name, and TRAIN_ITERS of launch.sh)
    assert config_dict(recipe_args(recipe, flags), parser) == printed
    swept, name = resolve(recipe, flags)
    assert config_dict(swept, parser) == printed
    assert swept.train_iters == trained.train_iters and f"_it{trained.train_iters}_" in name
    assert ":" not in name and "/" not in name
    if recipe:  # submit_grid --resolve, what slurm/launch.sh reads at every job start
        assert _submit_grid().main(["--resolve", recipe, "--", *flags]) == 0
        out = dict(line.split("=", 1) for line in capsys.readouterr().out.split())
        assert (out["RUN_NAME"], int(out["TRAIN_ITERS"]), out["NEEDS_DATA"]) == (name, trained.train_iters, "0")

    # the planner (plan-layout, and the sweep's table) sizes what the trainer trains
    plan = planner.plan_recipe(recipe, flags)
    assert (plan.train_iters, plan.warmup_iters, plan.lr, plan.global_batch_size, plan.seq_length) == \
        (trained.train_iters, trained.lr_warmup_iters, trained.lr, trained.global_batch_size, trained.seq_length)
    assert plan.parameters == planner.make_plan(trained, recipe=recipe or "none", nodes=plan.nodes,
                                                gpus_per_node=plan.gpus_per_node, gpu=plan.gpu).parameters

    # the monitor's scale: the recipe's when the run kept its shape, else the shape (from the sources the trainer
    # records in config.json)
    record = dict(vars(trained), **parse_run(argv).record())
    kept = recipe and all(record[k] == getattr(recipe_args(recipe), k) for k in ("num_layers", "hidden_size"))
    assert scale_name(record) == ("debug" if kept else f"{trained.num_layers}x{trained.hidden_size}")

    # the throughput profiler takes the recipe and the config file (its own flags for the rest; its own defaults
    # where both are silent, e.g. lr and seq-length for alone.yaml)
    configs = [f for i, f in enumerate(flags) if i and flags[i - 1] == "--config"]
    if flags == (["--config", configs[0]] if configs else []):
        options = _profiler_parser().parse_args((["--recipe", recipe] if recipe else []) + flags + ["--nproc", "1"])
        spec = profiler_settings.resolve(options)
        for key in ("num_layers", "hidden_size", "num_attention_heads", "micro_batch_size", "arch"):
            assert spec["arguments"][key] == getattr(trained, key), key


def _profiler_parser():
    spec = importlib.util.spec_from_file_location("profile_tool", os.path.join(ROOT, "tools", "profile_throughput.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def test_run_name_follows_the_config_files_contents_not_its_path(tmp_path):
    text = FILES["over_recipe.yaml"]
    for folder in ("a", "b/c"):
        os.makedirs(tmp_path / folder)
    (tmp_path / "a" / "exp.yaml").write_text(text)
    (tmp_path / "b" / "c" / "moved.yml").write_text(text)
    first = resolve(RECIPE, ["--config", str(tmp_path / "a" / "exp.yaml")])[1]
    assert resolve(RECIPE, ["--config", str(tmp_path / "b" / "c" / "moved.yml")])[1] == first  # moved: same run
    assert resolve(RECIPE, ["--train-iters", "40", "--hidden-size", "96", "--lr", "0.002"])[1] == first  # as flags
    (tmp_path / "a" / "exp.yaml").write_text(text.replace("hidden-size: 96", "hidden-size: 128"))
    edited = resolve(RECIPE, ["--config", str(tmp_path / "a" / "exp.yaml")])[1]
    assert edited != first and edited.startswith("debug_satformer_lr0.002_gbs8_seq32_it40_s1234_")
    (tmp_path / "a" / "exp.yaml").write_text(text.replace("train-iters: 40", "train-iters: 50"))
    assert "_it50_" in resolve(RECIPE, ["--config", str(tmp_path / "a" / "exp.yaml")])[1]
    # a config file alone: named `run`, by every value it sets
    (tmp_path / "alone.yaml").write_text(FILES["alone.yaml"])
    alone = resolve(None, ["--config", str(tmp_path / "alone.yaml")])[1]
    assert alone.startswith("run_lr0.001_gbs4_seq32_it12_s1234_")
    (tmp_path / "alone.yaml").write_text(FILES["alone.yaml"].replace("num-layers: 2", "num-layers: 3"))
    assert resolve(None, ["--config", str(tmp_path / "alone.yaml")])[1] != alone


def test_external_recipes_name_folders_by_their_function(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("exps")
    body = ("def tiny_lr():\n    return dict(num_layers=2, hidden_size=32, num_attention_heads=2, train_iters=6, "
            "mock_data=True, vocab_size=128, lr={lr})\n")
    (tmp_path / "exps" / "myrec.py").write_text(body.format(lr=0.01))
    (tmp_path / "exps" / "other.py").write_text(body.format(lr=0.01))
    (tmp_path / "exps" / "faster.py").write_text(body.format(lr=0.02))
    args, name = resolve("exps/myrec.py:tiny_lr")
    assert name.startswith("tiny_lr_lr0.01_gbs8_seq32_it6_s1234_") and ":" not in name and "/" not in name
    assert args.save == os.path.join("runs", "tiny_lr")  # the trainer's default folder: docs/ecosystem.md
    assert resolve("exps/other.py:tiny_lr")[1] == name  # the same values under another file: the same run
    assert resolve("exps/faster.py:tiny_lr")[1] == name.replace("lr0.01", "lr0.02")
    monkeypatch.syspath_prepend(str(tmp_path / "exps"))
    assert resolve("myrec:tiny_lr")[1] == name


def test_tools_refuse_what_the_trainer_refuses(tmp_path):
    (tmp_path / "bad.yaml").write_text("hiden-size: 3\n")
    for recipe, flags, message in [
        (None, [], "missing --num-layers"),
        (RECIPE, ["--config", str(tmp_path / "none.yaml")], "is not a file"),
        (RECIPE, ["--config", str(tmp_path / "bad.yaml")], "unknown argument(s) hiden-size"),
        (RECIPE, ["--train-samples", "4"], "less than one global batch"),
        (RECIPE, ["--train-samples", "80", "--train-iters", "3"], "not both"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            resolve(recipe, flags)
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            planner.plan_recipe(recipe, flags)


def test_the_resolver_says_where_each_value_came_from(files):
    """resolve_layers: recipe < config file < flag, and each value's source; the layers' own values as they said
    them (a flag over the config file over the recipe)."""
    from megatron_sat.training.arguments import resolve_layers

    r = resolve_layers(RECIPE, ["--config", files["over_recipe"], "--train-iters", "30", "--seed", "7"])
    assert (r.args.num_layers, r.args.hidden_size, r.args.lr, r.args.train_iters, r.args.seed) == (4, 96, 0.002, 30, 7)
    assert (r.sources["num_layers"], r.sources["hidden_size"], r.sources["lr"]) == ("recipe", "config", "config")
    assert (r.sources["train_iters"], r.sources["seed"], r.sources["weight_decay"]) == ("flag", "flag", "recipe")
    assert r.sources["tensor_model_parallel_size"] == "default" and r.args.tensor_model_parallel_size == 1
    assert (r.recipe["hidden_size"], r.config["hidden_size"], r.config["train_iters"]) == (64, 96, 40)
    assert r.defaults["train_iters"] == build_parser().get_default("train_iters")
    assert r.given("config") == {"hidden_size": 96, "lr": 0.002}  # train_iters: the flag's
    alone = resolve_layers(None, ["--config", files["alone"], "--hidden-size", "128"])
    assert (alone.sources["num_layers"], alone.sources["hidden_size"], alone.recipe) == ("config", "flag", {})


def test_a_null_in_a_config_file_is_not_given(tmp_path, files, capsys, monkeypatch):
    """A config file's null is "not given" (as if the key were absent): under a recipe the recipe's value stands
    (not None, which crashed later with a TypeError), a flag still overrides it, and without a recipe a required
    shape flag set to null is missing, refused in one line like an absent one. Its non-null neighbour is given."""
    from megatron_sat.training.arguments import resolve_layers

    monkeypatch.chdir(tmp_path)
    (tmp_path / "nulls.yaml").write_text("hidden-size: null\nlr: null\nnorm-epsilon: null\ntrain-iters: 30\n")
    r = resolve_layers(RECIPE, ["--config", str(tmp_path / "nulls.yaml")])
    recipe = recipe_args(RECIPE)
    assert (r.args.hidden_size, r.args.lr, r.args.layernorm_epsilon, r.args.train_iters) == \
        (recipe.hidden_size, recipe.lr, recipe.layernorm_epsilon, 30)
    assert (r.sources["hidden_size"], r.sources["lr"], r.sources["train_iters"]) == ("recipe", "recipe", "config")
    assert r.config == {"train_iters": 30}
    flagged = resolve_layers(RECIPE, ["--config", str(tmp_path / "nulls.yaml"), "--hidden-size", "128"])
    assert (flagged.args.hidden_size, flagged.sources["hidden_size"]) == (128, "flag")
    printed, trained = _trainer(["--recipe", RECIPE, "--config", str(tmp_path / "nulls.yaml")], capsys)
    assert (printed["hidden_size"], trained.hidden_size, trained.lr) == (recipe.hidden_size, recipe.hidden_size,
                                                                         recipe.lr)

    (tmp_path / "alone_null.yaml").write_text(open(files["alone"]).read().replace("hidden-size: 64",
                                                                                   "hidden-size: null"))
    with pytest.raises(ValueError, match="missing --hidden-size"):
        resolve(None, ["--config", str(tmp_path / "alone_null.yaml")])
    assert resolve(None, ["--config", files["alone"]])[0].hidden_size == 64  # given: accepted
    (tmp_path / "typo_null.yaml").write_text("hiden-size: null\n")  # an unknown key is unknown, null or not
    with pytest.raises(ValueError, match="unknown argument"):
        resolve(RECIPE, ["--config", str(tmp_path / "typo_null.yaml")])


def test_scale_label_reads_the_recorded_sources(tmp_path, monkeypatch):
    """monitor.scale_name names a run by what its config.json recorded of the resolution (arguments.Resolution.record:
    "sources" and "recipe_values"), not by the recipe as this checkout defines it: a recipe whose shape changed
    after the run keeps the run's label, a flag repeating the recipe's value keeps it too, another value names the
    shape."""
    monkeypatch.chdir(tmp_path)
    for var in ("WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)

    def record(*flags):
        run = parse_run(["--recipe", RECIPE, *flags])
        return dict(vars(run.args), **run.record())

    kept = record("--seed", "3")
    assert kept["sources"]["num_layers"] == "recipe" and kept["sources"]["seed"] == "flag"
    assert kept["recipe_values"]["num_layers"] == 4 and "default" not in kept["sources"].values()
    assert scale_name(kept) == "debug"
    # the run was made when the recipe said 8 layers (the recipe has changed since): the run kept its recipe's shape
    older = dict(kept, num_layers=8, recipe_values=dict(kept["recipe_values"], num_layers=8))
    assert scale_name(older) == "debug"
    assert scale_name(record("--num-layers", "4")) == "debug"  # the recipe's own value, given again
    assert scale_name(record("--num-layers", "2")) == "2x64"
    (tmp_path / "shape.yaml").write_text("hidden-size: 96\n")
    assert scale_name(record("--config", str(tmp_path / "shape.yaml"))) == "4x96"
    # a config.json written before the sources were recorded: named by its recipe
    assert scale_name({k: v for k, v in older.items() if k not in ("sources", "recipe_values")}) == "debug"
