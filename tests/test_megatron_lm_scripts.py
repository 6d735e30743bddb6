"""Megatron-LM's own example scripts run here as bash runs them: tests/data/megatron_lm/*.sh are their text with only
sizes, iterations, paths and GPU-only settings changed (each change and the source commit listed at the top of each
file), run by bash with the launcher (torchrun) replaced by launcher/torchrun, which hands the program's arguments,
exactly as bash split and quoted them, to megatron-sat's trainer with --arch transformer. The Megatron-LM flags that
describe the model are no-ops when they match the arch and a one-line refusal (exit 2) when they do not.

    .venv/bin/python -m pytest tests/test_megatron_lm_scripts.py
"""

import argparse
import glob
import json
import os
import subprocess

import pytest
import torch
from train_cli import ROOT, rows, train

from megatron_sat.archs import ARCHS
from megatron_sat.model.flops import peak_tflops_of
from megatron_sat.training import flag_table, megatron_lm_flags
from megatron_sat.training.argument_checks import problems
from megatron_sat.training.arguments import parse_args
from megatron_sat.training.profiler import StepProfiler, bubble_fraction

SCRIPTS = os.path.join(ROOT, "tests", "data", "megatron_lm")


def script_args(name: str, folder, *positional, **env) -> list:
    """The trainer's command line from running tests/data/megatron_lm/NAME.sh with bash in `folder` (with the
    script's positional arguments and environment variables): --arch transformer, then the words bash passed to
    pretrain_gpt.py."""
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, "pretrain_gpt.py"), "w").close()  # the scripts check that it is there
    out = os.path.join(folder, "argv")
    shim = os.path.join(SCRIPTS, "launcher")
    subprocess.run(["bash", os.path.join(SCRIPTS, name + ".sh"), *map(str, positional)], cwd=folder, check=True,
                   env=dict(os.environ, PATH=shim + os.pathsep + os.environ["PATH"], MEGATRON_SAT_ARGV=out, **env),
                   capture_output=True, text=True, timeout=60)
    with open(out) as f:
        return ["--arch", "transformer", *f.read().split("\0")[:-1]]


