"""Megatron dist checkpoint (any TP/PP/VPP layout) -> Hugging Face folder, on CPU in one process.

    python tools/convert_to_hf.py --load runs/satformer --output hf/satformer            # latest iteration
    python tools/convert_to_hf.py --load runs/satformer/iter_0001000 --output hf/sat-1k --dtype bfloat16 --verify

Steps: find the checkpoint (a run folder -> its latest complete iteration), read the configuration
the trainer recorded in it, build the model at TP1/PP1 (dist-checkpointing reshards whatever layout
it was saved at), rename and split the weights (mapping.py), and write the folder aside before
moving it into place. Every folder carries its modeling code (trust_remote_code): the authors' classes
for SATFormer, ResFormer and the three baselines, a Qwen3 subclass for the Transformer; a model card
(README.md: model_card.py); megatron_sat_conversion.json, which names the run folder, iteration and tokenizer, not where they lay
(public_name: no path of the converting machine).
Every file is readable as the umask allows (hf_io.write_hf_folder; safetensors alone would write 0600).
"""

import json
import os
from typing import Optional

import torch
from megatron.core import dist_checkpointing
from transformers import AutoModelForCausalLM

from megatron_sat import archs
from megatron_sat.conversion import hf_io, megatron_io
from megatron_sat.conversion.mapping import (
    ConversionError,
    ModelSpec,
    hf_config,
    megatron_to_hf,
    rope_scaling_refusal,
)
from megatron_sat.conversion.model_card import model_card, public_name
from megatron_sat.data.tokenizer import load_tokenizer as load
from megatron_sat.model.config import gate_function
from megatron_sat.outputs import check_output
from megatron_sat.training import run_paths

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VERIFY_REL = 1e-4  # --verify: the export's float32 logits within this of the checkpoint's (verify_export's measure)


def check_gate_matches_authors(spec: ModelSpec) -> None:
    """Refuse a SATFormer gate whose Megatron definition differs from the authors' (and so from the export's)."""
    if not archs.get(spec.arch).gated:
        return
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    n = x.shape[-1]
    authors = {"relu": torch.relu(x), "sigmoid": torch.sigmoid(x), "tanh": torch.tanh(x), "identity": x,
               "softmax": torch.softmax(x, -1) * n, "softmax_sigmoid": torch.softmax(x, -1) * torch.sigmoid(x) * n}
    ours = gate_function(spec.value_residual_gate)(x)
    if not torch.allclose(ours, authors[spec.value_residual_gate], rtol=1e-12, atol=0):
        raise ConversionError(
            f"value_residual_gate {spec.value_residual_gate!r}: megatron_sat's definition differs from the SATFormer "
            "authors' (theirs scales softmax_sigmoid by num_kv_heads), so an export would compute a different model")


def load_tokenizer(source: Optional[str], max_length: int, flag: str = "the run's tokenizer"):
    """The HF tokenizer object of a tokenizer path or hub name, ready to save (or None for None)."""
    if source is None:
        return None
    try:
        tok = load(source).hf
    except (OSError, ValueError) as e:  # missing, not a tokenizer, not in the hub cache
        raise ConversionError(f"{flag} {source} cannot be loaded ({str(e).splitlines()[0]}): "
                              f"{NO_TOKENIZER_HINT}") from None
    tok.model_max_length = max_length
    return tok


NO_TOKENIZER_HINT = "pass --tokenizer PATH, or --no-tokenizer to export the model without one"


def find_tokenizer(tokenizer: Optional[str], no_tokenizer: bool, args: dict, run_config: dict,
                   run_dir: Optional[str]) -> Optional[str]:
    """The tokenizer to save with the export: --tokenizer, else the run's (found from any folder: run_paths), None
    with --no-tokenizer or for a run that had none (mock data). ConversionError, naming the path, where the run's
    recorded tokenizer is found nowhere."""
    if no_tokenizer:
        if tokenizer:
            raise ConversionError("--tokenizer and --no-tokenizer contradict each other: pass one")
        return None
    if tokenizer:
        return tokenizer
    try:
        return run_paths.find_tokenizer(args, run_config, run_dir)
    except run_paths.TokenizerNotFound as e:
        raise ConversionError(f"{e}: {NO_TOKENIZER_HINT}") from None


