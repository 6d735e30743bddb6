"""Hugging Face folder -> a checkpoint the trainer continues from, for any TP/PP layout.

    python tools/convert_from_hf.py --hf hf/satformer --save runs/sat-import \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --lr 3e-5 --train-iters 1000
    megatron-sat-torchrun --nproc-per-node 4 -m megatron_sat.train --config runs/sat-import/config.json \\
        --pretrained-checkpoint runs/sat-import --save runs/sat-continued --data-path DATA --seq-length 4096

Every flag after --hf/--save is a trainer flag (megatron_sat/training/arguments.py); the model's
shape (arch, sizes, head dim, q/k norms, norm eps, gate, last-k, lambdas, rotary base and Llama 3.1+ RoPE
scaling, tying, positions) comes from the HF config and must not be given. The training settings an import
cannot choose (PLACEHOLDERS: --lr, --train-iters, --seq-length), when not given here, are written to
config.json as "placeholders" without a value: a run on `--config SAVE/config.json` must give them, and the
import prints that command (next_step). Official Qwen3 (Qwen3ForCausalLM) and Llama (LlamaForCausalLM:
--no-qk-layernorm, its norm eps) folders import as the Transformer; with `--arch satformer` (and
optionally --value-residual-gate relu|tanh|identity, --value-residual-last-k, --upcycle-gate-std) one starts a
SATFormer whose W_alpha is drawn from N(0, std^2) (default 1e-4: the gate open in about half its units, within a
tiny step of the Transformer; --upcycle-gate-std 0 is exactly the Transformer, whose ReLU gate never opens), with
`--arch resformer` a ResFormer at lambda1 = 0, lambda2 = 1 (exactly the Transformer): model/upcycle.py, the same
start the trainer's --pretrained-checkpoint of a Transformer run makes.
SAVE is locked as the trainer locks a run folder (megatron_sat/training/run_lock.py).
What is written (megatron_sat.training.checkpointing's format):

  SAVE/iter_0000000/                      model weights, a fresh optimizer, the LR schedule the
                                          given flags make, and the arguments (common 'args'); its
                                          manifest.json, checked by every reader as the trainer's are
  SAVE/latest_checkpointed_iteration.txt  -> 0
  SAVE/config.json                        the recorded arguments (a --config file; the placeholders
                                          left out and listed under "placeholders")
  SAVE/tokenizer/                         the HF folder's tokenizer, when it has one

A plain `--load` restores optimizer and scheduler state too, so the checkpoint has both: Adam
moments are zero and the step counter is stored as 1e-30 (megatron-core does not save a step of 0,
and float32 1e-30 + 1 == 1, so the first step is exactly a fresh Adam step). The LR schedule
recorded is the one the flags given here define: resume with the same schedule flags, or start a
new run with `--pretrained-checkpoint SAVE`, which takes the weights only and follows the training
command's schedule.
The weights are written once, at TP1/PP1, from one process; dist-checkpointing reshards them to the
layout the trainer runs at, and the layout flags given here are validated against the model and
recorded. With --bf16 the weights are rounded to bfloat16 and the fp32 master copy starts from them.
"""

import dataclasses
import json
import os
import shutil
from typing import List, Optional

import torch
from megatron.core.transformer.module import Float16Module
from transformers import AutoTokenizer

from megatron_sat import archs
from megatron_sat.conversion import hf_io, megatron_io
from megatron_sat.conversion.mapping import (
    ConversionError,
    check_shapes,
    hf_to_megatron,
    megatron_shapes,
    spec_from_hf_config,
)
from megatron_sat.model import upcycle
from megatron_sat.model.args import FLAGGED, RESUME_FIELDS, model_args, record
from megatron_sat.outputs import check_output
from megatron_sat.parallel.layout import validate
from megatron_sat.training import checkpointing as ckpt
from megatron_sat.training.arguments import build_parser
from megatron_sat.training.run_lock import LockHeld, NotWritable, RunLock
from megatron_sat.training.setup import precision_and_layout, scheduler
from megatron_sat.training.step import build_optimizer, wrap_ddp

# the flags the HF config gives: the model flags that must match on resume (model/args.py; RoPE scaling among them),
# the rotary base, the tying and the positions (Megatron-LM's --max-position-embeddings, which the export reads
# back); the others (the gate's implementation, the output layers' init, the local core attention) are the import
# command's
MODEL_FLAGS = tuple(k for k in FLAGGED if k in RESUME_FIELDS)
SHAPE_FLAGS = MODEL_FLAGS + ("rotary_base", "untie_embeddings_and_output_weights", "max_position_embeddings")
# the training settings an import cannot choose: the trainer's defaults (lr 1e-3, 20 steps) and the HF model's whole
# context are no way to continue a pretrained model. Those not given on the import's command line are written to
# config.json as "placeholders" (dest: what to choose), without a value, and a run with --config SAVE/config.json is
# refused until its command line gives them (training/config_file.py)
PLACEHOLDERS = {
    "lr": "the peak learning rate of the continued pretraining (well below a from-scratch run's)",
    "train_iters": "how many steps to train (or --train-samples)",
    "seq_length": "the training context, at most the model's positions (--max-position-embeddings {positions})",
}
ADAM_STEP = 1e-30