def llama(tmp_path) -> list:
    return script_args("train_llama3_8b_h100_fp8", tmp_path / "sh", tmp_path / "llama", tmp_path / "llama_tb")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(dataset prefix, tokenizer folder): the embedded corpus three times over (1158 documents, so that the 175B
    script's --split 949,50,1 gives the test split documents), a 512-token BPE."""
    from megatron_sat.data import load_tokenizer, preprocess, train_bpe_tokenizer, write_default_corpus

    folder = tmp_path_factory.mktemp("corpus")
    info = write_default_corpus(str(folder / "raw"))
    train_bpe_tokenizer([info.path], 512, str(folder / "tok"))
    preprocess([info.path] * 3, load_tokenizer(str(folder / "tok")), str(folder / "doc"), workers=1, progress=False)
    return str(folder / "doc"), str(folder / "tok")


@pytest.mark.slow  # a trainer run
def test_llama3_8b_script_trains_two_steps_and_profiles_one(tmp_path):
    """examples/llama/train_llama3_8b_h100_fp8.sh as bash runs it, shrunk; the test adds --use-pytorch-profiler and
    moves the profiled range to step 2 alone (the script's --profile is an nsys range), so the trace must hold step 2
    and not step 1."""
    out = train(*llama(tmp_path), "--use-pytorch-profiler", "--profile-step-start", "2", "--no-progress-bar")
    steps = [r for r in rows(tmp_path / "llama") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["consumed_samples"] for r in steps] == [4, 8]
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert config["arch"] == "transformer" and config["recompute_granularity"] is None
    # --lr-warmup-samples 4 = one step of 4: step 1 at 0, step 2 at the peak; --untie: an output layer of its own
    assert steps[0]["lr"] == 0.0 and steps[1]["lr"] == pytest.approx(1.5e-4)
    # two embeddings of 512 x 64; per layer q and o 64 x 64, k and v 16 x 64 (one group), SwiGLU 3 x 64 x 224, two
    # norms of 64 and the q/k norms of 16; the final norm
    assert config["num_parameters"] == 2 * 512 * 64 + 2 * (2 * 64 * 64 + 2 * 16 * 64 + 3 * 64 * 224 + 2 * 64 + 2 * 16) + 64
    traces = glob.glob(str(tmp_path / "llama" / "profile" / "*.pt.trace.json"))
    assert len(traces) == 1, out
    with open(traces[0]) as f:
        events = json.load(f)["traceEvents"]  # the Chrome trace format TensorBoard's plugin and Perfetto read
    profiled = {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert profiled == {"ProfilerStep#2"}
    assert any(e.get("name") == "aten::mm" for e in events)  # the step's matrix products are in it
    # a clean console: megatron-core's Transformer Engine / Apex notices are filtered (known harmless on CPU), the
    # banner names the block, and why there is no MFU is said once instead of "MFU n/a" on every step line
    assert "Transformer Engine and Apex are not installed" not in out and "Warning" not in out, out
    assert "transformer (Llama-style block: RMSNorm, SwiGLU, RoPE, no biases)" in out
    assert out.count("no MFU on the step lines") == (0 if torch.cuda.is_available() else 1) and "MFU n/a" not in out


@pytest.mark.slow  # a trainer run
def test_gpt3_175b_script_ramps_the_batch_and_scores_the_test_split(tmp_path, corpus):
    """examples/gpt3/train_gpt3_175b_distributed.sh, shrunk: --rampup-batch-size 2 2 2 trains 2 then 4 sequences;
    --split 949,50,1 has a test share, scored at the end into metrics.jsonl. The test adds
    --log-timers-to-tensorboard."""
    prefix, tok = corpus
    train(*script_args("train_gpt3_175b_distributed", tmp_path / "sh", tmp_path / "gpt", tmp_path / "gpt_tb", tok,
                       prefix), "--no-progress-bar", "--log-timers-to-tensorboard")
    records = rows(tmp_path / "gpt")
    steps = [r for r in records if "loss" in r]
    assert [(r["step"], r["consumed_samples"]) for r in steps] == [(1, 2), (2, 6)]
    for r in steps:  # the test adds --log-timers-to-tensorboard: the step's phases, within the step's time
        phases = [r[f"timers_{k}_s"] for k in ("data", "forward_backward", "optimizer")]
        assert all(p >= 0 for p in phases) and sum(phases) <= r["step_time_s"] and r["timers_pipeline_bubble_est_s"] == 0
        assert r["tokens_per_s_per_device"] == r["tokens_per_s"] and r["tflops_per_device"] > 0  # one device
    tests = [r for r in records if "test_loss" in r]
    assert len(tests) == 1 and tests[0]["step"] == 2 and 0 < tests[0]["test_loss"] < 10
    assert os.listdir(tmp_path / "gpt_tb")


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def _problems(err: str) -> list:
    """The problems of a refusal: one line (argument_checks.refusal), one entry per problem."""
    assert len(err.strip().splitlines()) == 1, err
    return problems(err.strip())


@pytest.mark.parametrize("flag, value, named", [
    ("--normalization", "LayerNorm", "--normalization LayerNorm conflicts with --arch transformer: every norm here is RMSNorm"),
    ("--position-embedding-type", "learned_absolute", "--position-embedding-type learned_absolute conflicts"),
    ("--hidden-dropout", "0.1", "--hidden-dropout 0.1 conflicts with --arch transformer"),
    ("--kv-channels", "0", "--kv-channels must be >= 1 (got 0)"),
    ("--norm-epsilon", "0", "--norm-epsilon must be > 0 (got 0.0)"),
    ("--max-position-embeddings", "16", "--max-position-embeddings 16 is below --seq-length 32"),
    ("--vocab-file", "gpt2-vocab.json", "--vocab-file/--merge-file (GPT2BPETokenizer) are not read here"),
    ("--rotary-percent", "0.5", "--rotary-percent 0.5 conflicts with --arch transformer: RoPE rotates the whole head"),
    ("--rotary-percent", "0.99", "--rotary-percent 0.99 conflicts with --arch transformer"),
    ("--max-position-embeddings", "31", "--max-position-embeddings 31 is below --seq-length 32"),
])
def test_a_conflicting_model_flag_exits_2_naming_it(tmp_path, capsys, flag, value, named):
    err = _refused([*llama(tmp_path), flag, value], capsys)
    assert len(_problems(err)) == 1 and named in _problems(err)[0]  # one line, naming the flag and the conflict


def test_model_description_flags_at_their_edge_are_accepted(tmp_path):
    """The other side of the refusals above: the values the archs are (RoPE on the whole head, a position table as
    long as the sequence, one channel per head) parse."""
    args = parse_args([*llama(tmp_path), "--rotary-percent", "1.0", "--max-position-embeddings", "32",
                       "--kv-channels", "1"])
    assert (args.rotary_percent, args.max_position_embeddings, args.kv_channels) == (1.0, 32, 1)


def test_a_profiled_range_past_the_last_step_is_refused_before_training(tmp_path, capsys):
    """docs/profiling.md: a range ending past the run's last step would write no trace (it is written after the
    range's last step): exit 2, one line, before anything is built; a range ending on the last step is accepted.
    The last step is the trainer's own count (the script's --train-samples 8: 2 steps)."""
    base = ["--recipe", "debug_satformer", "--train-iters", "16", "--save", str(tmp_path / "r"), "--profile",
            "--use-pytorch-profiler"]
    for start, end in ((17, 17), (15, 17), (2, 17)):
        err = _refused([*base, "--profile-step-start", str(start), "--profile-step-end", str(end)], capsys)
        assert _problems(err) == [f"--profile-step-start {start} to --profile-step-end {end} ends past the run's last "
                                  "step (--train-iters 16): the trace is written after step "
                                  f"{end}, so nothing would be; give a range within 1..16"], err
    assert parse_args([*base, "--profile-step-start", "16", "--profile-step-end", "16"]).profile_step_end == 16
    assert parse_args([*base, "--profile-step-start", "17", "--profile-step-end", "17", "--train-iters", "17"])
    err = _refused([*llama(tmp_path), "--profile-step-end", "3"], capsys)
    assert len(_problems(err)) == 1 and "(--train-iters 2)" in _problems(err)[0], err
    assert parse_args(llama(tmp_path)).profile_step_end == 2
    assert not (tmp_path / "r").exists()


def test_the_script_parses_with_matching_model_flags(tmp_path):
    """The same command line parses (the matching model flags are no-ops) and resolves as Megatron-LM would, its
    --split '99,1,0' (the quotes reach the program: bash splits "--split '99,1,0'" on the space) included."""
    argv = llama(tmp_path)
    assert argv[argv.index("--split") + 1] == "'99,1,0'"
    args = parse_args(argv)
    assert args.split == "99,1,0"
    assert (args.lr_warmup_iters, args.lr_decay_iters, args.train_iters) == (1.0, 2.0, 2)
    assert (args.num_workers, args.mmap_bin_files, args.overlap_param_gather, args.sequence_parallel) == (1, False, True,
                                                                                                          False)
    assert args.init_method_std == 0.0134 and args.untie_embeddings_and_output_weights
    assert args.kv_channels == 16 and args.qk_layernorm  # Megatron-LM's --kv-channels: a real flag; QK-norm stays on


def test_a_sample_based_schedule_that_is_not_whole_batches_stays_fractional(tmp_path):
    """docs/ecosystem.md: --lr-warmup-samples / --lr-decay-samples N are N / global batch steps, fractional (the
    script's global batch is 4): 6 samples are 1.5 steps, 7 are 1.75 (not rounded either way); whole batches whole."""
    for warmup, decay, want in ((6, 7, (1.5, 1.75)), (5, 9, (1.25, 2.25)), (4, 8, (1.0, 2.0))):
        args = parse_args([*llama(tmp_path), "--lr-warmup-samples", str(warmup), "--lr-decay-samples", str(decay)])
        assert (args.lr_warmup_iters, args.lr_decay_iters) == want, (warmup, decay)


def test_published_shape_flags(tmp_path):
    """--kv-channels free of hidden / heads, --no-qk-layernorm (Llama), --qk-layernorm (Megatron-LM's spelling: the
    default), --norm-epsilon reach the model the trainer builds."""
    from megatron_sat.model.args import model_args
    from megatron_sat.training.setup import model_config

    args = parse_args([*llama(tmp_path), "--kv-channels", "32", "--no-qk-layernorm", "--norm-epsilon", "1e-5"])
    config = model_config(args)
    assert (config.kv_channels, config.qk_layernorm, config.layernorm_epsilon) == (32, False, 1e-5)
    assert model_args(parse_args([*llama(tmp_path), "--qk-layernorm"])).qk_layernorm
    # in a config file under the flag's name; a record from before it was a model flag (norm_epsilon: null) reads
    for text, eps in (("norm-epsilon: 1.0e-5", 1e-5), ("norm_epsilon: null", 1e-6)):
        (tmp_path / "c.yaml").write_text(text + "\n")
        assert parse_args([*llama(tmp_path), "--config", str(tmp_path / "c.yaml")]).layernorm_epsilon == eps


def test_without_arch_recipe_or_config_the_trainer_asks_for_arch(tmp_path, capsys):
    argv = [a for a in llama(tmp_path) if a not in ("--arch", "transformer")]
    err = _refused(argv, capsys)
    assert len(_problems(err)) == 1 and "which model? give --arch (one of transformer, resformer, satformer" in err


def test_rampup_and_sample_schedule_follow_megatron_lm(tmp_path, capsys):
    base = llama(tmp_path)
    args = parse_args([*base, "--rampup-batch-size", "1", "1", "6", "--train-samples", "20"])
    # START 1, INCR 1, three increments over 6 samples: 2 samples per increment, the full 4 after 6 samples
    assert [megatron_lm_flags.global_batch_at(args, c) for c in (0, 1, 2, 4, 6, 7, 100)] == [1, 1, 2, 3, 4, 4, 4]
    # ramp steps of 1, 1, 2, 3 (7 samples, past the ramp), then (20 - 7) // 4 = 3 full steps (Megatron-LM's count)
    assert args.train_iters == 7
    at = base.index("--train-samples")
    err = _refused([*base[:at], *base[at + 2:], "--train-iters", "2",
                    "--rampup-batch-size", "2", "2", "2"], capsys)
    assert "--rampup-batch-size needs --train-samples" in err
    err = _refused([*base, "--rampup-batch-size", "3", "2", "2"], capsys)
    assert "--rampup-batch-size 3 2 2: need 1 <= START" in err
    err = _refused([*base, "--recompute-activations", "--recompute-granularity", "full"], capsys)
    assert "--recompute-activations means --recompute-granularity selective" in err
    assert parse_args([*base, "--recompute-activations"]).recompute_granularity == "selective"
    assert parse_args([*base, "--virtual-pipeline-model-parallel-size", "2"]).num_virtual_stages_per_pipeline_rank == 2


def test_rampup_counts_and_bounds_at_their_edges(tmp_path, capsys):
    """Megatron-LM's ramp-up count (ramp steps while consumed <= SAMPLES, then whole full batches) where an off-by-one
    changes it (the script's global batch 4): 2 2 8 reaches 8 samples exactly; its step there is a ramp step, so 8
    and 9 samples take 5 steps (Megatron-LM's count overshoots) and 21 take 7 (one ramp step fewer, or a count
    from 1, changes one of these). The bounds of START, INCR and SAMPLES on both sides (SAMPLES 0: no ramp, which divided by zero
    before; START = the global batch: no ramp; an INCR that does not divide the difference refused)."""
    base = llama(tmp_path)
    at = base.index("--train-samples")
    base = [*base[:at], *base[at + 2:]]
    for ramp, samples, steps in ((("2", "2", "8"), 9, 5), (("2", "2", "8"), 21, 7), (("2", "2", "8"), 8, 5),
                                 (("1", "1", "6"), 7, 4), (("4", "1", "6"), 9, 2), (("1", "3", "0"), 9, 2)):
        args = parse_args([*base, "--rampup-batch-size", *ramp, "--train-samples", str(samples)])
        assert args.train_iters == steps, (ramp, samples, args.train_iters)
    args = parse_args([*base, "--rampup-batch-size", "2", "2", "8", "--train-samples", "21"])
    assert [megatron_lm_flags.global_batch_at(args, c) for c in (0, 7, 8, 9)] == [2, 2, 4, 4]  # INCR 2 steps by 2
    args = parse_args([*base, "--rampup-batch-size", "1", "1", "1", "--train-samples", "9"])  # SAMPLES 1: one step
    assert [megatron_lm_flags.global_batch_at(args, c) for c in (0, 1, 2)] == [1, 4, 4] and args.train_iters == 3
    for ramp in (("2", "3", "8"), ("0", "1", "8"), ("1", "0", "8"), ("5", "1", "8"), ("1", "1", "-1")):
        err = _refused([*base, "--rampup-batch-size", *ramp, "--train-samples", "20"], capsys)
        assert f"--rampup-batch-size {' '.join(ramp)}: need 1 <= START" in err, ramp


@pytest.mark.parametrize("device, tflops", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                            ("NVIDIA A10", 125.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0),
                                            ("NVIDIA B200", 2250.0), ("NVIDIA GB200", 2500.0), ("NVIDIA H20", 148.0),
                                            ("AMD Instinct MI300X", 1307.4), ("Tesla T4", None)])
def test_mfu_knows_the_datasheet_peaks(device, tflops):
    """MFU's table: the most specific name wins (A100 is not an A10); an unknown GPU has none (--peak-tflops)."""
    assert peak_tflops_of(device) == tflops


@pytest.mark.parametrize("first, last", [(2, 4), (1, 2), (5, 5)])
def test_a_profiled_range_of_several_steps_holds_exactly_those_steps(tmp_path, first, last):
    """docs/profiling.md: the trace holds steps A..B, each a ProfilerStep#N, and no step on either side (the warm-up
    step before A is not recorded). The trainer's calls around 6 steps of a small matrix product."""
    args = argparse.Namespace(save=str(tmp_path), profile=True, profile_ranks=[0], use_pytorch_profiler=True,
                              profile_step_start=first, profile_step_end=last, record_memory_history=False,
                              memory_snapshot_path=None)
    profiler = StepProfiler(args, rank=0, log=lambda line: None)
    x = torch.ones(8, 8)
    for step in range(1, 7):
        profiler.before_step(step)
        x = torch.mm(x, x) / 8
        profiler.after_step(step)
    profiler.close()
    traces = glob.glob(str(tmp_path / "profile" / "*.pt.trace.json"))
    assert len(traces) == 1, traces
    with open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    profiled = {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert profiled == {f"ProfilerStep#{n}" for n in range(first, last + 1)}


def test_memory_history_on_cpu_says_it_records_nothing(tmp_path):
    """--record-memory-history is a CUDA allocator feature: on CPU one line says so and nothing is written (the
    snapshot on OOM is tests/test_gpu.py's, run by tools/gpu_check.sh)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine records the history (tests/test_gpu.py checks the snapshot)")
    args = argparse.Namespace(save=str(tmp_path), profile=True, profile_ranks=[0], use_pytorch_profiler=False,
                              profile_step_start=1, profile_step_end=1, record_memory_history=True,
                              memory_snapshot_path=None)
    lines = []
    profiler = StepProfiler(args, rank=0, log=lines.append)
    profiler.before_step(1)
    profiler.after_step(1)
    profiler.close()
    assert any("no GPU here, nothing recorded" in line for line in lines)
    assert any("nothing is recorded on CPU: add --use-pytorch-profiler" in line for line in lines)
    assert not (tmp_path / "profile").exists()
    # the pipeline bubble estimate of the timers: (PP - 1) / (m x v + PP - 1)
    assert (bubble_fraction(1, 8), bubble_fraction(4, 8), bubble_fraction(4, 8, 2)) == (0.0, 3 / 11, 3 / 19)


def test_a_sample_based_run_reproduces_from_its_config(tmp_path, capsys):
    """--print-config writes the sample counts, not the steps derived from them, so the file parses back the same."""
    from megatron_sat.training.arguments import build_parser
    from megatron_sat.training.config_file import config_dict

    args = parse_args(llama(tmp_path))
    saved = config_dict(args, build_parser())
    assert (saved["lr_warmup_iters"], saved["lr_decay_iters"], saved["lr_warmup_samples"]) == (None, None, 4)
    (tmp_path / "run.json").write_text(json.dumps(dict(saved, load=None)))  # the script resumes its own folder
    again = parse_args(["--config", str(tmp_path / "run.json"), "--save", str(tmp_path / "again")])
    assert (again.lr_warmup_iters, again.lr_decay_iters, again.train_iters) == (1.0, 2.0, 2)


def test_the_scripts_banner_names_the_llama_block():
    assert megatron_lm_flags.describe_arch("transformer") == "transformer (Llama-style block: RMSNorm, SwiGLU, RoPE, no biases)"
    assert megatron_lm_flags.describe_arch("satformer") == "satformer"


def test_mixtral_script_is_refused_in_one_line_naming_moe(tmp_path, capsys, corpus):
    """examples/mixtral/train_mixtral_8x7b_distributed.sh as bash runs it: every problem in one line, MoE named once
    with its flags, the Llama2Tokenizer refused with what to use; its kernel switches are no-ops."""
    prefix, tok = corpus
    found = _problems(_refused(script_args("train_mixtral_8x7b_distributed", tmp_path, tmp_path / "ckpt", tok, prefix),
                               capsys))
    assert len(found) == 2, found
    assert found[0].startswith("Mixture-of-Experts (MoE) is not supported here: the archs are dense (--num-experts 8 "
                               "--moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff "
                               "1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall "
                               "--expert-model-parallel-size 8)")
    assert found[1].startswith("--tokenizer-type Llama2Tokenizer is not read here")


def test_megatron_fsdp_script_is_refused_in_one_line_and_parses_without_fsdp(tmp_path, capsys):
    """examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh as bash runs it (USE_UV=1: `uv run python -m
    torch.distributed.run`): Megatron-FSDP named once with its flags, its checkpoint format refused; with the script's
    own USE_MEGATRON_FSDP=0 the command line parses (its kernel switches and --logging-level are no-ops)."""
    argv = script_args("train_llama3_8b_fsdp_h100_fp8", tmp_path / "a", tmp_path / "ckpt")
    found = _problems(_refused(argv, capsys))
    assert len(found) == 2, found
    assert found[0].startswith("Megatron-FSDP is not supported here (--use-megatron-fsdp --data-parallel-sharding-"
                               "strategy optim_grads_params --init-model-with-meta-device --use-nccl-ub "
                               "--fsdp-double-buffer --fsdp-manual-registration)")
    assert found[1].startswith("--ckpt-format fsdp_dtensor is not supported")
    args = parse_args(script_args("train_llama3_8b_fsdp_h100_fp8", tmp_path / "b", tmp_path / "ckpt2",
                                  USE_MEGATRON_FSDP="0"))
    assert (args.split, args.train_iters, args.logging_level, args.no_check_for_nan_in_loss_and_grad) == (
        "99,1,0", 2, 20, True)


def test_mock_data_takes_the_vocabulary_of_a_given_tokenizer(tmp_path, capsys, corpus):
    """--mock-data --tokenizer-model DIR needs no --vocab-size; without either it is refused naming both."""
    base = [a for a in llama(tmp_path) if a not in ("--tokenizer-type", "NullTokenizer")]
    at = base.index("--vocab-size")
    no_vocab = base[:at] + base[at + 2:]
    args = parse_args([*no_vocab, "--tokenizer-model", corpus[1]])
    assert args.vocab_size is None and args.mock_data
    assert "--mock-data needs --vocab-size N or --tokenizer-model" in _refused(no_vocab, capsys)


@pytest.mark.parametrize("flag", sorted(megatron_lm_flags.KERNEL_SWITCHES) + ["--optimizer adam", "--logging-level 20",
                                                                             "--recompute-modules core_attn"])
def test_kernel_switches_are_accepted(tmp_path, flag):
    parse_args([*llama(tmp_path), *flag.split()])


def test_recompute_modules_other_than_core_attn_are_refused(tmp_path, capsys):
    err = _refused([*llama(tmp_path), "--recompute-modules", "core_attn", "mlp"], capsys)
    assert "--recompute-modules core_attn mlp: selective recompute here recomputes core attention only" in err


@pytest.mark.parametrize("values, gpu, fields", [
    ({"cross_entropy_loss_fusion": True}, True, {"cross_entropy_loss_fusion": True}),
    ({"cross_entropy_loss_fusion": True}, False, {}),
    ({"cross_entropy_loss_fusion": False}, True, {}),
    ({}, True, {}),  # a namespace from before the flag existed (an old run's config)
])
def test_the_fused_cross_entropy_is_asked_for_on_a_gpu_only(values, gpu, fields):
    """--cross-entropy-loss-fusion sets the model's TransformerConfig field on a GPU (training/setup.py passes
    torch.cuda.is_available()), nothing on CPU, where the unfused cross entropy computes the same loss; called with
    the GPU's answer given, so both sides are checked here."""
    assert megatron_lm_flags.config_fields(argparse.Namespace(**values), gpu=gpu) == fields


def test_the_script_asks_for_the_fused_cross_entropy_on_a_gpu(tmp_path):
    """The Llama script passes --cross-entropy-loss-fusion: the flag parses into the field the GPU's config reads."""
    args = parse_args(llama(tmp_path))
    assert args.cross_entropy_loss_fusion
    assert megatron_lm_flags.config_fields(args, gpu=True) == {"cross_entropy_loss_fusion": True}
    assert megatron_lm_flags.config_fields(args, gpu=False) == {}


# resolve, called directly: a namespace holding exactly what it reads (the parser's defaults but a global batch of
# 4), the layer each value came from (0 or absent: the built-in default, 1 recipe, 2 config file, 3 command line),
# what it changes and its errors in their order
RESOLVE_BASE = dict(split="98,2,0", recipe=None, config=None, recompute_activations=False, recompute_granularity=None,
                    sequence_parallel=False, tensor_model_parallel_size=1, global_batch_size=4, rampup_batch_size=None,
                    train_samples=None, train_iters=20, lr_warmup_samples=None, lr_warmup_iters=0,
                    lr_warmup_fraction=None, lr_decay_samples=None, lr_decay_iters=None)
ARCH = {"arch": 3}
MODEL = ("which model? give --arch (one of " + ", ".join(ARCHS) + "), or a --recipe or --config that names one")
RECOMPUTE = "--recompute-activations means --recompute-granularity selective: drop one of them"
RAMP_NEEDS = ("--rampup-batch-size needs --train-samples (Megatron-LM refuses it with --train-iters: expected no "
              "batch-size rampup for iteration-based training)")
RAMP_BAD = ("--rampup-batch-size 3 2 2: need 1 <= START <= --global-batch-size 4, INCR >= 1 dividing the difference, "
            "SAMPLES >= 0")
WARMUP_BOTH = "give --lr-warmup-iters or --lr-warmup-samples, not both"
DECAY_BOTH = "give --lr-decay-iters or --lr-decay-samples, not both"
ACT, FULL = dict(recompute_activations=True), dict(recompute_activations=True, recompute_granularity="full")
RESOLVE_EDGES = [
    ("nothing to resolve", {}, ARCH, {}, []),
    ("a split in quotes", {"split": "'99,1,0'"}, ARCH, {"split": "99,1,0"}, []),
    ("a split in double quotes and spaces", {"split": ' "99,1,0" '}, ARCH, {"split": "99,1,0"}, []),
    ("a split's typo kept for its refusal", {"split": "'98,2X'"}, ARCH, {"split": "98,2X"}, []),
    ("no model", {}, {}, {}, [MODEL]),
    ("the arch from a recipe", {}, {"arch": 1}, {}, []),
    ("a recipe names the model", {"recipe": "debug_satformer"}, {}, {}, []),
    ("a config file names the model", {"config": "run.yaml"}, {}, {}, []),
    ("--recompute-activations", ACT, {**ARCH, "recompute_activations": 3}, {"recompute_granularity": "selective"}, []),
    ("--recompute-activations of no layer", ACT, ARCH, {"recompute_granularity": "selective"}, []),
    ("--recompute-activations over selective", {**ACT, "recompute_granularity": "selective"},
     {**ARCH, "recompute_activations": 1, "recompute_granularity": 3}, {}, []),
    ("recompute full at the same layer", FULL, {**ARCH, "recompute_activations": 3, "recompute_granularity": 3}, {},
     [RECOMPUTE]),
    ("recompute full at a higher layer", FULL, {**ARCH, "recompute_activations": 2, "recompute_granularity": 3}, {},
     []),  # the higher layer wins (refused before: a config file's recompute could not be made full)
    ("recompute full at a lower layer", FULL, {**ARCH, "recompute_activations": 3, "recompute_granularity": 2},
     {"recompute_granularity": "selective"}, []),
    ("recompute both of no layer", FULL, ARCH, {}, [RECOMPUTE]),
    ("recompute full of no layer", FULL, {**ARCH, "recompute_activations": 1}, {"recompute_granularity": "selective"},
     []),
    ("recompute full alone", {"recompute_granularity": "full"}, ARCH, {}, []),
    ("sequence parallel at TP1", {"sequence_parallel": True}, ARCH, {"sequence_parallel": False}, []),
    ("sequence parallel at TP2", {"sequence_parallel": True, "tensor_model_parallel_size": 2}, ARCH, {}, []),
    ("a ramp without --train-samples", {"rampup_batch_size": (1, 1, 6)}, ARCH, {}, [RAMP_NEEDS]),
    ("a ramp counted", {"rampup_batch_size": (1, 1, 6), "train_samples": 20}, ARCH, {"train_iters": 7}, []),
    ("a ramp refused", {"rampup_batch_size": (3, 2, 2), "train_samples": 20}, ARCH, {}, [RAMP_BAD]),
    ("warm-up samples", {"lr_warmup_samples": 6, "lr_warmup_fraction": 0.1}, ARCH,
     {"lr_warmup_iters": 1.5, "lr_warmup_fraction": None}, []),
    ("warm-up samples and iters at one layer", {"lr_warmup_samples": 6, "lr_warmup_iters": 2},
     {**ARCH, "lr_warmup_iters": 3, "lr_warmup_samples": 3}, {"lr_warmup_iters": 1.5}, [WARMUP_BOTH]),
    ("warm-up samples over iters of a lower layer", {"lr_warmup_samples": 6, "lr_warmup_iters": 2},
     {**ARCH, "lr_warmup_iters": 1, "lr_warmup_samples": 3}, {"lr_warmup_iters": 1.5}, []),
    ("warm-up iters over samples of a lower layer", {"lr_warmup_samples": 6, "lr_warmup_iters": 2},
     {**ARCH, "lr_warmup_iters": 3, "lr_warmup_samples": 2}, {"lr_warmup_samples": None}, []),
    ("warm-up iters over samples of no layer", {"lr_warmup_samples": 6, "lr_warmup_iters": 2},
     {**ARCH, "lr_warmup_iters": 1}, {"lr_warmup_samples": None}, []),
    ("decay samples", {"lr_decay_samples": 9}, ARCH, {"lr_decay_iters": 2.25}, []),
    ("decay samples and iters at one layer", {"lr_decay_samples": 9, "lr_decay_iters": 5},
     {**ARCH, "lr_decay_iters": 2, "lr_decay_samples": 2}, {"lr_decay_iters": 2.25}, [DECAY_BOTH]),
    ("decay samples over iters of a lower layer", {"lr_decay_samples": 9, "lr_decay_iters": 5},
     {**ARCH, "lr_decay_iters": 1, "lr_decay_samples": 2}, {"lr_decay_iters": 2.25}, []),
    ("decay iters over samples of a lower layer", {"lr_decay_samples": 9, "lr_decay_iters": 5},
     {**ARCH, "lr_decay_iters": 2, "lr_decay_samples": 1}, {"lr_decay_samples": None}, []),
    ("decay iters over samples of no layer", {"lr_decay_samples": 9, "lr_decay_iters": 5},
     {**ARCH, "lr_decay_iters": 1}, {"lr_decay_samples": None}, []),
    ("every problem, in order", {**FULL, "rampup_batch_size": (1, 1, 6), "lr_warmup_samples": 6, "lr_warmup_iters": 2,
                                 "lr_decay_samples": 9, "lr_decay_iters": 5},
     {"recompute_activations": 3, "recompute_granularity": 3, "lr_warmup_iters": 3, "lr_warmup_samples": 3,
      "lr_decay_iters": 3, "lr_decay_samples": 3}, {"lr_warmup_iters": 1.5, "lr_decay_iters": 2.25},
     [MODEL, RECOMPUTE, RAMP_NEEDS, WARMUP_BOTH, DECAY_BOTH]),
]


@pytest.mark.parametrize("name, values, level, changed, errors", RESOLVE_EDGES, ids=[r[0] for r in RESOLVE_EDGES])
def test_resolve_at_its_edges(name, values, level, changed, errors):
    """megatron_lm_flags.resolve on both sides of each of its conditions: its errors exactly, in order, and the
    namespace afterwards exactly (what it sets, and nothing else)."""
    args = argparse.Namespace(**{**RESOLVE_BASE, **values})
    assert megatron_lm_flags.resolve(args, dict(level)) == errors
    assert vars(args) == {**RESOLVE_BASE, **values, **changed}


MOE = ("Mixture-of-Experts (MoE) is not supported here: the archs are dense ({}): drop the MoE flags to train the "
       "dense model of the same shape")
FSDP = ("Megatron-FSDP is not supported here ({}): drop its flags; --use-distributed-optimizer shards the optimizer "
        "state over data parallelism")
UNSUPPORTED_WORDS = [
    ([], [], []),
    (["--foo", "1"], [], ["--foo", "1"]),
    (["--num-experts", "8"], [MOE.format("--num-experts 8")], []),
    (["--num-experts=8"], [MOE.format("--num-experts=8")], []),  # the flag is the word up to its first "="
    (["--use-megatron-fsdp=a=b"], [FSDP.format("--use-megatron-fsdp=a=b")], []),
    (["--num-experts 8"], [], ["--num-experts 8"]),  # one word with a space (quoted in the script): no such flag
    (["--moe-router-topk", "2"], [MOE.format("--moe-router-topk 2")], []),  # "--moe-": a prefix
    (["--moe", "2"], [], ["--moe", "2"]),  # not under the prefix
    (["--num-expertsx", "2"], [], ["--num-expertsx", "2"]),  # a whole flag: not a prefix
    (["7", "--fsdp-double-buffer", "--foo", "x", "--num-experts", "8", "--use-nccl-ub", "--moe-grouped-gemm"],
     [MOE.format("--num-experts 8 --moe-grouped-gemm"), FSDP.format("--fsdp-double-buffer --use-nccl-ub")],
     ["7", "--foo", "x"]),  # a word before any flag is left; the problems in UNSUPPORTED's order
]


@pytest.mark.parametrize("words, found, rest", UNSUPPORTED_WORDS, ids=[" ".join(r[0]) or "none" for r in UNSUPPORTED_WORDS])
def test_unsupported_features_named_with_their_words(words, found, rest):
    """megatron_lm_flags.unsupported on argparse's unrecognized words: one problem per feature naming its flags with
    their values, exactly; the other words left for 'unrecognized arguments'."""
    assert megatron_lm_flags.unsupported(words) == (found, rest)


def test_recompute_activations_against_a_full_granularity_the_higher_layer_wins(tmp_path, capsys):
    """docs/ecosystem.md: --recompute-activations with --recompute-granularity full at the same layer exits 2, else
    the higher layer wins: a run's config file with recompute on takes --recompute-granularity full from the command
    line (refused before, with no way to drop the file's flag there), and --recompute-activations over a file's full."""
    base = ["--recipe", "debug_satformer", "--save", str(tmp_path / "r")]
    (tmp_path / "act.yaml").write_text("recompute_activations: true\nrecompute_granularity: selective\n")
    args = parse_args([*base, "--config", str(tmp_path / "act.yaml"), "--recompute-granularity", "full"])
    assert (args.recompute_activations, args.recompute_granularity) == (True, "full")
    assert parse_args([*base, "--config", str(tmp_path / "act.yaml")]).recompute_granularity == "selective"
    (tmp_path / "full.yaml").write_text("recompute_granularity: full\n")
    assert parse_args([*base, "--config", str(tmp_path / "full.yaml"),
                       "--recompute-activations"]).recompute_granularity == "selective"
    (tmp_path / "both.yaml").write_text("recompute_activations: true\nrecompute_granularity: full\n")
    err = _refused([*base, "--config", str(tmp_path / "both.yaml")], capsys)
    assert _problems(err) == ["--recompute-activations means --recompute-granularity selective: drop one of them"]
    assert not (tmp_path / "r").exists()


def test_sample_based_warmup_and_decay_against_iterations_the_higher_layer_wins(tmp_path, capsys):
    """docs/ecosystem.md: --lr-warmup-samples / --lr-decay-samples with the iterations at the same layer exit 2, else
    the higher layer wins (a config file's samples were applied over --lr-warmup-iters and --lr-decay-iters given on
    the command line, which were silently ignored). The recipe's global batch is 8."""
    base = ["--recipe", "debug_satformer", "--save", str(tmp_path / "r")]
    (tmp_path / "samples.yaml").write_text("lr_warmup_samples: 16\nlr_decay_samples: 64\n")
    args = parse_args([*base, "--config", str(tmp_path / "samples.yaml"), "--lr-warmup-iters", "1",
                       "--lr-decay-iters", "5"])
    assert (args.lr_warmup_iters, args.lr_warmup_samples, args.lr_decay_iters, args.lr_decay_samples) == (1, None, 5,
                                                                                                          None)
    args = parse_args([*base, "--config", str(tmp_path / "samples.yaml")])  # over the recipe's warm-up of 2 steps
    assert (args.lr_warmup_iters, args.lr_warmup_samples, args.lr_decay_iters, args.lr_decay_samples) == (2.0, 16, 8.0,
                                                                                                          64)
    (tmp_path / "iters.yaml").write_text("lr_warmup_iters: 1\nlr_decay_iters: 5\n")
    args = parse_args([*base, "--config", str(tmp_path / "iters.yaml"), "--lr-warmup-samples", "16",
                       "--lr-decay-samples", "64"])
    assert (args.lr_warmup_iters, args.lr_decay_iters) == (2.0, 8.0)
    err = _refused([*base, "--lr-warmup-iters", "1", "--lr-warmup-samples", "16", "--lr-decay-iters", "5",
                    "--lr-decay-samples", "64"], capsys)
    assert _problems(err) == ["give --lr-warmup-iters or --lr-warmup-samples, not both",
                              "give --lr-decay-iters or --lr-decay-samples, not both"]


def test_the_docs_table_of_the_megatron_lm_flags_is_the_parsers():
    """docs/ecosystem.md lists add_arguments' flags as --help shows them: the table between its markers is
    flags_markdown()'s, so a flag, a default or a help text changed without the docs fails here."""
    with open(os.path.join(ROOT, "docs", "ecosystem.md")) as f:
        text = f.read()
    assert flag_table.with_flags_table(text) == text, (
        "docs/ecosystem.md's table of the Megatron-LM flags is not add_arguments': rewrite it with "
        ".venv/bin/python -m megatron_sat.training.flag_table --write docs/ecosystem.md")


# add_arguments' flags on the debug recipe (satformer, sequence 32, 20 steps, global batch 8, warm-up 2 steps): the
# words given, then what the namespace changes to (exactly; a no-op changes its own value only) or the start of the
# one-line refusal, and whether the flag (the first word) names the run (arguments._group's names_run)
REFUSED_HERE = " conflicts with --arch satformer"
FLAG_ROWS = [
    ("--use-mcore-models", dict(use_mcore_models=True), False),
    ("--swiglu", dict(swiglu=True), False),
    ("--disable-bias-linear", dict(disable_bias_linear=True), False),
    ("--group-query-attention", dict(group_query_attention=True), False),
    ("--normalization RMSNorm", dict(normalization="RMSNorm"), False),
    ("--normalization LayerNorm", "--normalization LayerNorm" + REFUSED_HERE + ": every norm here is RMSNorm", False),
    ("--position-embedding-type rope", dict(position_embedding_type="rope"), False),
    ("--position-embedding-type learned_absolute", "--position-embedding-type learned_absolute" + REFUSED_HERE, False),
    ("--rotary-percent 1.0", dict(rotary_percent=1.0), False),
    ("--rotary-percent 0.99", "--rotary-percent 0.99" + REFUSED_HERE + ": RoPE rotates the whole head", False),
    ("--max-position-embeddings 32", dict(max_position_embeddings=32), False),
    ("--max-position-embeddings 31", "--max-position-embeddings 31 is below --seq-length 32", False),
    ("--attention-dropout 0", dict(attention_dropout=0.0), False),
    ("--attention-dropout 0.1", "--attention-dropout 0.1" + REFUSED_HERE, False),
    ("--hidden-dropout 0", dict(hidden_dropout=0.0), False),
    ("--hidden-dropout 0.1", "--hidden-dropout 0.1" + REFUSED_HERE, False),
    ("--apply-layernorm-1p", dict(apply_layernorm_1p=True), False),
    ("--apply-layernorm-1p --weight-decay-params all", "--apply-layernorm-1p with --weight-decay-params all", False),
    *((f"--attention-backend {b}", dict(attention_backend=b), False) for b in ("auto", "flash", "fused", "unfused", "local")),
    ("--attention-backend foo", "argument --attention-backend: invalid choice: 'foo'", False),
    ("--calculate-per-token-loss", dict(calculate_per_token_loss=True), False),
    ("--no-create-attention-mask-in-dataloader", dict(no_create_attention_mask_in_dataloader=True), False),
    ("--tiktoken-pattern v2", dict(tiktoken_pattern="v2"), False),
    ("--untie-embeddings-and-output-weights", dict(untie_embeddings_and_output_weights=True), True),
    # the kernel and fusion switches
    *((flag, {flag[2:].replace("-", "_"): True}, False) for flag in (
        "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
        "--no-gradient-accumulation-fusion", "--attention-softmax-in-fp32", "--use-rotary-position-embeddings",
        "--no-position-embedding", "--no-check-for-nan-in-loss-and-grad")),
    ("--optimizer adam", {}, False),  # the default
    ("--optimizer sgd", "argument --optimizer: invalid choice: 'sgd'", False),
    ("--logging-level 20", dict(logging_level=20), False),
    ("--recompute-modules core_attn", dict(recompute_modules=["core_attn"]), False),
    ("--recompute-modules core_attn mlp", "--recompute-modules core_attn mlp: selective recompute here recomputes "
     "core attention only", False),
    # training, data and logging
    ("--lr-warmup-samples 12", dict(lr_warmup_samples=12, lr_warmup_iters=1.5), True),
    ("--lr-decay-samples 64", dict(lr_decay_samples=64, lr_decay_iters=8.0), True),
    ("--rampup-batch-size 2 2 8 --train-samples 40", dict(rampup_batch_size=[2, 2, 8], train_samples=40, train_iters=7),
     True),
    ("--rampup-batch-size 2 2 8", "--rampup-batch-size needs --train-samples", True),
    ("--recompute-activations", dict(recompute_activations=True, recompute_granularity="selective"), False),
    ("--num-workers 2", dict(num_workers=2), False),
    ("--no-mmap-bin-files", dict(mmap_bin_files=False), False),
    ("--overlap-param-gather", dict(overlap_param_gather=True), False),
    ("--manual-gc", dict(manual_gc=True), False),
    ("--manual-gc-interval 5", dict(manual_gc_interval=5), False),
    ("--cross-entropy-loss-fusion", dict(cross_entropy_loss_fusion=True), False),
    *((f"--empty-unused-memory-level {n}", dict(empty_unused_memory_level=n), False) for n in (0, 1, 2)),
    ("--empty-unused-memory-level 3", "argument --empty-unused-memory-level: invalid choice: 3", False),
    ("--decoupled-lr 1e-3", dict(decoupled_lr=1e-3), True),
    ("--decoupled-min-lr 1e-5 --decoupled-lr 1e-3", dict(decoupled_min_lr=1e-5, decoupled_lr=1e-3), True),
    ("--decoupled-min-lr 1e-5", "--decoupled-min-lr needs --decoupled-lr", True),
    ("--vocab-file v.json", "--vocab-file/--merge-file (GPT2BPETokenizer) are not read here", False),
    ("--merge-file m.txt", "--vocab-file/--merge-file (GPT2BPETokenizer) are not read here", False),
    ("--log-throughput", dict(log_throughput=True), False),
    ("--wandb-save-dir wb", dict(wandb_save_dir="wb"), False),
    # profiling (the range is checked with --profile: a default end of 12 within the 20 steps)
    ("--profile", dict(profile=True), False),
    ("--profile --profile-step-end 21", "--profile-step-start 10 to --profile-step-end 21 ends past the run's last "
     "step (--train-iters 20)", False),
    ("--profile-step-start 3", dict(profile_step_start=3), False),
    ("--profile-step-end 20", dict(profile_step_end=20), False),
    ("--use-pytorch-profiler", dict(use_pytorch_profiler=True), False),
    ("--profile-ranks 0 1", dict(profile_ranks=[0, 1]), False),
    ("--record-memory-history", dict(record_memory_history=True), False),
    ("--memory-snapshot-path m.pickle", dict(memory_snapshot_path="m.pickle"), False),
    ("--log-memory-to-tensorboard", dict(log_memory_to_tensorboard=True), False),
    ("--log-timers-to-tensorboard", dict(log_timers_to_tensorboard=True), False),
    *((f"--timing-log-level {n}", dict(timing_log_level=n), False) for n in (0, 1, 2)),
    ("--timing-log-level 3", "argument --timing-log-level: invalid choice: 3", False),
]
# what each of them is without the flag (every one: a flag added without a row here fails the test below)
FLAG_DEFAULTS = dict(
    use_mcore_models=False, swiglu=False, disable_bias_linear=False, group_query_attention=False, normalization=None,
    position_embedding_type=None, rotary_percent=None, max_position_embeddings=None, attention_dropout=None,
    hidden_dropout=None, apply_layernorm_1p=False, attention_backend=None, calculate_per_token_loss=False,
    no_create_attention_mask_in_dataloader=False, tiktoken_pattern=None, untie_embeddings_and_output_weights=False,
    no_masked_softmax_fusion=False, no_bias_swiglu_fusion=False, no_bias_dropout_fusion=False, no_rope_fusion=False,
    no_gradient_accumulation_fusion=False, attention_softmax_in_fp32=False, use_rotary_position_embeddings=False,
    no_position_embedding=False, no_check_for_nan_in_loss_and_grad=False, optimizer="adam", logging_level=None,
    recompute_modules=None, lr_warmup_samples=None, lr_decay_samples=None, rampup_batch_size=None,
    recompute_activations=False, num_workers=0, mmap_bin_files=True, overlap_param_gather=False, manual_gc=False,
    manual_gc_interval=0, cross_entropy_loss_fusion=False, empty_unused_memory_level=0, decoupled_lr=None,
    decoupled_min_lr=None, vocab_file=None, merge_file=None, log_throughput=False, wandb_save_dir=None, profile=False,
    profile_step_start=10, profile_step_end=12, use_pytorch_profiler=False, profile_ranks=[0],
    record_memory_history=False, memory_snapshot_path=None, log_memory_to_tensorboard=False,
    log_timers_to_tensorboard=False, timing_log_level=0)


def _recipe(tmp_path) -> list:
    return ["--recipe", "debug_satformer", "--save", str(tmp_path / "r")]


@pytest.mark.parametrize("words, outcome, names_run", FLAG_ROWS, ids=[r[0] for r in FLAG_ROWS])
def test_each_megatron_lm_flag_parses_as_documented(tmp_path, capsys, words, outcome, names_run):
    """Each flag of add_arguments through the real parser: accepted with exactly its own value (a no-op: nothing
    else changes, but what resolve derives from it), or refused in one line starting with its problem; and whether
    another value of it is another run (names_run, read by the run-folder names)."""
    from megatron_sat.training.arguments import build_parser

    assert build_parser()._option_string_actions[words.split()[0]].names_run is names_run
    if isinstance(outcome, str):
        found = _problems(_refused([*_recipe(tmp_path), *words.split()], capsys))
        assert len(found) == 1 and found[0].startswith(outcome), found
        return
    base = vars(parse_args(_recipe(tmp_path)))
    assert vars(parse_args([*_recipe(tmp_path), *words.split()])) == {**base, **outcome}


def test_the_megatron_lm_flags_defaults_and_rows(tmp_path):
    """Without the flags, each value is FLAG_DEFAULTS' (off, or Megatron-LM's default); and FLAG_ROWS has a row for
    every flag add_arguments defines, FLAG_DEFAULTS every value it sets."""
    from megatron_sat.training.arguments import _group

    parser = argparse.ArgumentParser(add_help=False)
    megatron_lm_flags.add_arguments(parser, _group)
    assert {a.dest for a in parser._actions} == set(FLAG_DEFAULTS)
    assert {s for a in parser._actions for s in a.option_strings} == {words.split()[0] for words, _, _ in FLAG_ROWS}
    args = vars(parse_args(_recipe(tmp_path)))
    assert {dest: args[dest] for dest in FLAG_DEFAULTS} == FLAG_DEFAULTS
