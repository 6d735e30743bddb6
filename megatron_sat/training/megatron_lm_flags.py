"""Megatron-LM's pretrain_gpt.py flags that a Megatron-LM script brings, under their own argument group.

Three kinds (docs/ecosystem.md, "Megatron-LM flags", lists each):

- flags that describe the model the archs here already are (the Llama block: RMSNorm, SwiGLU, RoPE, no biases, no
  dropout, ...): a no-op when the value matches, a one-line refusal naming the conflict when it does not
  (argument_checks.megatron_lm_flag_errors);
- flags that work as in Megatron-LM: the sample-based schedule and batch-size ramp-up (`resolve`,
  `global_batch_at`), --recompute-activations, --num-workers, --no-mmap-bin-files, --overlap-param-gather,
  --manual-gc, --untie-embeddings-and-output-weights, --wandb-save-dir (--init-method-std, --kv-channels,
  --norm-epsilon and --qk-layernorm are ModelArgs fields);
- flags accepted for what they do on a GPU only (fusions, empty_cache, kernel choice): documented, no effect on CPU;
- kernel and fusion switches that change nothing here (KERNEL_SWITCHES): accepted, documented no-ops;
- what this trainer does not have, Mixture-of-Experts and Megatron-FSDP (`unsupported`): one problem each, naming
  the flags given, reported with the others in the one refusal line.

Registered from arguments.build_parser with `add_arguments(parser, group)`; `resolve` runs with the layered
arguments (it converts samples to steps), `errors` with the other argument checks. No torch here.

docs/ecosystem.md's table of these flags is written by flag_table.py (after changing a flag or its help).
"""

import argparse
from typing import List, Optional, Sequence, Tuple

from megatron_sat import archs
from megatron_sat.archs import ARCHS
from megatron_sat.model import args as model_args

# the values the archs here have: the fixed fields of the one model description (model/args.py), and RoPE
NORMALIZATION = model_args.defaults()["normalization"]
POSITION_EMBEDDING = "rope"