def export_checkpoint(load: str, output: str, dtype: str = "auto", overwrite: bool = False,
                      tokenizer: Optional[str] = None, max_shard_bytes: int = hf_io.DEFAULT_SHARD_BYTES,
                      verify: bool = False, verify_checkpoint: bool = True, no_tokenizer: bool = False,
                      log=print) -> dict:
    """Convert; returns a summary dict (arch, iteration, source, output, parameters, max_rel_diff if verify).

    verify_checkpoint: check the checkpoint's files against its manifest first (False: --no-verify-checkpoint).
    tokenizer: saved with the model (default: the run's, found from any folder); a run's tokenizer that cannot be
    found or loaded stops the export before anything is written, unless no_tokenizer (then the export has none)."""
    if dtype not in DTYPES:
        raise ConversionError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    try:
        check_output("--output", output, {"--load": load})
    except ValueError as e:
        raise ConversionError(str(e)) from None
    iter_dir, run_dir = megatron_io.find_checkpoint(load, verify=verify_checkpoint, log=log)  # before any set-up
    megatron_io.init_single_process()
    args, run_config = megatron_io.recorded_config(iter_dir, run_dir)
    metadata = megatron_io.tensor_metadata(iter_dir)
    spec = megatron_io.spec_from_args(args, metadata)
    check_gate_matches_authors(spec)
    if spec.use_rope_scaling and archs.get(spec.arch).hf_class:  # before the weights are read
        raise rope_scaling_refusal(spec.arch)
    source = find_tokenizer(tokenizer, no_tokenizer, args, run_config, run_dir)
    tok = load_tokenizer(source, spec.max_position_embeddings, "--tokenizer" if tokenizer else "the run's tokenizer")
    ckpt_dtype = metadata[megatron_io.EMBEDDING_KEY].dtype
    out_dtype = DTYPES[dtype] or ckpt_dtype
    log(f"loading {spec.arch} from {iter_dir} ({ckpt_dtype}, vocabulary {spec.vocab_size})")
    _, chunks = megatron_io.make_model(spec, ckpt_dtype)
    model = chunks[0]
    megatron_io.load_weights(model, iter_dir, metadata)
    weights = {k: v.to(out_dtype) for k, v in megatron_to_hf(megatron_io.full_state(model), spec).items()}
    ids = {}
    if tok is not None:
        ids = dict(bos=tok.bos_token_id, eos=tok.eos_token_id, pad=tok.pad_token_id)
    config = hf_config(spec, out_dtype, **ids)
    common = _common(iter_dir)
    name = os.path.basename(iter_dir)
    info = dict(arch=spec.arch, iteration=int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None,
                source=os.path.join(os.path.basename(os.path.dirname(os.path.abspath(iter_dir))), name),
                saved_layout=common.get("layout"), spec=spec.to_dict(),
                tokenizer=public_name(getattr(tok, "name_or_path", None)),
                dtype=str(out_dtype).replace("torch.", ""), parameters=sum(t.numel() for t in weights.values()),
                consumed_samples=common.get("consumed_train_samples"))
    card = model_card(info, run_config, run_dir, common.get("consumed_train_samples"))
    path = hf_io.write_hf_folder(output, spec, config, weights, tokenizer=tok, overwrite=overwrite,
                                 max_shard_bytes=max_shard_bytes,
                                 extra_files={"megatron_sat_conversion.json": json.dumps(info, indent=1, default=str),
                                              "README.md": card})
    info["output"] = path
    without = ("no tokenizer (--no-tokenizer)" if no_tokenizer else
               "no tokenizer (the run recorded none: mock data; add one with --tokenizer PATH)")
    log(f"wrote {path}: {spec.arch} as {config['architectures'][0]}, {info['parameters']:,} parameters, "
        f"{info['dtype']}, {f'tokenizer {tok.name_or_path}' if tok is not None else without}")
    if verify:
        if out_dtype != ckpt_dtype:  # the export's weights are rounded: compare against those
            megatron_io.set_full_state(model, {k: v.to(out_dtype).to(ckpt_dtype)
                                               for k, v in megatron_io.full_state(model).items()})
        info["max_rel_diff"] = verify_export(model, path, spec)
        log(f"verify: relative max logit difference Megatron vs export = {info['max_rel_diff']:.2e}")
    return info


def _common(iter_dir: str) -> dict:
    """The checkpoint's common state (layout, iteration, consumed samples, ...)."""
    return dist_checkpointing.load_common_state_dict(iter_dir)


def verify_export(model, hf_dir: str, spec: ModelSpec, seq: int = 16, batch: int = 2) -> float:
    """Relative max difference of the logits of the Megatron model and the export, in float32."""
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True, dtype=torch.float32).eval()
    if next(model.parameters()).dtype != torch.float32:  # compare in float32, on the same (rounded) weights
        weights = {k: v.float() for k, v in megatron_io.full_state(model).items()}
        _, chunks = megatron_io.make_model(spec, torch.float32)
        model = chunks[0]
        megatron_io.set_full_state(model, weights)
    model.eval()
    seq = min(seq, spec.max_position_embeddings)
    tokens = torch.randint(0, spec.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens, torch.arange(seq)[None].expand(batch, seq), None).float()
        theirs = hf(tokens).logits.float()
    return ((ours - theirs).abs().max() / ours.abs().max()).item()


def verify_failure(rel: float) -> Optional[str]:
    """What --verify reports for verify_export's figure: None within VERIFY_REL, else one line (NaN fails too)."""
    if rel <= VERIFY_REL:
        return None
    return f"the export's logits differ from the checkpoint's (relative {rel:.2e}, more than {VERIFY_REL:g})"
