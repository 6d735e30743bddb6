"""Each check of training/argument_checks.py at its edges, called directly (no launch, no subprocess): the value on
the accepted side passes, one step over is refused with exactly its line, in the order the trainer prints them.
tests/test_refusals.py holds the Megatron-LM flags' tables and the one-line refusal of the trainer's parse_args; this
file the rest of the module: the split, a blend, the folders, the data paths, --eval-tasks, the precision against
the target, the model's sizes, the world size, and argument_errors' own checks. Mutation testing runs it
(pyproject.toml's [tool.mutmut] selection; docs/development.md): a check moved one step, turned or switched off
fails a row here.

    .venv/bin/python -m pytest -q tests/test_argument_edges.py        # a few seconds
"""

import argparse
import json
import os

import pytest
from venv_without import run as run_in
from venv_without import venv_without

from megatron_sat.training import argument_checks as checks
from megatron_sat.training.arguments import parse_args
from megatron_sat.training.run_folder import TRACKER

TINY = ["--arch", "satformer", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--train-iters", "2", "--global-batch-size", "2", "--mock-data", "--vocab-size", "64"]
DROP = object()  # a value that removes the attribute (a namespace written before the flag existed)


def base(tmp_path) -> argparse.Namespace:
    """TINY resolved, --save a new folder (micro batch 2, --seq-length 32, --lr 1e-3, --min-lr 0, no warm-up)."""
    return parse_args([*TINY, "--save", str(tmp_path / "r")])


def at(args: argparse.Namespace, values: dict, **paths) -> argparse.Namespace:
    """A copy of args with values set ({name} in a string value replaced by paths[name]; DROP removes one)."""
    out = dict(vars(args))
    for k, v in values.items():
        if v is DROP:
            out.pop(k)
        else:
            out[k] = v.format(**paths) if isinstance(v, str) else [x.format(**paths) for x in v] \
                if isinstance(v, list) else v
    return argparse.Namespace(**out)


# --split: accepted as typed -> the three fractions it parses to; refused -> its line
SPLIT_OK = [("98,2,0", [98.0, 2.0, 0.0]), ("98/2/0", [98.0, 2.0, 0.0]), (" 1 , 2 ", [1.0, 2.0, 0.0]),
            ("1", [1.0, 0.0, 0.0]), ("0.5", [0.5, 0.0, 0.0]), ("0,0,1e-9", [0.0, 0.0, 1e-9]), ("1,2,3", [1.0, 2.0, 3.0])]
NOT_NUMBERS = "--split {!r} must be up to three comma-separated numbers, e.g. 98,2,0"
BAD_NUMBERS = "--split {!r} must be up to three non-negative numbers with a positive sum, e.g. 98,2,0"
SPLIT_REFUSED = [("98,2,x", NOT_NUMBERS), ("", NOT_NUMBERS), ("98,,2", NOT_NUMBERS), ("1,2,3,4", BAD_NUMBERS),
                 ("-1,2", BAD_NUMBERS), ("1,-1e-9", BAD_NUMBERS), ("nan", BAD_NUMBERS), ("1,nan", BAD_NUMBERS),
                 ("0,0,0", BAD_NUMBERS), ("0", BAD_NUMBERS)]


@pytest.mark.parametrize("split, parsed", SPLIT_OK)
def test_a_split_parses_to_three_fractions(split, parsed):
    assert checks.parse_split(split) == parsed


@pytest.mark.parametrize("split, line", SPLIT_REFUSED, ids=[row[0] or "empty" for row in SPLIT_REFUSED])
def test_a_bad_split_is_refused_with_its_line(tmp_path, split, line):
    with pytest.raises(ValueError) as e:
        checks.parse_split(split)
    assert str(e.value) == line.format(split)
    assert checks.argument_errors(at(base(tmp_path), dict(split=split)), 1, inputs=False) == [line.format(split)]


def test_a_refusal_is_one_line_and_problems_reads_it_back():
    """refusal folds each problem onto one line and numbers them; problems is its inverse."""
    layout = "invalid parallel layout TP2:\n  heads  4\n\n  layers 3\nseen:\n x"
    assert checks.refusal("prog", ["one"]) == "prog: error: one"
    assert checks.refusal("prog", [layout]) == "prog: error: invalid parallel layout TP2: heads 4, layers 3, seen: x"
    assert checks.refusal("prog", ["\n  \n"]) == "prog: error: "
    line = checks.refusal("prog", ["a: b", layout, "ends in X"])
    assert line == ("prog: error: 3 problems: (1) a: b; (2) invalid parallel layout TP2: heads 4, layers 3, seen: x; "
                    "(3) ends in X")
    assert checks.problems(line + "\n") == ["a: b", "invalid parallel layout TP2: heads 4, layers 3, seen: x",
                                            "ends in X"]
    assert checks.problems("prog: error: one\n") == ["one"]
    assert checks.problems("prog: error: a: error: b") == ["a: error: b"]
    assert checks.problems(checks.refusal("prog", [f"p{i}" for i in range(1, 12)])) == [f"p{i}" for i in range(1, 12)]


def test_numbers_and_paths():
    """_is_number tells a blend's weights from its prefixes; same_path compares resolved folders; data_spec is what
    the trainer reads."""
    assert all(checks._is_number(x) for x in ("1", "-2.5e3", "nan", "inf", " 0.5 "))
    assert not any(checks._is_number(x) for x in ("a", "", "1,2", "data/1"))
    assert checks.same_path("a/b", "a/c/../b") and not checks.same_path("a/b", "a/c")
    blend = argparse.Namespace(data_path=["1", "a", "2 b"], train_data_path=None)
    assert checks.data_spec(blend) == "1 a 2 b"
    split = argparse.Namespace(data_path=None, train_data_path=["1 a", "2 b"], valid_data_path=None,
                               test_data_path=[])
    assert checks.data_spec(split) == {"train": "1 a 2 b", "valid": None, "test": None}


def test_unwritable_folder_is_the_nearest_existing_one(tmp_path, monkeypatch):
    """A folder to be made is writable when its nearest existing parent is; a file in the way is not (root too: a file
    with no execute bit fails os.X_OK); /proc/sys is a read-only mount in most containers."""
    (tmp_path / "file").write_text("x")
    assert checks.unwritable_folder(str(tmp_path / "new" / "deeper")) is None
    assert checks.unwritable_folder(str(tmp_path)) is None
    assert checks.unwritable_folder(str(tmp_path / "file" / "sub")) == str(tmp_path / "file")
    monkeypatch.chdir(tmp_path)
    assert checks.unwritable_folder("new/deeper") is None
    assert checks.unwritable_folder("file/sub") == str(tmp_path / "file")
    if os.access("/proc/sys", os.W_OK | os.X_OK):
        pytest.skip("/proc/sys is writable here")
    assert checks.unwritable_folder("/proc/sys/megatron_sat/none") == "/proc/sys"


# A blend's weights and empty .bin files (blend_errors): {full} holds bytes, {empty} a 0-byte .bin
BLEND_OK = [["{full}"], ["1e-300 {full} 2 {full}"], ["0.5", "{full}", "0.5", "{full}"], ["{full} {full}"],
            ["1 {full} 2"], ["{missing}"], ["0 {full} 1"]]
WEIGHTS = "--data-path: blend weights must be finite numbers > 0, got {}: write it as 'w1 prefix1 w2 prefix2 ...'"
EMPTY = ("--data-path: {empty}.bin is empty: the dataset {empty} holds no documents. Remove it from --data-path, or "
         "re-run tools/preprocess_data.py on inputs that hold text")
BLEND_REFUSED = [(["0 {full} 1 {full}"], [WEIGHTS.format("0 1")]), (["1 {full} inf {full}"], [WEIGHTS.format("1 inf")]),
                 (["nan {full}"], [WEIGHTS.format("nan")]), (["-1e-9", "{full}"], [WEIGHTS.format("-1e-9")]),
                 (["0.5 {empty} 0.5 {full}"], [EMPTY]), (["{empty}"], [EMPTY]),
                 (["0 {empty}"], [WEIGHTS.format("0"), EMPTY])]


def datasets(tmp_path) -> dict:
    """{full}: a .bin with bytes and an .idx; {empty}: a 0-byte .bin; {half}: a .bin alone; {idxonly}: an .idx alone;
    {missing}: nothing."""
    paths = {k: str(tmp_path / k) for k in ("full", "empty", "half", "idxonly", "missing")}
    for name, files in (("full", {".bin": "x", ".idx": "i"}), ("empty", {".bin": "", ".idx": "i"}),
                        ("half", {".bin": "x"}), ("idxonly", {".idx": "i"})):
        for ext, text in files.items():
            with open(paths[name] + ext, "w") as f:
                f.write(text)
    return paths


@pytest.mark.parametrize("value", BLEND_OK)
def test_a_blend_accepted(tmp_path, value):
    paths = datasets(tmp_path)
    assert checks.blend_errors("--data-path", [v.format(**paths) for v in value]) == []


@pytest.mark.parametrize("value, lines", BLEND_REFUSED)
def test_a_blend_refused_with_its_lines(tmp_path, value, lines):
    paths = datasets(tmp_path)
    assert checks.blend_errors("--data-path", [v.format(**paths) for v in value]) == [x.format(**paths) for x in lines]
    assert checks.blend_errors("--valid-data-path", [v.format(**paths) for v in value]) == [
        x.format(**paths).replace("--data-path", "--valid-data-path") for x in lines]


# The precision and layer implementation against the target (target_errors): (name, values, gpu, te, lines); on
# TINY (--transformer-impl auto, --bf16 unset, no --fp16)
CONTRADICT = "--fp16 and --bf16 contradict: give one"
TE_IMPL = "--transformer-impl transformer_engine needs Transformer Engine on a GPU"
FP8 = "--fp8-format needs Transformer Engine on a GPU"
REDUCE_CLASH = "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict: give one"
REDUCE_BF16 = "--grad-reduce-in-bf16 needs --bf16 (the gradients are in fp32 otherwise)"
TARGET_EDGES = [
    ("fp16 without bf16", dict(fp16=True, bf16=False), None, None, []),
    ("fp16 bf16 unset", dict(fp16=True, bf16=None), True, True, []),
    ("fp16 and bf16", dict(fp16=True, bf16=True), None, None, [CONTRADICT]),
    ("bf16 without fp16 flag", dict(fp16=DROP, bf16=True), True, True, []),
    ("te unknown", dict(transformer_impl="transformer_engine"), None, None, []),
    ("te present", dict(transformer_impl="transformer_engine"), True, True, []),
    ("te absent", dict(transformer_impl="transformer_engine"), True, False, [TE_IMPL]),
    ("local without te", dict(transformer_impl="local"), False, False, []),
    ("fp8 on te", dict(fp8_format="hybrid", transformer_impl="transformer_engine"), True, True, []),
    ("fp8 te unknown", dict(fp8_format="hybrid", transformer_impl="auto"), None, None, []),
    ("fp8 without te", dict(fp8_format="hybrid", transformer_impl="auto"), True, False, [FP8]),
    ("fp8 local", dict(fp8_format="e4m3", transformer_impl="local"), None, None, [FP8]),
    ("fp8 te impl without te", dict(fp8_format="hybrid", transformer_impl="transformer_engine"), True, False,
     [TE_IMPL, FP8]),
    ("reduce clash", dict(grad_reduce_in_bf16=True, accumulate_allreduce_grads_in_fp32=True, bf16=True), True, True,
     [REDUCE_CLASH]),
    ("reduce target unknown", dict(grad_reduce_in_bf16=True), None, None, []),
    ("reduce on gpu", dict(grad_reduce_in_bf16=True), True, None, []),
    ("reduce on cpu", dict(grad_reduce_in_bf16=True), False, False, [REDUCE_BF16]),
    ("reduce no-bf16", dict(grad_reduce_in_bf16=True, bf16=False), None, None, [REDUCE_BF16]),
    ("reduce bf16 on cpu", dict(grad_reduce_in_bf16=True, bf16=True), False, False, []),
    ("reduce bf16 unknown target", dict(grad_reduce_in_bf16=True, bf16=True), None, None, []),
    ("reduce fp16 on gpu", dict(grad_reduce_in_bf16=True, fp16=True), True, True, [REDUCE_BF16]),
    ("accumulate alone", dict(accumulate_allreduce_grads_in_fp32=True), False, False, []),
]


@pytest.mark.parametrize("name, values, gpu, te, lines", TARGET_EDGES, ids=[row[0] for row in TARGET_EDGES])
def test_the_precision_against_the_target(tmp_path, name, values, gpu, te, lines):
    args = at(base(tmp_path), values)
    assert checks.target_errors(args, gpu, te) == lines
    assert checks.argument_errors(args, 1, inputs=False, gpu=gpu, te=te) == lines  # passed on as given


@pytest.mark.parametrize("bf16, fp16, gpu, on", [(None, False, True, True), (None, True, True, False),
                                                 (None, False, False, False), (True, False, False, True),
                                                 (True, True, False, True), (False, False, True, False),
                                                 (None, DROP, True, True)])
def test_bf16_is_on(bf16, fp16, gpu, on):
    """--bf16 / --no-bf16 as given, else on a GPU unless --fp16 (a namespace without fp16: as without --fp16)."""
    values = dict(bf16=bf16) if fp16 is DROP else dict(bf16=bf16, fp16=fp16)
    assert checks.bf16_on(argparse.Namespace(**values), gpu) is on


# The model's sizes (shape_errors) and the world size (world_errors): (name, values, world size, lines) through
# argument_errors (inputs=False)
SIZES = "{}: the model's sizes must be >= 1"
GROUPS = ("--num-attention-heads 4 is not divisible by --num-query-groups 3: each query group (KV head) serves the "
          "same number of heads")
HEAD_DIM = ("--hidden-size 64 is not divisible by --num-attention-heads 3: give sizes that divide, or the head dim as "
            "--kv-channels")
WORLD = "world size {} is not divisible by TP x PP x CP = {} x {} x {}"
SHAPE_EDGES = [
    ("one layer", dict(num_layers=1), 1, []),
    ("no layer", dict(num_layers=0), 1, [SIZES.format("--num-layers 0")]),
    ("no width no heads", dict(hidden_size=0, num_attention_heads=0), 1,
     [SIZES.format("--hidden-size 0, --num-attention-heads 0")]),
    ("ffn", dict(ffn_hidden_size=1), 1, []),
    ("no ffn", dict(ffn_hidden_size=0), 1, [SIZES.format("--ffn-hidden-size 0")]),
    ("no groups", dict(num_query_groups=0), 1, [SIZES.format("--num-query-groups 0")]),
    ("groups divide", dict(num_query_groups=2), 1, []),
    ("groups do not", dict(num_query_groups=3), 1, [GROUPS]),
    ("head dim", dict(num_attention_heads=3, num_query_groups=1), 1, [HEAD_DIM]),
    ("head dim given", dict(num_attention_heads=3, kv_channels=16), 1, []),
    ("tp fits", dict(tensor_model_parallel_size=2, global_batch_size=2, micro_batch_size=1), 2, []),
    ("tp does not", dict(tensor_model_parallel_size=2), 3, [WORLD.format(3, 2, 1, 1)]),
    ("pp does not", dict(pipeline_model_parallel_size=2), 3, [WORLD.format(3, 1, 2, 1)]),
    ("cp does not", dict(context_parallel_size=2), 3, [WORLD.format(3, 1, 1, 2)]),
    ("no tp", dict(tensor_model_parallel_size=0), 2, [WORLD.format(2, 0, 1, 1)]),
    ("no pp", dict(pipeline_model_parallel_size=0), 2, [WORLD.format(2, 1, 0, 1)]),
    ("no cp", dict(context_parallel_size=0), 2, [WORLD.format(2, 1, 1, 0)]),
]


@pytest.mark.parametrize("name, values, world, lines", SHAPE_EDGES, ids=[row[0] for row in SHAPE_EDGES])
def test_the_sizes_and_the_world_at_their_edges(tmp_path, name, values, world, lines):
    args = at(base(tmp_path), values)
    assert checks.argument_errors(args, world, inputs=False) == lines
    assert checks.world_errors(args, world) == [x for x in lines if x.startswith("world size")]


def test_the_arch_refuses_its_own_flags(tmp_path):
    """Each flag arch_flag_errors passes to the arch reaches it."""
    args = base(tmp_path)
    assert checks.arch_flag_errors(args) == []
    assert checks.arch_flag_errors(at(args, dict(arch="hyperconnections", fp8_format="hybrid"))) == [
        "--fp8-format is not supported for the hyperconnections baseline (BF16 only)"]
    assert checks.arch_flag_errors(at(args, dict(arch="hyperconnections", hc_expansion_rate=0))) == [
        "--hc-expansion-rate must be >= 1 (got 0)"]
    assert checks.arch_flag_errors(at(args, dict(arch="denseformer", recompute_granularity="full"))) == [
        "--recompute-granularity full is not supported for --arch denseformer: arch 'denseformer' carries every "
        "earlier layer's output from layer to layer, which full activation recompute cannot checkpoint; use "
        "--recompute-granularity selective"]
    assert checks.arch_flag_errors(at(args, dict(value_residual_gate="gelu"))) == [
        "unknown --value-residual-gate 'gelu'; choose one of relu, sigmoid, tanh, identity, softmax, softmax_sigmoid"]
    assert checks.arch_flag_errors(at(args, dict(arch="resformer", resformer_lambdas="frozen"))) == [
        "unknown --resformer-lambdas 'frozen'; choose one of learned, fixed"]
    assert checks.arch_flag_errors(at(args, dict(value_residual_gate_impl="triton"))) == [
        "unknown --value-residual-gate-impl 'triton'; choose one of fused, separate"]


# argument_errors' own checks: (name, values, world size, lines); inputs=False (nothing on disk), on TINY (micro
# batch 2, global batch 2, --train-iters 2, --lr 1e-3, --min-lr 0)
BATCH = "--micro-batch-size ({}) and --global-batch-size ({}) must be >= 1"
DIVIDE = "--global-batch-size {} is not divisible by --micro-batch-size x data-parallel size = {} x {}"
LR = "need 0 <= --min-lr ({}) <= --lr ({}) and --lr > 0"
TIMEOUTS = ("--distributed-timeout-minutes must be > 0 and --hang-timeout-minutes >= 0 (0 turns the watchdog off)")
SCHEDULERS = ("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other: pass one "
              "(the command's LR schedule, or the checkpoint's)")
WARMUP = ("{} must be >= 0 and below the decay length {} steps (--lr-decay-iters or --lr-decay-samples, default "
          "--train-iters)")
FRACTION = "--lr-warmup-fraction {} must be in [0, 1) (a fraction of the decay length)"
MOCK = "--mock-data needs --vocab-size N or --tokenizer-model (whose vocabulary the tokens use)"
ARGUMENT_EDGES = [
    ("batches", dict(micro_batch_size=1, global_batch_size=1), 1, []),
    ("no micro batch", dict(micro_batch_size=0), 1, [BATCH.format(0, 2)]),
    ("no global batch", dict(global_batch_size=0), 1, [BATCH.format(2, 0)]),
    ("no batch unchecked without world", dict(micro_batch_size=0), None, []),
    ("batch over dp", dict(micro_batch_size=1, global_batch_size=2), 2, []),
    ("batch not over dp", dict(micro_batch_size=1, global_batch_size=3), 2, [DIVIDE.format(3, 1, 2)]),
    ("micro over dp", dict(micro_batch_size=2, global_batch_size=2), 2, [DIVIDE.format(2, 2, 2)]),
    ("dp of tp", dict(micro_batch_size=1, global_batch_size=2, tensor_model_parallel_size=2), 4, []),
    ("dp of pp", dict(micro_batch_size=1, global_batch_size=3, pipeline_model_parallel_size=2), 4,
     [DIVIDE.format(3, 1, 2)]),
    ("dp of cp", dict(micro_batch_size=1, global_batch_size=2, context_parallel_size=2), 4, []),
    ("dp of all", dict(micro_batch_size=1, global_batch_size=2, tensor_model_parallel_size=2,
                       pipeline_model_parallel_size=2, context_parallel_size=2), 16, []),
    ("world refused first", dict(micro_batch_size=1, global_batch_size=3, tensor_model_parallel_size=2), 3,
     [WORLD.format(3, 2, 1, 1)]),
    ("one step", dict(train_iters=1), 1, []),
    ("one step, a warm-up of it", dict(train_iters=1, lr_warmup_iters=1), 1, [WARMUP.format("--lr-warmup-iters 1", 1)]),
    ("no step", dict(train_iters=0), 1, ["--train-iters must be >= 1"]),  # not again as the warm-up's decay length
    ("no step, a negative warm-up", dict(train_iters=0, lr_warmup_iters=-1), 1,
     ["--train-iters must be >= 1", WARMUP.format("--lr-warmup-iters -1", 0)]),
    ("no step, a decay length of its own", dict(train_iters=0, lr_decay_iters=2, lr_warmup_iters=2), 1,
     ["--train-iters must be >= 1", WARMUP.format("--lr-warmup-iters 2", 2)]),
    ("no sequence", dict(seq_length=0), 1, ["--seq-length must be >= 1"]),
    ("log every step", dict(log_interval=1), 1, []),
    ("no log interval", dict(log_interval=0), 1, ["--log-interval must be >= 1"]),
    ("no eval iters", dict(eval_iters=0), 1, ["--eval-iters must be >= 1"]),
    ("intervals of one", dict(save_interval=1, eval_interval=1, exit_interval=1, save_retain_interval=1,
                              eval_samples=1), 1, []),
    ("no save interval", dict(save_interval=0), 1, ["--save-interval must be >= 1"]),
    ("no eval interval", dict(eval_interval=0), 1, ["--eval-interval must be >= 1"]),
    ("no exit interval", dict(exit_interval=0), 1, ["--exit-interval must be >= 1"]),
    ("no retain interval", dict(save_retain_interval=0), 1, ["--save-retain-interval must be >= 1"]),
    ("no eval samples", dict(eval_samples=0), 1, ["--eval-samples must be >= 1"]),
    ("lr at its edges", dict(lr=1e-300, min_lr=1e-300), 1, []),
    ("no lr", dict(lr=0.0, min_lr=0.0), 1, [LR.format(0.0, 0.0)]),
    ("negative min lr", dict(min_lr=-1e-9), 1, [LR.format(-1e-09, 0.001)]),
    ("min lr over lr", dict(min_lr=0.002), 1, [LR.format(0.002, 0.001)]),
    ("timeouts at their edges", dict(distributed_timeout_minutes=1e-9, hang_timeout_minutes=0), 1, []),
    ("no distributed timeout", dict(distributed_timeout_minutes=0), 1, [TIMEOUTS]),
    ("negative hang timeout", dict(hang_timeout_minutes=-1e-9), 1, [TIMEOUTS]),
    ("one scheduler", dict(override_opt_param_scheduler=True), 1, []),
    ("the other scheduler", dict(use_checkpoint_opt_param_scheduler=True), 1, []),
    ("both schedulers", dict(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True), 1,
     [SCHEDULERS]),
    ("warm-up below the decay", dict(lr_warmup_iters=1), 1, []),
    ("warm-up of the decay", dict(lr_warmup_iters=2), 1, [WARMUP.format("--lr-warmup-iters 2", 2)]),
    ("negative warm-up", dict(lr_warmup_iters=-1), 1, [WARMUP.format("--lr-warmup-iters -1", 2)]),
    ("warm-up below a decay", dict(lr_warmup_iters=4, lr_decay_iters=5), 1, []),
    ("warm-up of a decay", dict(lr_warmup_iters=5, lr_decay_iters=5), 1, [WARMUP.format("--lr-warmup-iters 5", 5)]),
    ("warm-up in samples", dict(lr_warmup_samples=3, lr_warmup_iters=1.5), 1, []),
    ("warm-up samples of the decay", dict(lr_warmup_samples=4, lr_warmup_iters=2.0), 1,
     [WARMUP.format("--lr-warmup-samples 4 (2 steps of 2 samples)", 2)]),
    ("warm-up zero decay samples", dict(lr_decay_samples=0, lr_warmup_iters=2), 1,
     [WARMUP.format("--lr-warmup-iters 2", 2)]),
    ("negative decay samples", dict(lr_decay_samples=-1, lr_warmup_iters=2), 1,
     ["--lr-decay-samples must be >= 0 (got -1)"]),
    ("negative warm-up samples", dict(lr_warmup_samples=-1, lr_warmup_iters=2), 1,
     ["--lr-warmup-samples must be >= 0 (got -1)"]),
    ("warm-up fractions", dict(lr_warmup_fraction=0.0), 1, []),
    ("warm-up fraction below 1", dict(lr_warmup_fraction=0.999), 1, []),
    ("warm-up fraction 1", dict(lr_warmup_fraction=1.0), 1, [FRACTION.format(1.0)]),
    ("negative warm-up fraction", dict(lr_warmup_fraction=-0.1), 1, [FRACTION.format(-0.1)]),
    ("step with load", dict(ckpt_step=5, load="somewhere"), 1, []),
    ("step without load", dict(ckpt_step=5), 1, ["--ckpt-step needs --load"]),
    ("mock with tokenizer", dict(vocab_size=None, tokenizer_model="tok"), 1, []),
    ("mock without vocabulary", dict(vocab_size=None), 1, [MOCK]),
    ("no mock no vocabulary", dict(vocab_size=None, mock_data=False), 1, []),
    ("refusals in order", dict(num_layers=0, log_interval=0, ckpt_step=1, split="x", eval_tasks_interval=2,
                               normalization="LayerNorm", ckpt_format="torch", fp16=True, bf16=True), 1,
     [SIZES.format("--num-layers 0"), "--log-interval must be >= 1",
      "--ckpt-format torch is not supported: checkpoints here are torch_dist (Megatron-Core dist checkpointing); "
      "drop the flag or pass --ckpt-format torch_dist",
      "--normalization LayerNorm conflicts with --arch satformer: every norm here is RMSNorm; drop the flag (it "
      "describes the model)", CONTRADICT, NOT_NUMBERS.format("x"), "--ckpt-step needs --load",
      "--eval-tasks-interval need --eval-tasks"]),
]


@pytest.mark.parametrize("name, values, world, lines", ARGUMENT_EDGES, ids=[row[0] for row in ARGUMENT_EDGES])
def test_argument_checks_at_their_edges(tmp_path, name, values, world, lines):
    assert checks.argument_errors(base(tmp_path), 1, inputs=False) == []
    assert checks.argument_errors(at(base(tmp_path), values), world, inputs=False) == lines


def test_the_inputs_are_checked_unless_left_out(tmp_path):
    """inputs=True (the default) adds the disk's checks: a data source, the folders, the include paths."""
    args = at(base(tmp_path), dict(mock_data=False, eval_tasks="x", eval_tasks_include_path=["{tmp}/none"]),
              tmp=str(tmp_path))
    assert checks.argument_errors(args, 1, inputs=False) == []
    assert checks.argument_errors(args, 1) == checks.argument_errors(args, 1, inputs=True) == [
        f"--eval-tasks-include-path {tmp_path}/none is not a folder",
        "give exactly one data source: --data-path PREFIX, --train-data-path PREFIX (with --valid-data-path, "
        "--test-data-path), --mock-data or --embedded-data DIR"]
    with pytest.raises(ValueError) as e:
        checks.validate_args(at(args, dict(ckpt_step=3)), 1)
    assert str(e.value) == ("invalid arguments:\n  --ckpt-step needs --load\n  --eval-tasks-include-path "
                            f"{tmp_path}/none is not a folder\n  give exactly one data source: --data-path PREFIX, "
                            "--train-data-path PREFIX (with --valid-data-path, --test-data-path), --mock-data or "
                            "--embedded-data DIR")
    fine = at(args, dict(mock_data=True, tokenizer_model="tok", eval_tasks_include_path=[str(tmp_path)]))
    checks.validate_args(fine, 1)
    with pytest.raises(ValueError) as e:  # the world size is checked too
        checks.validate_args(at(fine, dict(tensor_model_parallel_size=2)), 3)
    assert str(e.value) == "invalid arguments:\n  " + WORLD.format(3, 2, 1, 1)


TB_LINE = "--tensorboard-dir needs the tensorboard package: pip install tensorboard (in the train extra of megatron-sat)"
LM_EVAL_LINE = '--eval-tasks needs lm-eval: pip install "lm-eval[hf]==0.4.13"'
WITHOUT = """
import argparse, contextlib, importlib.util, io, json, sys
from megatron_sat.training import argument_checks as checks
from megatron_sat.training.arguments import parse_args
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        parse_args(sys.argv[1:])
        code = 0
    except SystemExit as e:
        code = e.code
args = argparse.Namespace(**json.loads(sys.stdin.read()))
print(json.dumps(dict(code=code, stderr=err.getvalue(), found=[importlib.util.find_spec(p) is not None for p in
                  ("tensorboard", "lm_eval", "torch", "megatron.core")],
                  inputs=checks.argument_errors(args, 1), no_inputs=checks.argument_errors(args, 1, inputs=False))))
"""


def test_a_missing_package_is_named_with_its_install(tmp_path):
    """An option whose package is not installed is refused with the pip command, in a real environment without the
    packages: a venv (python -m venv --without-pip) whose site-packages links every entry of this one's but
    tensorboard's and lm-eval's, the lm-eval registration hook included (the interpreter still starts). There the
    trainer's parse_args refuses both options in one line, exit 2, nothing written; inputs=False (plan-layout, the dry
    run) leaves both out. Here, with both installed, the same arguments are accepted."""
    run = tmp_path / "run"
    python = venv_without(tmp_path / "venv", "tensorboard", "tensorboard_data_server", "lm_eval")
    argv = [*TINY, "--save", str(run), "--tensorboard-dir", str(tmp_path / "tb"), "--eval-tasks", "x",
            "--tokenizer-model", "tok"]
    args = at(base(tmp_path), dict(tensorboard_dir=str(tmp_path / "tb"), eval_tasks="x", tokenizer_model="tok"))
    assert checks.argument_errors(args, 1) == checks.argument_errors(args, 1, inputs=False) == []  # both installed
    proc = run_in(python, WITHOUT, *argv, stdin=json.dumps(vars(args)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["found"] == [False, False, True, True]
    lines = out["stderr"].strip().splitlines()
    assert out["code"] == 2 and len(lines) == 1 and sorted(checks.problems(lines[0])) == [LM_EVAL_LINE, TB_LINE], out
    assert sorted(out["inputs"]) == [LM_EVAL_LINE, TB_LINE] and out["no_inputs"] == []
    assert not run.exists()


# --eval-tasks and its companions (eval_tasks_errors): (name, values, inputs, lines); on TINY (--mock-data, no
# --tokenizer-model; lm-eval installed)
NO_TASK = "--eval-tasks names no task: give comma-separated lm-eval task names"
PP_CP = ("--eval-tasks runs at PP1 and CP1 only (TP and DP are fine): score this run's checkpoints with "
         "tools/evaluate.py --checkpoint RUN instead")
MOCK_TASKS = "--eval-tasks with --mock-data needs --tokenizer-model (the tokenizer the tasks are read with)"
TASK = dict(eval_tasks="hellaswag", tokenizer_model="tok")
EVAL_EDGES = [
    ("none", dict(), True, []),
    ("interval alone", dict(eval_tasks_interval=5), False, ["--eval-tasks-interval need --eval-tasks"]),
    ("limit and batch alone", dict(eval_tasks_limit=0.5, eval_tasks_batch_size=2), False,
     ["--eval-tasks-limit, --eval-tasks-batch-size need --eval-tasks"]),
    ("include path alone", dict(eval_tasks_include_path=["d"]), False, ["--eval-tasks-include-path need --eval-tasks"]),
    ("a task", TASK, True, []),
    ("tasks and a blank", dict(TASK, eval_tasks="a, ,b,"), False, []),
    ("no task", dict(TASK, eval_tasks=" , "), False, [NO_TASK]),
    ("interval 1", dict(TASK, eval_tasks_interval=1, eval_tasks_batch_size=1), False, []),
    ("interval 0", dict(TASK, eval_tasks_interval=0), False, ["--eval-tasks-interval must be >= 1"]),
    ("batch size 0", dict(TASK, eval_tasks_batch_size=0), False, ["--eval-tasks-batch-size must be >= 1"]),
    ("limit above 0", dict(TASK, eval_tasks_limit=1e-9), False, []),
    ("limit 0", dict(TASK, eval_tasks_limit=0.0), False,
     ["--eval-tasks-limit must be > 0 (examples per task, or a fraction below 1)"]),
    ("include path left out", dict(TASK, eval_tasks_include_path=["{tmp}/none"]), False, []),
    ("include path missing", dict(TASK, eval_tasks_include_path=["{tmp}", "{tmp}/none"]), True,
     ["--eval-tasks-include-path {tmp}/none is not a folder"]),
    ("tp", dict(TASK, tensor_model_parallel_size=2), False, []),
    ("pp", dict(TASK, pipeline_model_parallel_size=2), False, [PP_CP]),
    ("cp", dict(TASK, context_parallel_size=2), False, [PP_CP]),
    ("mock without tokenizer", dict(TASK, tokenizer_model=None), False, [MOCK_TASKS]),
    ("data without tokenizer here", dict(TASK, tokenizer_model=None, mock_data=False), False, []),
]


@pytest.mark.parametrize("name, values, inputs, lines", EVAL_EDGES, ids=[row[0] for row in EVAL_EDGES])
def test_eval_tasks_at_their_edges(tmp_path, name, values, inputs, lines):
    args = at(base(tmp_path), values, tmp=str(tmp_path))
    assert checks.eval_tasks_errors(args, inputs) == [x.format(tmp=tmp_path) for x in lines]
    if inputs:
        assert checks.eval_tasks_errors(args) == [x.format(tmp=tmp_path) for x in lines]


# --save (save_folder_errors): (name, values, lines); {r} holds a run (its tracker file), {file} is a file, {data} a
# folder, {new} does not exist
SAVE_EDGES = [
    ("no save", dict(save=None, load="{r}"), []),
    ("new", dict(save="{new}"), []),
    ("new inside a new one", dict(save="{new}/deeper"), []),
    ("a file", dict(save="{file}"), ["--save {file} is a file, not a folder: pass a folder for checkpoints, metrics "
                                    "and config"]),
    ("under a file", dict(save="{file}/sub"),
     ["--save {file}/sub is not writable ({file} cannot be written: a read-only file system, an immutable folder or no "
      "permission): pass a --save folder this job can write"]),
    ("inside the load", dict(save="{data}/out", load="{data}"),
     ["--save {data}/out lies inside --load {data}: write to a folder apart from the input"]),
    ("over the pretrained", dict(save="{data}", pretrained_checkpoint="{data}/../data"),
     ["--save {data} is --pretrained-checkpoint {data}/../data: write to a folder apart from the input"]),
    ("an empty folder", dict(save="{data}"), []),
    ("its own run", dict(save="{r}", load="{r}/../r"), []),
    ("a run not loaded", dict(save="{r}"),
     ["--save {r} already holds a run's checkpoints: resume it with --load {r}, or pass a new --save folder"]),
    ("a run, another load", dict(save="{r}", load="{data}"),
     ["--save {r} already holds a run's checkpoints: resume it with --load {r} (not --load {data}), or pass a new "
      "--save folder"]),
]


def folders(tmp_path) -> dict:
    paths = {k: str(tmp_path / k) for k in ("r", "file", "data", "new")}
    os.makedirs(paths["r"])
    with open(os.path.join(paths["r"], TRACKER), "w") as f:
        f.write("2")
    with open(paths["file"], "w") as f:
        f.write("x")
    os.makedirs(paths["data"])
    return paths


@pytest.mark.parametrize("name, values, lines", SAVE_EDGES, ids=[row[0] for row in SAVE_EDGES])
def test_the_save_folder_at_its_edges(tmp_path, name, values, lines):
    paths = folders(tmp_path)
    args = at(base(tmp_path / "b"), dict(dict(load=None, pretrained_checkpoint=None), **values), **paths)
    assert checks.save_folder_errors(args) == [x.format(**paths) for x in lines]


# The data paths (split_path_errors) and the other inputs (input_errors): (name, values, lines) on TINY (--mock-data)
# with --save {tmp}/r; datasets() names the prefixes
SOURCE = ("give exactly one data source: --data-path PREFIX, --train-data-path PREFIX (with --valid-data-path, "
          "--test-data-path), --mock-data or --embedded-data DIR")
NO_DATASET = "--{}-data-path: no indexed dataset (.bin + .idx) at {} (make one with tools/preprocess_data.py)"
DATA = dict(mock_data=False, tokenizer_model="tok")
INPUT_EDGES = [
    ("mock data", dict(), []),
    ("two sources", dict(data_path=["{full}"], tokenizer_model="tok"), [SOURCE]),
    ("no source", dict(mock_data=False), [SOURCE]),
    ("embedded data", dict(mock_data=False, embedded_data="{tmp}"), []),
    ("data path", dict(DATA, data_path=["{full}"]), []),
    ("a blend", dict(DATA, data_path=["0.5 {full}", "0.5", "{full}"]), []),
    ("data path missing", dict(DATA, data_path=["{missing}"]), [NO_DATASET.format("", "{missing}")[1:]]),
    ("half a dataset", dict(DATA, data_path=["1 {full} 2 {half} 3 {idxonly}"]),
     [NO_DATASET.format("", "{half}, {idxonly}")[1:]]),
    ("data path without tokenizer", dict(DATA, data_path=["{full}"], tokenizer_model=None),
     ["--data-path needs --tokenizer-model (the tokenizer the data was made with)"]),
    ("data path blend weight", dict(DATA, data_path=["0 {full}"]), [WEIGHTS.format("0")]),
    ("data path empty", dict(DATA, data_path=["{empty}"]), [EMPTY]),
    ("train path", dict(DATA, train_data_path=["{full}"]), []),
    ("train path missing", dict(DATA, train_data_path=["{missing}"]), [NO_DATASET.format("train", "{missing}")]),
    ("load", dict(load="{ckpt}"), []),
    ("load missing", dict(load="{missing}"), ["--load folder {missing} does not exist"]),
    ("load the new save", dict(load="{tmp}/r"), []),
    ("load the new save spelt apart", dict(load="{tmp}/x/../r"), []),
    ("load missing no save", dict(load="{missing}", save=None), ["--load folder {missing} does not exist"]),
    ("pretrained", dict(pretrained_checkpoint="{ckpt}"), []),
    ("pretrained missing", dict(pretrained_checkpoint="{missing}"),
     ["--pretrained-checkpoint folder {missing} does not exist"]),
    ("save a file", dict(save="{full}.bin"),
     ["--save {full}.bin is a file, not a folder: pass a folder for checkpoints, metrics and config"]),
    ("tensorboard", dict(tensorboard_dir="{tmp}/tb"), []),
    ("tensorboard a file", dict(tensorboard_dir="{full}.bin"),
     ["--tensorboard-dir {full}.bin is a file: give a folder (new, or this run's)"]),
    ("tensorboard under a file", dict(tensorboard_dir="{full}.bin/tb"),
     ["--tensorboard-dir {full}.bin/tb is not writable ({full}.bin is a file): pass a --tensorboard-dir this job can "
      "write"]),
    ("tensorboard read-only", dict(tensorboard_dir="/proc/sys/megatron_sat/tb"),
     ["--tensorboard-dir /proc/sys/megatron_sat/tb is not writable (/proc/sys cannot be written: a read-only file "
      "system, an immutable folder or no permission): pass a --tensorboard-dir this job can write"]),
]
SPLIT_PATH_EDGES = [
    ("none", dict(), []),
    ("valid alone", dict(DATA, valid_data_path=["{full}"]),
     ["--valid-data-path / --test-data-path need --train-data-path (they replace --data-path)"]),
    ("test alone", dict(DATA, test_data_path=["{full}"]),
     ["--valid-data-path / --test-data-path need --train-data-path (they replace --data-path)"]),
    ("all three", dict(DATA, train_data_path=["{full}"], valid_data_path=["1 {full}"], test_data_path=["{full}"]), []),
    ("no tokenizer", dict(DATA, train_data_path=["{full}"], tokenizer_model=None),
     ["--train-data-path needs --tokenizer-model (the tokenizer the data was made with)"]),
    ("valid no tokenizer", dict(DATA, valid_data_path=["{full}"], tokenizer_model=None),
     ["--valid-data-path / --test-data-path need --train-data-path (they replace --data-path)"]),
    ("train half", dict(DATA, train_data_path=["{half}"]), [NO_DATASET.format("train", "{half}")]),
    ("train idx only", dict(DATA, train_data_path=["1 {full} 1 {idxonly}"]), [NO_DATASET.format("train", "{idxonly}")]),
    ("train a number", dict(DATA, train_data_path=["1"]), [NO_DATASET.format("train", "nothing given")]),
    ("train a blend in words", dict(DATA, train_data_path=["1", "{full}", "2", "{full}"]), []),
    ("train two missing", dict(DATA, train_data_path=["1 {half}", "1 {idxonly}"]),
     [NO_DATASET.format("train", "{half}, {idxonly}")]),
    ("no test flag", dict(DATA, train_data_path=["{full}"], test_data_path=DROP), []),  # a config older than it
    ("valid missing", dict(DATA, train_data_path=["{full}"], valid_data_path=["{missing}"]),
     [NO_DATASET.format("valid", "{missing}")]),
    ("test missing", dict(DATA, train_data_path=["{full}"], test_data_path=["{missing}"]),
     [NO_DATASET.format("test", "{missing}")]),
    ("valid blend weight", dict(DATA, train_data_path=["{full}"], valid_data_path=["0 {full}"]),
     [WEIGHTS.format("0").replace("--data-path", "--valid-data-path")]),
    ("train empty, test missing", dict(DATA, train_data_path=["{empty}"], test_data_path=["{missing}"]),
     [EMPTY.replace("--data-path", "--train-data-path"), NO_DATASET.format("test", "{missing}")]),
]


@pytest.mark.parametrize("name, values, lines", INPUT_EDGES, ids=[row[0] for row in INPUT_EDGES])
def test_the_inputs_at_their_edges(tmp_path, name, values, lines):
    if "/proc/sys" in values.get("tensorboard_dir", "") and os.access("/proc/sys", os.W_OK | os.X_OK):
        pytest.skip("/proc/sys is writable here")
    paths = dict(datasets(tmp_path), tmp=str(tmp_path), ckpt=str(tmp_path / "ckpt"))
    os.makedirs(paths["ckpt"])
    args = at(base(tmp_path), values, **paths)
    assert checks.input_errors(args) == [x.format(**paths) for x in lines]


@pytest.mark.parametrize("name, values, lines", SPLIT_PATH_EDGES, ids=[row[0] for row in SPLIT_PATH_EDGES])
def test_the_split_data_paths_at_their_edges(tmp_path, name, values, lines):
    paths = dict(datasets(tmp_path), tmp=str(tmp_path))
    args = at(base(tmp_path), values, **paths)
    assert checks.split_path_errors(args) == [x.format(**paths) for x in lines]
    no_source = [SOURCE] if not args.train_data_path and not args.mock_data else []  # --valid/--test-data-path alone
    assert checks.input_errors(args) == no_source + [x.format(**paths) for x in lines]