def add_arguments(parser: argparse.ArgumentParser, group) -> None:
    """The flags, in two groups made with arguments._group (`group(parser, title, names_run)`)."""
    g = group(parser, "Megatron-LM model description (no-ops when they match the arch; refused otherwise)",
              names_run=False)
    g("--use-mcore-models", action="store_true", help="no-op: every model here is a Megatron-Core GPTModel")
    g("--swiglu", action="store_true", help="no-op: every arch's MLP is SwiGLU")
    g("--disable-bias-linear", action="store_true", help="no-op: no linear layer here has a bias")
    g("--group-query-attention", action="store_true",
      help="no-op: grouped-query attention is --num-query-groups (default: one group per head)")
    g("--normalization", default=None, help=f"no-op when {NORMALIZATION} (every norm here); anything else is refused")
    g("--position-embedding-type", default=None,
      help=f"no-op when {POSITION_EMBEDDING} (every arch here); anything else is refused")
    g("--rotary-percent", type=float, default=None, help="no-op when 1.0 (RoPE on the whole head); else refused")
    g("--max-position-embeddings", type=int, default=None,
      help="no-op when >= --seq-length (RoPE has no position table); a smaller value is refused")
    g("--attention-dropout", type=float, default=None, help="no-op when 0 (no dropout here); else refused")
    g("--hidden-dropout", type=float, default=None, help="no-op when 0 (no dropout here); else refused")
    g("--apply-layernorm-1p", action="store_true",
      help="no-op under --weight-decay-params matrices: a norm weight stored as 1 + w starts at the same 1 and takes "
           "the same Adam steps when norms are not decayed; refused with --weight-decay-params all")
    g("--attention-backend", default=None, choices=["auto", "flash", "fused", "unfused", "local"],
      help="accepted: a kernel choice, the same attention. Transformer Engine picks its kernel; the local "
           "implementation uses --local-attention")
    g("--calculate-per-token-loss", action="store_true",
      help="no-op: the loss here is always the mean over the step's tokens (Megatron-Core's per-token loss)")
    g("--no-create-attention-mask-in-dataloader", action="store_true",
      help="no-op: the loader never builds a mask (causal attention in the kernel)")
    g("--tiktoken-pattern", default=None, help="accepted: Megatron-LM's TikTokenizer only; no effect here")
    g("--untie-embeddings-and-output-weights", action="store_true", names_run=True,
      help="a separate output layer (default: tied to the input embedding)")
    g = group(parser, "Megatron-LM kernel and fusion switches (accepted; no effect here)", names_run=False)
    for flag, why in KERNEL_SWITCHES.items():
        g(flag, action="store_true", help="no-op: " + why)
    g("--optimizer", default="adam", choices=["adam"],
      help="no-op: the optimizer is Megatron-Core's Adam with decoupled weight decay (Megatron-LM's adam); sgd is "
           "not offered")
    g("--logging-level", type=int, default=None, metavar="LEVEL",
      help="accepted: Megatron-LM's Python logging level; the trainer's own lines are always printed")
    g("--recompute-modules", nargs="+", default=None, metavar="MODULE",
      help="with --recompute-granularity selective: core_attn (Megatron-LM's default, what selective recompute "
           "recomputes here); other modules are refused")
    g = group(parser, "Megatron-LM training, data and logging flags", names_run=False)
    g("--lr-warmup-samples", type=int, default=None, metavar="N", names_run=True,
      help="warm up over N samples (Megatron-LM's sample-based schedule: N / global batch steps, fractional allowed)")
    g("--lr-decay-samples", type=int, default=None, metavar="N", names_run=True,
      help="decay over N samples (N / global batch steps); default: --lr-decay-iters, else the training length")
    g("--rampup-batch-size", nargs=3, type=int, default=None, metavar=("START", "INCR", "SAMPLES"), names_run=True,
      help="Megatron-LM's batch-size ramp-up: the global batch grows from START by INCR over SAMPLES samples; "
           "needs --train-samples (Megatron-LM refuses it with --train-iters)")
    g("--recompute-activations", action="store_true",
      help="Megatron-LM's shorthand for --recompute-granularity selective")
    g("--num-workers", type=int, default=0, help="DataLoader worker processes per rank (0: load in the training process)")
    g("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
      help="read the .bin files with plain reads instead of memory maps (Megatron-Core's mmap_bin_files)")
    g("--overlap-param-gather", action="store_true",
      help="with --use-distributed-optimizer: all-gather updated parameters during the next forward (Megatron-Core)")
    g("--manual-gc", action="store_true",
      help="turn Python's automatic garbage collector off and collect every --manual-gc-interval steps (same on "
           "CPU and GPU: avoids collection pauses that desynchronise ranks)")
    g("--manual-gc-interval", type=int, default=0, metavar="N", help="with --manual-gc: collect every N steps (0: never "
      "during training, at evaluations only)")
    g("--cross-entropy-loss-fusion", action="store_true",
      help="Megatron-Core's fused cross entropy on a GPU (same loss); on CPU the unfused one runs")
    g("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
      help="on a GPU, torch.cuda.empty_cache() after each step (1 and 2: after the step; no effect on CPU)")
    g("--decoupled-lr", type=float, default=None, names_run=True,
      help="a separate peak LR for the input embedding and output layer (Megatron-Core's decoupled_lr)")
    g("--decoupled-min-lr", type=float, default=None, names_run=True,
      help="their minimum LR (Megatron-Core's decoupled_min_lr)")
    g("--vocab-file", default=None, metavar="FILE", help="refused (GPT2BPETokenizer files): see --merge-file")
    g("--merge-file", default=None, metavar="FILE",
      help="refused: GPT-2 BPE vocab/merge files are read as a Hugging Face tokenizer here (the refusal says how)")
    g("--log-throughput", action="store_true",
      help="accepted: the step line always shows tokens/s (per job and per device) and TFLOP/s per device")
    g("--wandb-save-dir", default=None, metavar="DIR", help="wandb's local folder (default: the run folder)")
    g = group(parser, "profiling (Megatron-LM's flags; training/profiler.py)", names_run=False)
    g("--profile", action="store_true",
      help="profile steps --profile-step-start to --profile-step-end: with --use-pytorch-profiler a torch profiler "
           "trace in RUN/profile/ (TensorBoard and Perfetto read it; CPU and GPU), else an nsys capture range "
           "(cudaProfilerStart/Stop; GPU only, nothing recorded on CPU)")
    g("--profile-step-start", type=int, default=10, help="first profiled step (1-based, as the step line counts)")
    g("--profile-step-end", type=int, default=12, help="last profiled step")
    g("--use-pytorch-profiler", action="store_true", help="with --profile: torch.profiler, traces in RUN/profile/")
    g("--profile-ranks", nargs="+", type=int, default=[0], metavar="RANK", help="the ranks that profile")
    g("--record-memory-history", action="store_true",
      help="GPU: record CUDA allocator history (torch.cuda.memory._record_memory_history) and write a snapshot to "
           "--memory-snapshot-path on CUDA out-of-memory and at the end (open it at pytorch.org/memory_viz)")
    g("--memory-snapshot-path", default=None, metavar="FILE",
      help="where the memory snapshot goes (default RUN/profile/memory_snapshot_rankR.pickle)")
    g("--log-memory-to-tensorboard", action="store_true",
      help="accepted: memory (allocated, reserved, peak per device) is always logged where memory exists (GPU)")
    g("--log-timers-to-tensorboard", action="store_true",
      help="log the step's phases (data, forward-backward, optimizer, pipeline bubble) as timers/* scalars")
    g("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
      help="accepted: the phases logged with --log-timers-to-tensorboard are the same at every level")