def trainer_args(spec, trainer_argv: List[str]):
    """(the trainer's argument namespace: its defaults, the given flags and the model's shape; the ModelSpec to
    write: `spec`, or its SATFormer under `--arch satformer`)."""
    parser = build_parser()
    passed = {(a.dest, opt) for a in parser._actions for opt in a.option_strings
              if any(x == opt or x.startswith(opt + "=") for x in trainer_argv)}
    given = {dest for dest, _ in passed}
    args = parser.parse_args(trainer_argv)
    source, grow = spec, "arch" in given and args.arch != spec.arch
    if grow and not archs.get(spec.arch).plain:
        raise ConversionError(f"--arch {args.arch} on a {spec.arch} model: only a Transformer (Qwen3, Llama) can "
                              f"start another arch (--arch {' or --arch '.join(archs.UPCYCLE_TARGETS)}); drop --arch")
    switch = archs.get(args.arch).upcycle_switch  # the new arch's own switches: the command's
    clash = sorted(opt for dest, opt in passed if dest in SHAPE_FLAGS and not (grow and (dest == "arch" or switch(dest))))
    if clash:
        raise ConversionError("the model's shape comes from the HF config; do not pass " + ", ".join(clash))
    if grow:
        spec = dataclasses.replace(spec, arch=args.arch, **{f.name: getattr(args, f.name) for f in dataclasses.fields(spec)
                                                            if switch(f.name) and hasattr(args, f.name)})
        errors = archs.upcycle_errors(source.arch, spec, "the HF folder")
        if errors:
            raise ConversionError("; ".join(errors))
    if float(spec.rotary_base) != int(spec.rotary_base):
        raise ConversionError(f"rope theta {spec.rotary_base} is not an integer (--rotary-base is)")
    for name in MODEL_FLAGS:  # the model as flags: the trainer builds the rest (ModelArgs' fixed fields) itself
        setattr(args, name, getattr(spec, name))
    built = record(model_args(args))
    fixed = [f"{k} {getattr(spec, k)!r}" for k in RESUME_FIELDS if built[k] != getattr(spec, k)]
    if fixed:
        raise ConversionError(f"this model has {', '.join(fixed)}, which the trainer's models do not have")
    args.rotary_base = int(spec.rotary_base)
    args.untie_embeddings_and_output_weights = not spec.tied
    if "seq_length" in given and args.seq_length > spec.max_position_embeddings:  # not given: a placeholder below
        raise ConversionError(f"--seq-length {args.seq_length} is beyond the model's {spec.max_position_embeddings} "
                              "positions (max_position_embeddings): give at most that")
    args.max_position_embeddings = spec.max_position_embeddings
    args.placeholders = {k: why.format(positions=spec.max_position_embeddings) for k, why in PLACEHOLDERS.items()
                         if k not in given and not (k == "train_iters" and "train_samples" in given)}
    if "seq_length" in args.placeholders:  # the layout is checked (and the checkpoint's schedule made) at this length
        args.seq_length = spec.max_position_embeddings
    return args, spec


def started(weights: dict, spec, args) -> dict:
    """A Transformer's Megatron weights plus the own parameters of the arch it starts (`spec`), as the trainer's
    --pretrained-checkpoint start sets them (model/upcycle.py: the same values at every layout), checked against
    the arch's names and shapes."""
    like = weights["embedding.word_embeddings.weight"]
    shapes = megatron_shapes(spec)
    own = upcycle.full_starts(archs.get(spec.arch), spec, shapes, weights, args.upcycle_gate_std, args.seed)
    weights = dict(weights, **{k: v.to(like.dtype) for k, v in own.items()})
    check_shapes(weights, shapes, f"the {spec.arch} started from the Transformer")
    return weights


def resolve_resformer_lambdas(spec, state: dict) -> None:
    """An export of a 'fixed' ResFormer says so; keep it fixed only if its lambdas still are 0.5."""
    if not archs.get(spec.arch).hf_only_weights(spec):
        return
    lam1 = state["model.lambda_manager.lambda_scale"] * torch.softmax(state["model.lambda_manager.lambda_logits"], 0)
    lam2 = [v for k, v in state.items() if k.endswith("value_residual_mixing.lambda2")]
    idx = [n - 2 for n in spec.mixing_layers]
    if not (torch.allclose(lam1[idx], torch.full((len(idx),), 0.5), atol=1e-6)
            and all(float(v) == 0.5 for v in lam2)):
        spec.resformer_lambdas = "learned"