# kernel and fusion switches of Megatron-LM's scripts: each names a faster kernel for the same computation (or a
# model property every arch here already has); accepted so that a script runs, and listed in docs/ecosystem.md
KERNEL_SWITCHES = {
    "--no-masked-softmax-fusion": "the attention softmax kernel is chosen by the attention backend",
    "--no-bias-swiglu-fusion": "no linear layer has a bias; SwiGLU is computed the same either way",
    "--no-bias-dropout-fusion": "no biases and no dropout here",
    "--no-rope-fusion": "RoPE is applied by Megatron-Core's own kernel choice; the same rotation",
    "--no-gradient-accumulation-fusion": "gradients accumulate in the main-gradient buffer either way",
    "--attention-softmax-in-fp32": "the attention kernels here compute the softmax in fp32",
    "--use-rotary-position-embeddings": "every arch here uses RoPE",
    "--no-position-embedding": "no learned position table: RoPE",
    "--no-check-for-nan-in-loss-and-grad": "the loss is checked every step here (a NaN stops the run with a report)",
}

# what Megatron-LM has and this trainer does not: (what, flag predicate, what to do)
UNSUPPORTED: Sequence[Tuple[str, tuple, str]] = (
    ("Mixture-of-Experts (MoE) is not supported here: the archs are dense", (
        "--num-experts", "--moe-", "--expert-model-parallel-size", "--expert-tensor-parallel-size"),
     "drop the MoE flags to train the dense model of the same shape"),
    ("Megatron-FSDP is not supported here", (
        "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--init-model-with-meta-device", "--use-nccl-ub",
        "--fsdp-", "--megatron-fsdp-", "--outer-dp-sharding-strategy", "--num-distributed-optimizer-instances"),
     "drop its flags; --use-distributed-optimizer shards the optimizer state over data parallelism"),
)


def describe_arch(arch: str) -> str:
    """The arch as the run banner names it, with its module's note (the Transformer says what its block is)."""
    note = archs.get(arch).banner_note
    return f"{arch} ({note})" if note else arch