def import_hf(hf_dir: str, save: str, trainer_argv: Optional[List[str]] = None, overwrite: bool = False,
              log=print) -> dict:
    """Convert; returns a summary (arch, checkpoint folder, layout checked, parameters)."""
    try:
        check_output("--save", save, {"--hf": hf_dir})
    except ValueError as e:
        raise ConversionError(str(e)) from None
    cfg = hf_io.read_hf_config(hf_dir)
    source = spec_from_hf_config(cfg)
    state = hf_io.read_hf_weights(hf_dir)
    resolve_resformer_lambdas(source, state)
    weights = hf_to_megatron(state, source)  # checks names and shapes first
    args, spec = trainer_args(source, list(trainer_argv or []))  # spec: source, or the SATFormer it starts
    if spec.arch != source.arch:
        weights = started(weights, spec, args)
    save = os.path.abspath(save)
    if os.path.exists(os.path.join(save, ckpt.TRACKER)) and not overwrite:
        raise ConversionError(f"{save} already holds a checkpoint (pass --overwrite to replace it)")

    megatron_io.init_single_process()
    bf16, dist_opt, dtype, target = precision_and_layout(args)
    config, chunks = megatron_io.make_model(spec, dtype)
    # the world this layout needs; its CP check of the backend is the trainer's (which knows whether TE runs)
    validate(target, config, target.tp * target.pp * target.cp, seq_length=args.seq_length, backend="te")
    megatron_io.set_full_state(chunks[0], {k: v.to(dtype) for k, v in weights.items()})
    if bf16:
        chunks = [Float16Module(config, c) for c in chunks]
    chunks = wrap_ddp(chunks, config, use_distributed_optimizer=dist_opt)
    optimizer = build_optimizer(chunks, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                                clip_grad=args.clip_grad, betas=(args.adam_beta1, args.adam_beta2),
                                eps=args.adam_eps, bf16=bf16, use_distributed_optimizer=dist_opt)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt.init_state_fn(opt.optimizer, opt.config)
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                opt.optimizer.state[p]["step"] = torch.tensor(ADAM_STEP)
    lr_scheduler = scheduler(optimizer, args)  # the trainer's, from the flags given here
    try:  # the trainer's lock: no import into a folder a job trains in
        lock = RunLock(save, log).acquire()
    except (LockHeld, NotWritable) as e:
        raise ConversionError(str(e)) from None
    try:
        return _write(save, hf_dir, spec, args, chunks, optimizer, lr_scheduler, weights, target, dtype, overwrite, log)
    finally:
        lock.release()


def _write(save, hf_dir, spec, args, chunks, optimizer, lr_scheduler, weights, target, dtype, overwrite, log) -> dict:
    """The checkpoint (with its manifest, as every trainer save), config.json and the tokenizer into `save`."""
    if overwrite:
        for name in os.listdir(save):
            if name.startswith("iter_"):
                shutil.rmtree(os.path.join(save, name))
    tok_src = os.path.join(hf_dir, "tokenizer_config.json")
    if os.path.isfile(tok_src) or os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        tok_dir = os.path.join(save, "tokenizer")
        AutoTokenizer.from_pretrained(hf_dir).save_pretrained(tok_dir)
        if not args.tokenizer_model:
            args.tokenizer_model = tok_dir
    placeholders = args.placeholders
    recorded = {k: v for k, v in vars(args).items() if k != "placeholders"}
    model = record(model_args(args))  # the model's ModelArgs, as the trainer records it
    path = ckpt.save_checkpoint(save, 0, chunks, optimizer, lr_scheduler, consumed_samples=0, args=recorded,
                                model=model)
    chosen = {k: v for k, v in recorded.items() if k not in placeholders}  # a placeholder has no value to read
    with open(os.path.join(save, "config.json.tmp"), "w") as f:
        json.dump(dict(chosen, vocab_size=spec.vocab_size, imported_from=os.path.abspath(hf_dir), model=model,
                       placeholders=placeholders), f, indent=1, sort_keys=True, default=str)
    os.replace(os.path.join(save, "config.json.tmp"), os.path.join(save, "config.json"))
    info = dict(arch=spec.arch, checkpoint=path, layout=target.describe(target.tp * target.pp),
                parameters=sum(t.numel() for t in weights.values()), dtype=str(dtype).replace("torch.", ""),
                placeholders=sorted(placeholders), next=next_step(save, args, placeholders))
    log(f"wrote {path}: {spec.arch}, {info['parameters']:,} parameters, {info['dtype']}; checked for layout "
        f"{info['layout']}")
    log(f"next, continued pretraining from these weights (a fresh optimizer and LR schedule):\n  {info['next']}")
    if placeholders:
        log(f"{save}/config.json leaves these to the command line: "
            + "; ".join(f"--{k.replace('_', '-')}: {why}" for k, why in placeholders.items()))
    return info


def next_step(save: str, args, placeholders: dict) -> str:
    """The command that continues pretraining from the import: its config.json (the model, the layout and the
    settings given to the import), the weights only (--pretrained-checkpoint), a new run folder, the data and the
    placeholders still to choose."""
    ranks = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    launch = ("python -m megatron_sat.train" if ranks == 1 else
              f"megatron-sat-torchrun --nproc-per-node {ranks} -m megatron_sat.train")
    choose = " ".join(f"--{k.replace('_', '-')} {k.upper()}" for k in placeholders)
    return (f"{launch} --config {save}/config.json --pretrained-checkpoint {save} --save RUN --data-path DATA"
            + (f" {choose}" if choose else ""))