def unsupported(unknown: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(problems, rest) of argparse's unrecognized words: one problem per UNSUPPORTED feature whose flags are among
    them (naming them with their values), the other words left for the generic 'unrecognized arguments'."""
    groups, rest = {}, []
    current = None
    for word in unknown:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            current = next((what for what, flags, _ in UNSUPPORTED
                            if any(flag == f or (f.endswith("-") and flag.startswith(f)) for f in flags)), None)
        target = groups.setdefault(current, []) if current else rest
        target.append(word)
    problems = [f"{what} ({' '.join(groups[what])}): {fix}" for what, _, fix in UNSUPPORTED if what in groups]
    return problems, rest


def resolve(args: argparse.Namespace, level: dict) -> List[str]:
    """What depends on other flags: --recompute-activations, the sample-based schedule and the ramp-up's training
    length; `level` says where each value came from (arguments._resolve). Returns the errors."""
    errors = []
    # Megatron-LM's scripts pass "--split '99,1,0'" as one word that bash splits on the space, so the quotes reach
    # the program; Megatron-LM reads the numbers out of it, and so does this trainer
    if isinstance(args.split, str):
        args.split = args.split.strip().strip("'\"")
    if not (level.get("arch") or args.recipe or args.config):  # never a silent default model (a GPT script
        # would train SATFormer); a recipe or config file without an arch keeps the default, as it always did
        errors.append("which model? give --arch (one of " + ", ".join(ARCHS) + "), or a --recipe or --config that "
                      "names one")
    if args.recompute_activations:  # with a full granularity: refused at the same layer, else the higher one wins
        full_at = level.get("recompute_granularity", 0) if args.recompute_granularity == "full" else -1
        if full_at == level.get("recompute_activations", 0):
            errors.append("--recompute-activations means --recompute-granularity selective: drop one of them")
        elif full_at < level.get("recompute_activations", 0):
            args.recompute_granularity = "selective"
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # as Megatron-LM: sequence parallelism splits what TP shares; none at TP1
    gbs = args.global_batch_size
    if args.rampup_batch_size is not None:
        if args.train_samples is None:
            errors.append("--rampup-batch-size needs --train-samples (Megatron-LM refuses it with --train-iters: "
                          "expected no batch-size rampup for iteration-based training)")
        else:
            problem = rampup_error(args)
            if problem:
                errors.append(problem)
            else:
                args.train_iters = rampup_iterations(args)
    # sample-based schedule: in steps of the full global batch, fractional as Megatron-LM's sample count allows;
    # given with the iterations at the same layer: refused; else the higher layer wins
    for phase in ("warmup", "decay"):
        iters, samples = f"lr_{phase}_iters", f"lr_{phase}_samples"
        if getattr(args, samples) is None:
            continue
        if level.get(iters) and level.get(iters) == level.get(samples):
            errors.append(f"give --lr-{phase}-iters or --lr-{phase}-samples, not both")
        if level.get(iters, 0) > level.get(samples, 0):
            setattr(args, samples, None)
            continue
        setattr(args, iters, getattr(args, samples) / gbs)
        if phase == "warmup":
            args.lr_warmup_fraction = None  # the samples fix the warm-up
    return errors


def rampup_error(args: argparse.Namespace) -> Optional[str]:
    start, incr, samples = args.rampup_batch_size
    if start < 1 or incr < 1 or samples < 0 or start > args.global_batch_size \
            or (args.global_batch_size - start) % incr:
        return (f"--rampup-batch-size {start} {incr} {samples}: need 1 <= START <= --global-batch-size "
                f"{args.global_batch_size}, INCR >= 1 dividing the difference, SAMPLES >= 0")
    return None


def global_batch_at(args: argparse.Namespace, consumed: int) -> int:
    """The global batch of the step that starts after `consumed` samples (Megatron-Core's ramp-up rule: START plus
    INCR per SAMPLES / increments samples consumed, the full batch after SAMPLES), rounded down to a multiple of
    micro-batch x data-parallel size by the caller's num_microbatches."""
    if args.rampup_batch_size is None:
        return args.global_batch_size
    start, incr, samples = args.rampup_batch_size
    increments = (args.global_batch_size - start) // incr
    if increments == 0 or samples <= 0 or consumed > samples:  # SAMPLES 0: no ramp (Megatron-Core divides by 0)
        return args.global_batch_size
    return min(args.global_batch_size, start + int(consumed / (samples / increments)) * incr)


def rampup_iterations(args: argparse.Namespace) -> int:
    """Steps to consume --train-samples under the ramp-up (Megatron-LM's count: ramp steps, then full batches)."""
    consumed = iterations = 0
    while consumed <= args.rampup_batch_size[2] and consumed <= args.train_samples:
        consumed += global_batch_at(args, consumed)
        iterations += 1
    return iterations + max(0, args.train_samples - consumed) // args.global_batch_size


def config_fields(args: argparse.Namespace, gpu: bool) -> dict:
    """TransformerConfig fields these flags set (training/setup.py's model_config adds them)."""
    fields = {}
    if gpu and getattr(args, "cross_entropy_loss_fusion", False):
        fields["cross_entropy_loss_fusion"] = True
    return fields

